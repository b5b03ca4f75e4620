// The TCP side of one-sided windows (comm/window.h): one link per peer on another host (over TLS
// when the Context has it on: net/tls_stream.h), and the progress thread that reads their frames
// (window_wire.h), does what a peer asks of this rank's windows and completes this rank's
// operations when the peers' replies arrive. Kept apart from
// WindowHub so that the hub holds window state and shared-memory access only, and everything a
// remote peer can make this process do goes through the narrow WindowTarget below.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/context.h"
#include "comm/window_wire.h"
#include "net/socket.h"

namespace rumor {

class WinOp;

enum class MutexGrant { kGranted, kHeld, kNoWindow };

// What the progress thread may do to this rank's windows for a remote peer. WindowHub, which owns
// the windows, implements it; every call comes from the progress thread and looks the window up
// afresh, so a window freed meanwhile answers kUnknownWindow.
class WindowTarget {
 public:
  // The registered size (count * element size) of window `id`, nullopt when there is none.
  virtual std::optional<uint64_t> window_bytes(uint64_t id) const = 0;
  // The largest window ever created here: a put to a freed window carries at most that much.
  virtual uint64_t max_window_bytes() const = 0;
  // slot[sender] of window id = weight * x, or += with accumulate (p likewise with with_p).
  // Returns kUnknownWindow or kSizeMismatch (bytes is x's size) without writing, else kOk; throws
  // Error when the slot stays locked past the deadline.
  virtual uint32_t write_slot(uint64_t id, uint32_t sender, const std::byte* x, uint64_t bytes,
                              bool accumulate, double weight, bool with_p, double p,
                              const Deadline& deadline) = 0;
  // A copy of the value this rank publishes (its self slot) and its p, for a remote win_get.
  // Returns kUnknownWindow or kOk; throws Error when the slot stays locked past the deadline.
  virtual uint32_t read_published(uint64_t id, std::vector<std::byte>* out, double* p,
                                  const Deadline& deadline) = 0;
  // Takes this rank's mutex of window id for `requester` if nobody holds it.
  virtual MutexGrant try_grant_mutex(uint64_t id, uint32_t requester) = 0;
  // Releases this rank's mutex of window id held by `holder`: kOk, kNotHolder or kUnknownWindow.
  virtual uint32_t release_mutex(uint64_t id, uint32_t holder) = 0;

 protected:
  ~WindowTarget() = default;
};

class WindowProgress {
 public:
  // target must outlive this object or call stop() before it goes away.
  WindowProgress(std::shared_ptr<Context> ctx, WindowTarget& target);
  ~WindowProgress();
  WindowProgress(const WindowProgress&) = delete;
  WindowProgress& operator=(const WindowProgress&) = delete;

  // Opens a link to each rank in `remote` (the first call that gets through all of them is the
  // last that dials) and starts the progress thread once there is a link. A link opened before an
  // earlier call failed stays: the listener hands out each stream once per Context, so dialing it
  // again would be refused.
  void connect(const std::vector<uint32_t>& remote, const Deadline& deadline);
  // Registers `part` as waiting for `peer`, queues `frame` (its op_id filled in here) with
  // `payload` (frame.bytes bytes, not copied: it must stay alive until the part completes) and
  // wakes the progress thread; a dead link completes the part with its error and rethrows it.
  void submit(const std::shared_ptr<WinOp>& part, uint32_t peer, window_wire::WinFrame frame,
              const std::byte* payload);
  // An operation's deadline passed while waiting for these peers: the progress thread fails their
  // links, which completes every operation waiting for them, so no caller's buffer stays in use.
  void abort(const std::vector<uint32_t>& peers);
  // Waits until no operation on window `id` waits for a remote reply; false on deadline.
  bool wait_idle(uint64_t id, const Deadline& deadline);
  // Stops and joins the progress thread (idempotent): the hub calls it before its windows go.
  void stop();

  // The number of frames applied to this rank's windows (test hook).
  uint64_t frames_applied() const { return frames_applied_.load(); }
  // See WindowHub::set_reply_limits.
  void set_reply_limits(size_t count, size_t bytes) {
    reply_limit_count_.store(count);
    reply_limit_bytes_.store(bytes);
  }

 private:
  struct Link;
  struct OutMsg;
  struct Inflight;

  Link& link(uint32_t peer);
  void wake();
  void loop();
  void read_frames(Link& l);
  void write_frames(Link& l);
  void handle_frame(Link& l);
  void reply(Link& l, const window_wire::WinFrame& req, uint8_t kind, uint32_t status, double p,
             std::shared_ptr<std::vector<std::byte>> payload);
  // `news`: log it even when no operation waited on the link.
  void fail_link(Link& l, const std::string& why, bool news = false);
  // Up to n bytes of the link's stream (plaintext, over TLS); 0 when none can be read now.
  size_t receive(Link& l, std::byte* into, size_t n);
  void retry_remote_mutexes();
  void finish_inflight(uint64_t op_id, uint32_t peer, std::exception_ptr err);

  std::shared_ptr<Context> ctx_;
  WindowTarget& target_;
  uint32_t rank_;

  mutable std::mutex mu_;  // inflight_, next_op_, links_ and their queues
  std::condition_variable idle_cv_;
  std::map<uint64_t, Inflight> inflight_;  // op id -> waiting op
  uint64_t next_op_ = 1;
  std::vector<std::unique_ptr<Link>> links_;  // by world rank; null for self and same-host peers
  bool links_built_ = false;
  // Remote mutex requests waiting for this rank's window mutex: (requester, window, op id).
  // Touched by the progress thread only.
  std::vector<std::tuple<uint32_t, uint64_t, uint64_t>> mutex_waiters_;

  net::Fd wake_fd_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> frames_applied_{0};
  std::atomic<size_t> reply_limit_count_{4096};
  std::atomic<size_t> reply_limit_bytes_{size_t{256} << 20};
  std::thread thread_;
};

}  // namespace rumor
