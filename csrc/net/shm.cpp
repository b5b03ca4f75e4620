#include "net/shm.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "core/futex.h"
#include "core/reduce.h"
#include "net/socket.h"

namespace rumor::net {

namespace {
// The writer publishes in whole multiples of this (and pads each message to it), so payloads
// start aligned and a published range never ends inside an element.
constexpr size_t kAlign = 32;

struct SegHeader {
  uint64_t magic;
  std::atomic<uint32_t> ready;
  std::atomic<uint32_t> opened;  // the peer has mapped the segment
  char pad[48];
  RingCtl ring[2];
};
constexpr uint64_t kSegMagic = 0x52554d4f52534d31ull;

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
}  // namespace

namespace {
// Who owns an existing name, for the error when it is not ours (best effort: /dev/shm is where
// glibc keeps POSIX shared memory).
std::string owner_of(const std::string& name) {
  struct stat st{};
  if (::lstat(("/dev/shm" + name).c_str(), &st) != 0) return "";
  char mode[8];
  std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
  return " (owner uid " + std::to_string(st.st_uid) + ", mode " + mode + ")";
}

// A segment is trusted only if this user made it and nobody else can open it: another local user
// could otherwise create the name first and feed this process rings and frames of its choosing.
void check_private(int fd, const std::string& name, const std::string& what) {
  struct stat st{};
  if (::fstat(fd, &st) != 0)
    throw Error(ErrorKind::kSystem, what + ": fstat(" + name + "): " + errno_string(errno));
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw Error(ErrorKind::kProtocol,
                what + ": refusing shared memory " + name + ": owned by uid " + std::to_string(st.st_uid) +
                    " with mode " + mode + ", expected uid " + std::to_string(::geteuid()) +
                    " and no group/other access (another user created it first? remove it and retry)");
  }
}
}  // namespace

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  // O_EXCL: a name that exists (another user's, or a stale one) is an error, never adopted.
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    int err = errno;
    throw Error(ErrorKind::kSystem, "shm_open(" + name + "): " + errno_string(err) +
                                        (err == EEXIST ? owner_of(name) : std::string()));
  }
  Fd guard(fd);
  // The umask may only take bits away, but be exact: 0600 whatever the umask says.
  if (::fchmod(fd, 0600) != 0) {
    ::shm_unlink(name.c_str());
    throw Error(ErrorKind::kSystem, "fchmod(" + name + "): " + errno_string(errno));
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    ::shm_unlink(name.c_str());
    throw Error(ErrorKind::kSystem, "ftruncate(" + name + "): " + errno_string(errno));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    throw Error(ErrorKind::kSystem, "mmap(" + name + "): " + errno_string(errno));
  }
  ShmSegment s;
  s.data_ = p;
  s.size_ = bytes;
  s.name_ = name;
  s.owns_name_ = true;
  return s;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes, const Deadline& deadline,
                            const std::string& what, const std::function<void()>& poll) {
  while (true) {
    int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd >= 0) {
      Fd guard(fd);
      check_private(fd, name, what);  // before a byte of it is mapped
      struct stat st{};
      // The creator may not have sized it yet; mapping past EOF would SIGBUS.
      if (::fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= bytes) {
        void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) throw Error(ErrorKind::kSystem, "mmap(" + name + "): " + errno_string(errno));
        ShmSegment s;
        s.data_ = p;
        s.size_ = bytes;
        s.name_ = name;
        return s;
      }
    } else if (errno != ENOENT) {
      throw Error(ErrorKind::kSystem, what + ": shm_open(" + name + "): " + errno_string(errno));
    }
    if (deadline.expired())
      throw Error(ErrorKind::kTimeout, what + ": the peer did not create shared memory " + name +
                                           " before the deadline (is it running the same operation?)");
    if (poll) poll();
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}

ShmSegment::ShmSegment(ShmSegment&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      name_(std::move(o.name_)),
      owns_name_(std::exchange(o.owns_name_, false)) {}

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    this->~ShmSegment();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    name_ = std::move(o.name_);
    owns_name_ = std::exchange(o.owns_name_, false);
  }
  return *this;
}

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  unlink_name();
}

void ShmSegment::populate(const std::string& what) const {
#ifdef MADV_POPULATE_WRITE
  if (data_ == nullptr || size_ == 0) return;
  int rc;
  do {
    rc = ::madvise(data_, size_, MADV_POPULATE_WRITE);
  } while (rc != 0 && (errno == EINTR || errno == EAGAIN));
  if (rc == 0 || errno == EINVAL) return;  // EINVAL: a kernel without it; pages fault in lazily
  if (errno == EFAULT || errno == ENOMEM)
    throw Error(ErrorKind::kSystem, what + ": shared memory cannot hold " + std::to_string(size_) +
                                        " bytes of " + name_ + " (" + errno_string(errno) +
                                        "; is /dev/shm full or too small?)");
#else
  (void)what;
#endif
}

void ShmSegment::unlink_name() {
  if (!name_.empty()) ::shm_unlink(name_.c_str());
  name_.clear();
  owns_name_ = false;
}

void ring_doorbell(Doorbell* d) {
  d->seq.fetch_add(1, std::memory_order_seq_cst);
  if (d->sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&d->seq);
}

void wait_doorbell(Doorbell* d, uint32_t seen, int timeout_us) {
  d->sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (d->seq.load(std::memory_order_seq_cst) == seen) futex_wait(&d->seq, seen, timeout_us);
  d->sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

ShmChannel::ShmChannel(const std::string& name, bool creator, size_t ring_bytes, Doorbell* own,
                       Doorbell* peer, std::string peer_desc, const Deadline& deadline)
    : cap_(round_up(std::max<size_t>(ring_bytes, 4096), kAlign)),
      own_(own),
      peer_(peer),
      peer_desc_(std::move(peer_desc)) {
  const size_t bytes = sizeof(SegHeader) + 2 * cap_;
  SegHeader* h;
  if (creator) {
    seg_ = ShmSegment::create(name, bytes);
    h = new (seg_.data()) SegHeader{};  // placement-new on shared memory, owned by seg_
    h->magic = kSegMagic;
    h->ready.store(1, std::memory_order_release);
  } else {
    seg_ = ShmSegment::open(name, bytes, deadline, "shared-memory channel to " + peer_desc_);
    h = static_cast<SegHeader*>(seg_.data());
    while (h->ready.load(std::memory_order_acquire) == 0) {
      if (deadline.expired())
        throw Error(ErrorKind::kTimeout, "shared-memory channel to " + peer_desc_ + " never became ready");
      std::this_thread::yield();
    }
    if (h->magic != kSegMagic)
      throw Error(ErrorKind::kProtocol, "shared-memory channel to " + peer_desc_ + ": segment " + name +
                                            " is not a rumor channel (bad magic)");
    // Both sides have it mapped now; the name is no longer needed, and removing it early
    // means a crash later cannot leak it.
    h->opened.store(1, std::memory_order_release);
    seg_.unlink_name();
  }
  header_ = h;
  creator_ = creator;
  out_idx_ = creator ? 0 : 1;
  out_ = &h->ring[out_idx_];
  in_ = &h->ring[1 - out_idx_];
}

ShmChannel::~ShmChannel() {
  // A peer that has not mapped the segment yet may still need it: the messages we sent are in
  // there (as they would be in flight on a socket). It removes the name once it has mapped it.
  if (creator_ && static_cast<SegHeader*>(header_)->opened.load(std::memory_order_acquire) == 0)
    seg_.keep_name();
}

std::byte* ShmChannel::ring_data(int which) const {
  return static_cast<std::byte*>(seg_.data()) + sizeof(SegHeader) + static_cast<size_t>(which) * cap_;
}

void ShmChannel::begin(Transfer& t, const OpInfo& op) {
  t.nparts = 1;
  t.parts[0] = Part{};
  t.parts[0].len = t.len;
  t.parts[0].pad_left = round_up(t.len, kAlign) - t.len;
  if (t.send) t.parts[0].hdr = make_header(t.parts[0], t, op);
  t.begun = true;
}

void ShmChannel::check_aborted(const Transfer& t, const OpInfo& op) const {
  if (out_->aborted.load(std::memory_order_acquire) != 0 || in_->aborted.load(std::memory_order_acquire) != 0)
    throw Error(ErrorKind::kPeerGone,
                op.where() + ": " + peer_desc_ + " aborted after an error of its own while this rank was " +
                    (t.send ? "sending " : "receiving ") + std::to_string(t.len) + " bytes");
}

void ShmChannel::corrupt(const char* which, uint64_t got, uint64_t mine) const {
  throw Error(ErrorKind::kProtocol, "shared-memory channel to " + peer_desc_ + ": corrupt ring " + which +
                                        " " + std::to_string(got) + " (this side is at " +
                                        std::to_string(mine) + ", ring of " + std::to_string(cap_) +
                                        " bytes): the peer's memory is damaged or it is not a rumor process");
}

bool ShmChannel::progress_send(Part& p, Transfer& t) {
  std::byte* ring = ring_data(out_idx_);
  // Our own position is kept privately: only the peer's index is read back from shared memory,
  // and it is checked before it sizes anything.
  uint64_t head = out_head_;
  uint64_t published = head;
  uint64_t tail = out_->tail.load(std::memory_order_acquire);
  if (tail > head || head - tail > cap_) corrupt("tail", tail, head);
  size_t space = cap_ - static_cast<size_t>(head - tail);
  bool moved = false;
  if (p.hdr_done == 0) {
    if (space < sizeof(FrameHeader)) return false;
    std::memcpy(ring + head % cap_, &p.hdr, sizeof(FrameHeader));  // 32 | cap: never wraps
    head += sizeof(FrameHeader);
    space -= sizeof(FrameHeader);
    p.hdr_done = sizeof(FrameHeader);
    moved = true;
  }
  // Publish in quarter-ring pieces so the reader can start while we keep writing.
  const size_t piece_max = cap_ / 4;
  while (p.done < p.len && space >= kAlign) {
    size_t n = std::min({p.len - p.done, space, piece_max});
    bool last = p.done + n == p.len;
    if (!last)
      n = n / kAlign * kAlign;
    else if (round_up(n, kAlign) > space)
      n = (space / kAlign) * kAlign, last = false;
    if (n == 0) break;
    size_t at = head % cap_;
    size_t first = std::min(n, cap_ - at);
    std::memcpy(ring + at, t.data + p.offset + p.done, first);
    if (first < n) std::memcpy(ring, t.data + p.offset + p.done + first, n - first);
    p.done += n;
    size_t adv = last ? round_up(n, kAlign) : n;
    head += adv;
    space -= adv;
    if (last) p.pad_left = 0;
    moved = true;
    // Publish each piece, so the reader starts on it while we write the next.
    out_head_ = head;
    out_->head.store(head, std::memory_order_release);
    ring_doorbell(peer_);
    published = head;
  }
  if (head != published) {  // only the header went out
    out_head_ = head;
    out_->head.store(head, std::memory_order_release);
    ring_doorbell(peer_);
  }
  return moved;
}

bool ShmChannel::progress_recv(Part& p, Transfer& t, const OpInfo& op) {
  const std::byte* ring = ring_data(1 - out_idx_);
  uint64_t tail = in_tail_;
  uint64_t head = in_->head.load(std::memory_order_acquire);
  if (head < tail || head - tail > cap_) corrupt("head", head, tail);
  size_t avail = static_cast<size_t>(head - tail);
  bool moved = false;
  if (p.hdr_done == 0) {
    if (avail < sizeof(FrameHeader)) return false;
    std::memcpy(&p.hdr, ring + tail % cap_, sizeof(FrameHeader));
    check_header(p.hdr, p, t, op, peer_desc_);
    tail += sizeof(FrameHeader);
    avail -= sizeof(FrameHeader);
    p.hdr_done = sizeof(FrameHeader);
    moved = true;
  }
  while (p.done < p.len && avail > 0) {
    size_t n = std::min(p.len - p.done, avail);
    size_t at = tail % cap_;
    size_t first = std::min(n, cap_ - at);
    std::byte* dst = t.data + p.offset + p.done;
    if (t.reduce) {
      const size_t es = dtype_size(t.dtype);
      reduce_into(dst, ring + at, first / es, t.dtype, t.op);
      if (first < n) reduce_into(dst + first, ring, (n - first) / es, t.dtype, t.op);
    } else {
      std::memcpy(dst, ring + at, first);
      if (first < n) std::memcpy(dst + first, ring, n - first);
    }
    p.done += n;
    tail += n;
    avail -= n;
    moved = true;
  }
  if (p.done == p.len && p.pad_left > 0 && avail >= p.pad_left) {
    tail += p.pad_left;
    p.pad_left = 0;
    moved = true;
  }
  if (moved) {
    in_tail_ = tail;
    in_->tail.store(tail, std::memory_order_release);
    ring_doorbell(peer_);
  }
  return moved;
}

bool ShmChannel::progress(Transfer& t, const OpInfo& op) {
  check_aborted(t, op);
  Part& p = t.parts[0];
  if (p.finished()) return false;
  return t.send ? progress_send(p, t) : progress_recv(p, t, op);
}

// A process that exited but was not reaped yet still answers kill(pid, 0): read its state too.
bool process_gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');  // the name may contain spaces or parentheses
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}
void ShmChannel::check_alive(const OpInfo& op) {
  if (peer_->pid > 0 && process_gone(peer_->pid))
    throw Error(ErrorKind::kPeerGone,
                op.where() + ": " + peer_desc_ + " (pid " + std::to_string(peer_->pid) + ") exited");
}

void ShmChannel::abort() {
  out_->aborted.store(1, std::memory_order_release);
  in_->aborted.store(1, std::memory_order_release);
  ring_doorbell(peer_);
  ring_doorbell(own_);
}

}  // namespace rumor::net
