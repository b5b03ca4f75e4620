// Shared-memory pieces: POSIX shm segments, the per-process doorbell that lets one rank sleep
// on all of its shared-memory peers at once, and the pair channel built from two rings.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "net/channel.h"

namespace rumor::net {

// An mmap'ed POSIX shared-memory object; unlinks its name on destruction if it created it.
class ShmSegment {
 public:
  ShmSegment() = default;
  // Creates with O_EXCL|O_NOFOLLOW and mode 0600: an existing name is an error, never adopted.
  static ShmSegment create(const std::string& name, size_t bytes);
  // Retries until the creator has made it and sized it to at least `bytes`, or the deadline.
  // Whether the creator has also filled it in is for the caller to check (each layout marks that
  // in its own header, e.g. a `ready` flag the creator sets last).
  // Refuses (kProtocol, naming the segment and its owner) a segment that is not this euid's or
  // that grants group/other access, before mapping it. `poll`, where given, runs between tries
  // and may throw to give up before the deadline (a creator known to be gone).
  static ShmSegment open(const std::string& name, size_t bytes, const Deadline& deadline,
                         const std::string& what, const std::function<void()>& poll = {});
  ShmSegment(ShmSegment&& o) noexcept;
  ShmSegment& operator=(ShmSegment&& o) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();
  void* data() const { return data_; }
  size_t size() const { return size_; }
  void unlink_name();
  // Maps every page of the segment into this process now (allocating the ones nobody touched
  // yet), so that later accesses take no page faults. Best effort where the kernel lacks
  // MADV_POPULATE_WRITE (before Linux 5.14): the pages then fault in on first use as before.
  // Throws if shared memory cannot hold the segment (where a later access would die of SIGBUS).
  void populate(const std::string& what) const;
  // Leaves the name in place when this object goes away (someone else will unlink it).
  void keep_name() { name_.clear(); }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  bool owns_name_ = false;
};

// One per process. Peers bump seq after they publish data or free ring space for us; we
// futex-wait on it when no transfer can move.
struct Doorbell {
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> sleepers;
  int32_t pid;
  uint32_t magic;
};
constexpr uint32_t kDoorbellMagic = 0x44424c4c;

void ring_doorbell(Doorbell* d);

// Whether the process has exited (gone, or a zombie not reaped yet).
bool process_gone(pid_t pid);

// Sleeps until a doorbell ring newer than `seen`, or timeout_us. Caller read `seen` before its
// last unsuccessful progress attempt, so a ring in between is never lost.
void wait_doorbell(Doorbell* d, uint32_t seen, int timeout_us);

struct alignas(64) RingCtl {
  std::atomic<uint64_t> head;  // bytes published by the writer
  char pad0[56];
  std::atomic<uint64_t> tail;  // bytes consumed by the reader
  char pad1[56];
  std::atomic<uint32_t> aborted;
  char pad2[60];
};

class ShmChannel final : public Channel {
 public:
  // The creator makes the segment; the other side waits for it (both until the deadline).
  ShmChannel(const std::string& name, bool creator, size_t ring_bytes, Doorbell* own, Doorbell* peer,
             std::string peer_desc, const Deadline& deadline);
  ~ShmChannel() override;
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;
  bool is_shm() const override { return true; }
  void begin(Transfer& t, const OpInfo& op) override;
  bool progress(Transfer& t, const OpInfo& op) override;
  void want(const Transfer&, std::vector<pollfd>&) const override {}
  void check_alive(const OpInfo& op) override;
  void abort() override;

 private:
  bool progress_send(Part& p, Transfer& t);
  bool progress_recv(Part& p, Transfer& t, const OpInfo& op);
  void check_aborted(const Transfer& t, const OpInfo& op) const;
  std::byte* ring_data(int which) const;
  [[noreturn]] void corrupt(const char* which, uint64_t got, uint64_t mine) const;

  ShmSegment seg_;
  void* header_ = nullptr;
  bool creator_ = false;
  size_t cap_;
  RingCtl* out_ = nullptr;
  RingCtl* in_ = nullptr;
  int out_idx_ = 0;
  // This side's ring positions, private: the copies in shared memory are for the peer to read,
  // never read back (a peer could have changed them).
  uint64_t out_head_ = 0;
  uint64_t in_tail_ = 0;
  Doorbell* own_;
  Doorbell* peer_;
  std::string peer_desc_;
};

}  // namespace rumor::net
