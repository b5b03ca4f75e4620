// One-sided windows (BlueFog's win_* operations): every rank exposes, per named window, a
// shared-memory segment holding one slot per world rank. Slot j != self receives what rank j
// puts, accumulates or what this rank gets from j; slot self holds the value this rank
// publishes for others to get. Progress is passive on the target:
//  - a peer on the same host maps the segment and writes its slot directly (one scaled copy);
//  - a peer on another host sends a frame over the hub's TCP link, and the target's progress
//    thread (one per process, comm/window_progress.h, owned by WindowHub) applies it; the sender's
//    operation completes only when the target acknowledged the application, so "put returned"
//    means "it landed".
// Every access to a slot (write, accumulate, read-and-reset by update, snapshot for get) holds
// that slot's lock, a futex word in the segment, so a combined tensor is never torn and an
// accumulate is atomic per slot. Lock order: neighbour slots (ascending rank), then a self
// slot; a self-slot holder takes no other lock, so no cycle can form.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "comm/context.h"
#include "comm/window_progress.h"
#include "core/types.h"
#include "net/shm.h"

namespace rumor {

// Where one window's slot lives and what guards it. 64 bytes, at the head of every slot.
struct alignas(64) WinSlotHeader {
  std::atomic<uint32_t> lock;  // 0 free, 1 held, 2 held with sleepers (futex word)
  uint32_t reserved;
  std::atomic<uint64_t> version;  // writes since the owner last combined this slot
  double p;                       // push-sum weight carried with the data
  uint64_t writes;                // writes ever (diagnostics)
};
static_assert(sizeof(WinSlotHeader) == 64);

// An operation in flight on the hub (put / accumulate / get / remote mutex); waited on by the
// caller, completed by the caller itself (shared-memory parts) or by the progress thread
// (acknowledgements from remote targets).
class WinOp {
 public:
  WinOp(std::string what, uint64_t window) : what_(std::move(what)), window_(window) {}
  bool done() const;
  // Blocks until every part finished, rethrowing the first error. On deadline it throws
  // kTimeout naming the ranks still outstanding (the hub then drops the op's links).
  void wait(const Deadline& deadline) const;
  const std::string& what() const { return what_; }
  uint64_t window() const { return window_; }

 private:
  friend class WindowHub;
  friend class WindowProgress;
  void add_pending(uint32_t peer);
  void complete(uint32_t peer, std::exception_ptr err);
  std::vector<uint32_t> outstanding() const;

  std::string what_;
  uint64_t window_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::map<uint32_t, int> pending_;  // peer -> parts outstanding
  std::exception_ptr error_;
};

// Window state and the shared-memory paths; the TCP paths go through WindowProgress, which calls
// back into the hub (as its WindowTarget) to apply what remote peers send.
class WindowHub : private WindowTarget {
 public:
  using Weights = std::vector<std::pair<uint32_t, double>>;  // (world rank, weight)

  explicit WindowHub(std::shared_ptr<Context> ctx);
  ~WindowHub();
  WindowHub(const WindowHub&) = delete;
  WindowHub& operator=(const WindowHub&) = delete;

  // Creating a window is collective and done in three steps, each called by every rank with
  // a barrier of the caller's in between: create() makes this rank's segment (slots start as
  // copies of `data`, or zero) and the TCP links to remote peers; attach() maps the segments
  // of the peers on this host; seal() removes this rank's segment name (peers hold mappings).
  // `data` is the registered tensor: update() combines into it, publish() copies it to the
  // self slot. It must outlive the window (the Python layer holds a reference).
  void create(uint64_t id, const std::string& name, void* data, size_t count, DType dtype, bool zero_init,
              const Deadline& deadline);
  void attach(uint64_t id, const Deadline& deadline);
  void seal(uint64_t id);
  // Waits for this rank's operations on the window (until the deadline, then raises), then
  // forgets it. Collective in use: call it after a barrier so no peer still writes to it.
  void free(uint64_t id, const Deadline& deadline);
  bool has(uint64_t id) const;

  // slot[me] of each destination = w * x (put) or += w * x (accumulate); with_p also carries
  // w * p. Same-host destinations are written before this returns; remote ones complete when
  // acknowledged. require_mutex holds each destination's window mutex around its write.
  std::shared_ptr<WinOp> put(uint64_t id, const void* x, const Weights& dsts, bool accumulate, bool with_p,
                             bool require_mutex, const Deadline& deadline);
  // slot[j] = w * (j's published value) for each source j (and w * p_j with with_p).
  std::shared_ptr<WinOp> get(uint64_t id, const Weights& srcs, bool with_p, bool require_mutex,
                             const Deadline& deadline);
  // out = self_weight * data + sum_j w_j * slot_j (out may be the registered data itself); with_p
  // the same on p; reset zeroes the combined slots (data and p). Versions of the combined slots
  // drop to 0. When out is the registered data, the result is also published.
  void update(uint64_t id, double self_weight, const Weights& nbrs, bool reset, bool with_p, void* out,
              bool require_mutex, const Deadline& deadline);
  // Copies the registered tensor (and p) into the self slot, where get() reads it.
  void publish(uint64_t id, const Deadline& deadline);
  std::vector<uint64_t> versions(uint64_t id);  // one per world rank (self: 0)
  double p(uint64_t id);
  void set_p(uint64_t id, double p);
  // The window mutex of each listed rank (BlueFog's distributed mutex): acquired in ascending
  // rank order so that two acquirers of overlapping sets cannot deadlock. Re-acquiring a mutex
  // this process holds is a no-op counted once.
  void mutex_acquire(uint64_t id, std::vector<uint32_t> ranks, const Deadline& deadline);
  void mutex_release(uint64_t id, std::vector<uint32_t> ranks, const Deadline& deadline);

  // Waits for op; if the deadline passes first, the links to the ranks it still waits for are
  // failed (so nothing keeps using the caller's buffers) and the timeout is raised.
  void wait(const std::shared_ptr<WinOp>& op, const Deadline& deadline);

  // Test hook: the number of frames the progress thread applied (TCP path).
  uint64_t frames_applied() const { return progress_.frames_applied(); }
  // Replies one peer may have queued unsent (a count, and payload bytes beyond the first reply)
  // before its link is failed as flooding. Defaults: 4096 replies, 256 MiB. Tests lower them.
  void set_reply_limits(size_t count, size_t bytes) { progress_.set_reply_limits(count, bytes); }

 private:
  struct Window;

  std::shared_ptr<Window> find(uint64_t id, const char* op) const;  // throws when absent
  std::shared_ptr<Window> lookup(uint64_t id) const;                // null when absent
  bool local(uint32_t peer) const;
  void ensure_links(const Deadline& deadline);
  void mutex_acquire_one(Window& w, uint32_t target, const Deadline& deadline);
  void mutex_release_one(Window& w, uint32_t target, const Deadline& deadline);
  // Sends a frame without payload (a mutex request) to a remote target and waits for its ack.
  void remote_request(Window& w, uint32_t target, uint8_t kind, const std::string& what,
                      const Deadline& deadline);
  void check_alive(const Window& w, uint32_t peer, const std::string& what) const;

  // WindowTarget: what remote peers' frames do here (progress thread).
  std::optional<uint64_t> window_bytes(uint64_t id) const override;
  uint64_t max_window_bytes() const override { return max_window_bytes_.load(); }
  uint32_t write_slot(uint64_t id, uint32_t sender, const std::byte* x, uint64_t bytes, bool accumulate,
                      double weight, bool with_p, double p, const Deadline& deadline) override;
  uint32_t read_published(uint64_t id, std::vector<std::byte>* out, double* p,
                          const Deadline& deadline) override;
  MutexGrant try_grant_mutex(uint64_t id, uint32_t requester) override;
  uint32_t release_mutex(uint64_t id, uint32_t holder) override;

  std::shared_ptr<Context> ctx_;
  uint32_t rank_, size_;

  mutable std::mutex mu_;  // windows_
  std::map<uint64_t, std::shared_ptr<Window>> windows_;
  std::atomic<uint64_t> max_window_bytes_{0};  // largest window ever created here (drain limit)
  // Last: it is stopped (its thread calls back into the members above) before they go away.
  WindowProgress progress_;
};

}  // namespace rumor
