#include "comm/window.h"

#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <optional>

#include "comm/neighbor.h"
#include "comm/window_wire.h"
#include "core/futex.h"
#include "core/log.h"

namespace rumor {

using namespace window_wire;  // NOLINT: the frame kinds and statuses read as before the split

namespace {

constexpr uint32_t kSegMagic = 0x444e4957;  // "WIND"
// Window links are TCP streams tagged with this communicator id (groups use small ids,
// hierarchical sub-communicators ids above 2^48).
constexpr uint64_t kWindowCommId = 1ull << 62;
constexpr size_t kMaxMutexWaitersPerPeer = 1024;
// Payload of a frame nobody will use (see window_wire::Payload::kDrain) is read in pieces this big.
constexpr size_t kDrainPiece = 64 << 10;

struct alignas(64) SegHeader {
  uint32_t magic;
  int32_t pid;
  uint32_t owner;
  uint32_t nranks;
  uint64_t count;
  uint32_t dtype;
  uint32_t reserved;
  std::atomic<uint32_t> mutex;  // holder's world rank + 1; 0 when free
  char pad[28];
};
static_assert(sizeof(SegHeader) == 64);

size_t round64(size_t n) { return (n + 63) & ~size_t{63}; }

// A futex lock word in shared memory with a deadline; `what` names the wait for the error.
void lock_word(std::atomic<uint32_t>& w, const Deadline& deadline, const std::function<std::string()>& what) {
  for (int i = 0; i < 128; ++i) {
    uint32_t expected = 0;
    if (w.compare_exchange_weak(expected, 1, std::memory_order_acquire)) return;
  }
  for (;;) {
    if (w.exchange(2, std::memory_order_acquire) == 0) return;
    if (deadline.expired()) throw Error(ErrorKind::kTimeout, what());
    futex_wait(&w, 2, 10000);
  }
}

void unlock_word(std::atomic<uint32_t>& w) {
  if (w.exchange(0, std::memory_order_release) == 2) futex_wake_all(&w);
}

class SlotGuard {
 public:
  SlotGuard(WinSlotHeader* s, const Deadline& deadline, const std::function<std::string()>& what) : s_(s) {
    lock_word(s_->lock, deadline, what);
  }
  ~SlotGuard() { unlock_word(s_->lock); }
  SlotGuard(const SlotGuard&) = delete;
  SlotGuard& operator=(const SlotGuard&) = delete;

 private:
  WinSlotHeader* s_;
};

// dst = w * x, or dst += w * x. Halves are combined in float and rounded once.
void scaled_write(void* dst, const void* x, size_t count, DType dtype, double w, bool accumulate) {
  if (accumulate) {
    const void* srcs[] = {x};
    const double ws[] = {w};
    weighted_sum(dst, dst, 1.0, srcs, ws, count, dtype);
  } else if (w == 1.0) {
    std::memcpy(dst, x, count * dtype_size(dtype));
  } else {
    weighted_sum(dst, x, w, {}, {}, count, dtype);
  }
}

}  // namespace

struct WindowHub::Window {
  uint64_t id = 0;
  std::string name;
  void* data = nullptr;
  size_t count = 0;
  DType dtype = DType::F32;
  size_t bytes = 0;
  size_t stride = 0;  // slot header + data, 64-byte aligned
  uint32_t nranks = 0;
  net::ShmSegment own;
  std::vector<net::ShmSegment> peers;  // mapped segments of same-host ranks
  std::vector<std::byte*> base;        // segment of each rank this process can address, else null
  std::mutex held_mu;
  std::set<uint32_t> held;  // ranks whose window mutex this process holds

  SegHeader* header(uint32_t owner) const { return reinterpret_cast<SegHeader*>(base[owner]); }
  WinSlotHeader* slot(uint32_t owner, uint32_t j) const {
    return reinterpret_cast<WinSlotHeader*>(base[owner] + sizeof(SegHeader) + j * stride);
  }
  std::byte* slot_data(uint32_t owner, uint32_t j) const {
    return reinterpret_cast<std::byte*>(slot(owner, j)) + sizeof(WinSlotHeader);
  }
  std::string desc() const { return "window '" + name + "'"; }
};

struct WindowHub::OutMsg {
  WinFrame hdr{};
  bool reply = false;                             // counted against the link's reply budget
  const std::byte* data = nullptr;                // payload not owned (a put's tensor: alive until acked)
  std::shared_ptr<std::vector<std::byte>> owned;  // or owned (a get's reply)
};

struct WindowHub::Link {
  uint32_t peer = 0;
  net::Fd fd;
  bool dead = false;
  bool abort_requested = false;
  std::string why;
  // Incoming frame being read.
  WinFrame in{};
  size_t in_hdr = 0;
  std::vector<std::byte> payload;
  size_t in_got = 0;
  bool draining = false;  // payload read into `drain` and discarded (see window_wire::Payload)
  // Replies queued for this peer and their payload bytes: bounded (reply_limits_), so a peer
  // that sends requests without reading the answers cannot grow this process's memory.
  size_t replies_queued = 0;
  size_t reply_bytes_queued = 0;
  // Outgoing frames; the front one is being written (out_off bytes of frame + payload done).
  std::deque<OutMsg> out;
  size_t out_off = 0;
};

// A remote part of an operation, waiting for the target's reply (the reply echoes the request's
// weight and p flag, so nothing else needs keeping here).
struct WindowHub::Inflight {
  std::shared_ptr<WinOp> op;
  uint32_t peer = 0;
};

// ---- WinOp ----

bool WinOp::done() const {
  std::lock_guard lk(mu_);
  return pending_.empty();
}

void WinOp::add_pending(uint32_t peer) {
  std::lock_guard lk(mu_);
  ++pending_[peer];
}

void WinOp::complete(uint32_t peer, std::exception_ptr err) {
  std::lock_guard lk(mu_);
  // Moved in, never copied: the waiter rethrows this very object, so no other thread may keep a
  // reference whose release could come last (the refcount lives in uninstrumented libstdc++).
  if (err && !error_) error_ = std::move(err);
  auto it = pending_.find(peer);
  if (it != pending_.end() && --it->second == 0) pending_.erase(it);
  if (pending_.empty()) cv_.notify_all();
}

std::vector<uint32_t> WinOp::outstanding() const {
  std::lock_guard lk(mu_);
  std::vector<uint32_t> v;
  for (const auto& [peer, n] : pending_) v.push_back(peer);
  return v;
}

void WinOp::wait(const Deadline& deadline) const {
  std::unique_lock lk(mu_);
  if (!cv_.wait_until(lk, deadline.at(), [&] { return pending_.empty(); })) {
    std::string ranks;
    for (const auto& [peer, n] : pending_) ranks += (ranks.empty() ? "" : ", ") + std::to_string(peer);
    throw Error(ErrorKind::kTimeout, what_ + ": deadline passed waiting for rank(s) " + ranks +
                                         " to acknowledge (is the peer alive and progressing?)");
  }
  if (error_) {
    // A copy, not the stored object: the progress thread may drop the last reference to this
    // operation (and its error) while the caller still reads what(), and that hand-over would go
    // through libstdc++'s exception refcount, which no sanitizer can see.
    try {
      std::rethrow_exception(error_);
    } catch (const Error& e) {
      throw Error(e.kind(), e.what());
    }
  }
}

// ---- WindowHub ----

WindowHub::WindowHub(std::shared_ptr<Context> ctx)
    : ctx_(std::move(ctx)), rank_(ctx_->rank()), size_(ctx_->size()) {
  links_.resize(size_);
  int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd < 0) throw Error(ErrorKind::kSystem, "window hub: eventfd: " + net::errno_string(errno));
  wake_fd_ = net::Fd(fd);
}

WindowHub::~WindowHub() {
  stop_.store(true);
  wake();
  if (thread_.joinable()) thread_.join();
}

bool WindowHub::local(uint32_t peer) const { return ctx_->options().shm && ctx_->same_host(rank_, peer); }

bool WindowHub::has(uint64_t id) const {
  std::lock_guard lk(mu_);
  return windows_.count(id) != 0;
}

std::shared_ptr<WindowHub::Window> WindowHub::find(uint64_t id, const char* op) const {
  std::lock_guard lk(mu_);
  auto it = windows_.find(id);
  if (it == windows_.end())
    throw Error(ErrorKind::kInvalidArgument,
                std::string(op) + ": window #" + std::to_string(id) + " does not exist (freed?)");
  return it->second;
}

void WindowHub::wake() {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
}

void WindowHub::check_alive(const Window& w, uint32_t peer, const std::string& what) const {
  // A write into a dead peer's segment would succeed and be lost: fail instead, as TCP does.
  const int32_t pid = w.header(peer)->pid;
  if (pid > 0 && net::process_gone(pid))
    throw Error(ErrorKind::kPeerGone,
                what + ": rank " + std::to_string(peer) + " (pid " + std::to_string(pid) + ") has exited");
}

void WindowHub::ensure_links(const Deadline& deadline) {
  if (links_built_) return;
  for (uint32_t r = 0; r < size_; ++r) {
    // A link built before an earlier call failed stays: the listener hands out each stream
    // once per Context, so dialing it again would be refused.
    if (r == rank_ || local(r) || links_[r]) continue;
    auto fds = ctx_->tcp_streams(kWindowCommId, r, 1, deadline);
    auto l = std::make_unique<Link>();
    l->peer = r;
    l->fd = std::move(fds.at(0));
    net::set_nonblocking(l->fd.get(), true);
    net::tune_stream_socket(l->fd.get());
    std::lock_guard lk(mu_);
    links_[r] = std::move(l);
  }
  links_built_ = true;
  bool any = false;
  for (const auto& l : links_) any = any || l != nullptr;
  if (any && !thread_.joinable()) thread_ = std::thread([this] { progress_loop(); });
}

void WindowHub::create(uint64_t id, const std::string& name, void* data, size_t count, DType dtype,
                       bool zero_init, const Deadline& deadline) {
  if (dtype != DType::F32 && dtype != DType::F64 && dtype != DType::F16 && dtype != DType::BF16)
    throw Error(ErrorKind::kInvalidArgument, "win_create('" + name + "'): dtype " +
                                                 std::string(dtype_name(dtype)) +
                                                 " is not supported (float32, float64, float16, bfloat16)");
  {
    std::lock_guard lk(mu_);
    if (windows_.count(id))
      throw Error(ErrorKind::kInvalidArgument, "win_create('" + name + "'): window id already in use");
  }
  auto w = std::make_shared<Window>();
  w->id = id;
  w->name = name;
  w->data = data;
  w->count = count;
  w->dtype = dtype;
  w->bytes = count * dtype_size(dtype);
  w->stride = sizeof(WinSlotHeader) + round64(w->bytes);
  w->nranks = size_;
  w->base.assign(size_, nullptr);
  w->peers.resize(size_);
  const size_t seg_bytes = sizeof(SegHeader) + size_ * w->stride;
  w->own = net::ShmSegment::create(
      ctx_->owned_name(ctx_->shm_prefix() + "-w" + std::to_string(id) + "-" + std::to_string(rank_), {rank_}),
      seg_bytes);
  w->base[rank_] = static_cast<std::byte*>(w->own.data());
  auto* h = new (w->base[rank_]) SegHeader{};  // lives in the segment
  h->magic = kSegMagic;
  h->pid = static_cast<int32_t>(::getpid());
  h->owner = rank_;
  h->nranks = size_;
  h->count = count;
  h->dtype = static_cast<uint32_t>(dtype);
  for (uint32_t j = 0; j < size_; ++j) {
    auto* s = new (w->slot(rank_, j)) WinSlotHeader{};
    s->p = (j == rank_ || !zero_init) ? 1.0 : 0.0;
    // BlueFog's convention: the neighbour buffers start as this rank's own tensor unless
    // zero_init; the self slot always holds the tensor (it is what get() reads).
    if (j == rank_ || !zero_init)
      std::memcpy(w->slot_data(rank_, j), data, w->bytes);
    else
      std::memset(w->slot_data(rank_, j), 0, w->bytes);
  }
  ensure_links(deadline);
  std::lock_guard lk(mu_);
  if (w->bytes > max_window_bytes_.load()) max_window_bytes_.store(w->bytes);
  windows_[id] = std::move(w);
}

void WindowHub::attach(uint64_t id, const Deadline& deadline) {
  auto w = find(id, "win_create");
  const size_t seg_bytes = sizeof(SegHeader) + size_ * w->stride;
  for (uint32_t r = 0; r < size_; ++r) {
    if (r == rank_ || !local(r)) continue;
    w->peers[r] = net::ShmSegment::open(
        ctx_->owned_name(ctx_->shm_prefix() + "-w" + std::to_string(id) + "-" + std::to_string(r), {r}),
        seg_bytes, deadline, "window '" + w->name + "' of rank " + std::to_string(r));
    w->base[r] = static_cast<std::byte*>(w->peers[r].data());
    const SegHeader* h = w->header(r);
    if (h->magic != kSegMagic || h->count != w->count || h->dtype != static_cast<uint32_t>(w->dtype) ||
        h->nranks != size_)
      throw Error(ErrorKind::kInvalidArgument, "win_create('" + w->name + "'): rank " + std::to_string(r) +
                                                   " created it with another size or dtype");
  }
}

void WindowHub::seal(uint64_t id) { find(id, "win_create")->own.unlink_name(); }

void WindowHub::free(uint64_t id, const Deadline& deadline) {
  auto w = find(id, "win_free");
  std::unique_lock lk(mu_);
  auto busy = [&] {
    for (const auto& [op_id, f] : inflight_)
      if (f.op->window() == id) return true;
    return false;
  };
  if (!idle_cv_.wait_until(lk, deadline.at(), [&] { return !busy(); }))
    throw Error(ErrorKind::kTimeout, "win_free('" + w->name +
                                         "'): operations on it are still in flight after the deadline "
                                         "(the window stays allocated)");
  windows_.erase(id);
}

WindowHub::Link& WindowHub::link(uint32_t peer) {
  Link* l = links_.at(peer).get();
  if (l == nullptr)
    throw Error(ErrorKind::kInvalidArgument, "window hub: no link to rank " + std::to_string(peer));
  return *l;
}

uint64_t WindowHub::register_op(const std::shared_ptr<WinOp>& op, uint32_t peer) {
  // mu_ held by the caller
  uint64_t op_id = next_op_++;
  inflight_[op_id] = Inflight{op, peer};
  op->add_pending(peer);
  return op_id;
}

void WindowHub::enqueue(uint32_t peer, OutMsg msg) {
  // mu_ held by the caller
  Link& l = link(peer);
  if (l.dead)
    throw Error(ErrorKind::kPeerGone, "window link to rank " + std::to_string(peer) + " failed: " + l.why);
  l.out.push_back(std::move(msg));
}

uint32_t WindowHub::apply_write(Window& w, uint32_t sender, const void* x, bool accumulate, double weight,
                                bool with_p, double p, const Deadline& deadline) {
  // Writes into this rank's own slot for `sender` (a frame from a remote peer).
  try {
    WinSlotHeader* s = w.slot(rank_, sender);
    SlotGuard g(s, deadline,
                [&] { return w.desc() + ": slot of rank " + std::to_string(sender) + " stayed locked"; });
    scaled_write(w.slot_data(rank_, sender), x, w.count, w.dtype, weight, accumulate);
    if (with_p) s->p = accumulate ? s->p + weight * p : weight * p;
    s->version.fetch_add(1, std::memory_order_relaxed);
    ++s->writes;
    return kOk;
  } catch (const Error&) {
    return kFailed;
  }
}

double WindowHub::p(uint64_t id) {
  auto w = find(id, "win_associated_p");
  WinSlotHeader* s = w->slot(rank_, rank_);
  SlotGuard g(s, Deadline::after(ctx_->timeout_s()), [&] { return w->desc() + ": own slot stayed locked"; });
  return s->p;
}

void WindowHub::set_p(uint64_t id, double p) {
  auto w = find(id, "win_set_associated_p");
  WinSlotHeader* s = w->slot(rank_, rank_);
  SlotGuard g(s, Deadline::after(ctx_->timeout_s()), [&] { return w->desc() + ": own slot stayed locked"; });
  s->p = p;
}

std::vector<uint64_t> WindowHub::versions(uint64_t id) {
  auto w = find(id, "get_win_version");
  std::vector<uint64_t> v(size_, 0);
  for (uint32_t j = 0; j < size_; ++j)
    if (j != rank_) v[j] = w->slot(rank_, j)->version.load(std::memory_order_relaxed);
  return v;
}

std::shared_ptr<WinOp> WindowHub::put(uint64_t id, const void* x, const Weights& dsts, bool accumulate,
                                      bool with_p, bool require_mutex, const Deadline& deadline) {
  auto w = find(id, accumulate ? "win_accumulate" : "win_put");
  trace::Span span(ctx_->recorder(), accumulate ? "win_accumulate" : "win_put", trace::Category::kComm,
                   static_cast<int64_t>(w->bytes), static_cast<uint32_t>(dsts.size()), w->name);
  const std::string what = std::string(accumulate ? "win_accumulate" : "win_put") + "('" + w->name + "')";
  auto op = std::make_shared<WinOp>(what, id);
  double my_p = with_p ? p(id) : 0.0;
  for (const auto& [dst, weight] : dsts) {
    if (dst >= size_ || dst == rank_)
      throw Error(ErrorKind::kInvalidArgument,
                  what + ": destination rank " + std::to_string(dst) + " is invalid");
    if (require_mutex) mutex_acquire_one(*w, dst, deadline);
    if (local(dst)) {
      check_alive(*w, dst, what);
      WinSlotHeader* s = w->slot(dst, rank_);
      {
        SlotGuard g(s, deadline, [&] {
          return what + ": rank " + std::to_string(dst) + " kept its slot locked past the deadline";
        });
        scaled_write(w->slot_data(dst, rank_), x, w->count, w->dtype, weight, accumulate);
        if (with_p) s->p = accumulate ? s->p + weight * my_p : weight * my_p;
        s->version.fetch_add(1, std::memory_order_relaxed);
        ++s->writes;
      }
    } else {
      OutMsg m;
      m.hdr = WinFrame{kFrameMagic,
                       accumulate ? kAccumulate : kPut,
                       static_cast<uint8_t>(with_p),
                       0,
                       rank_,
                       0,
                       id,
                       0,
                       w->bytes,
                       weight,
                       my_p,
                       0};
      m.data = static_cast<const std::byte*>(x);
      // With the mutex the part is waited for here, before the release.
      auto part = require_mutex ? std::make_shared<WinOp>(what, id) : op;
      submit(part, dst, std::move(m));
      if (require_mutex) wait(part, deadline);
    }
    if (require_mutex) mutex_release_one(*w, dst, deadline);
  }
  return op;
}

std::shared_ptr<WinOp> WindowHub::get(uint64_t id, const Weights& srcs, bool with_p, bool require_mutex,
                                      const Deadline& deadline) {
  auto w = find(id, "win_get");
  trace::Span span(ctx_->recorder(), "win_get", trace::Category::kComm, static_cast<int64_t>(w->bytes),
                   static_cast<uint32_t>(srcs.size()), w->name);
  const std::string what = "win_get('" + w->name + "')";
  auto op = std::make_shared<WinOp>(what, id);
  for (const auto& [src, weight] : srcs) {
    if (src >= size_ || src == rank_)
      throw Error(ErrorKind::kInvalidArgument, what + ": source rank " + std::to_string(src) + " is invalid");
    if (require_mutex) mutex_acquire_one(*w, src, deadline);
    if (local(src)) {
      check_alive(*w, src, what);
      WinSlotHeader* mine = w->slot(rank_, src);
      WinSlotHeader* theirs = w->slot(src, src);
      SlotGuard g1(mine, deadline,
                   [&] { return what + ": own slot for rank " + std::to_string(src) + " stayed locked"; });
      SlotGuard g2(theirs, deadline, [&] {
        return what + ": rank " + std::to_string(src) + " kept its value locked past the deadline";
      });
      scaled_write(w->slot_data(rank_, src), w->slot_data(src, src), w->count, w->dtype, weight, false);
      if (with_p) mine->p = weight * theirs->p;
      mine->version.fetch_add(1, std::memory_order_relaxed);
      ++mine->writes;
    } else {
      OutMsg m;
      m.hdr = WinFrame{
          kFrameMagic, kGetRequest, static_cast<uint8_t>(with_p), 0, rank_, 0, id, 0, 0, weight, 0, 0};
      auto part = require_mutex ? std::make_shared<WinOp>(what, id) : op;
      submit(part, src, std::move(m));
      if (require_mutex) wait(part, deadline);
    }
    if (require_mutex) mutex_release_one(*w, src, deadline);
  }
  return op;
}

void WindowHub::update(uint64_t id, double self_weight, const Weights& nbrs_in, bool reset, bool with_p,
                       void* out, bool require_mutex, const Deadline& deadline) {
  auto w = find(id, "win_update");
  trace::Span span(ctx_->recorder(), "win_update", trace::Category::kComm, static_cast<int64_t>(w->bytes),
                   static_cast<uint32_t>(nbrs_in.size()), w->name);
  const std::string what = "win_update('" + w->name + "')";
  Weights nbrs = nbrs_in;
  std::sort(nbrs.begin(), nbrs.end());
  for (size_t i = 0; i < nbrs.size(); ++i) {
    if (nbrs[i].first >= size_ || nbrs[i].first == rank_)
      throw Error(ErrorKind::kInvalidArgument,
                  what + ": neighbor rank " + std::to_string(nbrs[i].first) + " is invalid");
    if (i > 0 && nbrs[i].first == nbrs[i - 1].first)
      throw Error(ErrorKind::kInvalidArgument,
                  what + ": neighbor rank " + std::to_string(nbrs[i].first) + " given twice");
  }
  if (require_mutex) mutex_acquire_one(*w, rank_, deadline);
  struct Release {
    WindowHub* hub;
    Window* w;
    bool on;
    const Deadline& dl;
    ~Release() {
      if (on) hub->mutex_release_one(*w, hub->rank_, dl);
    }
  } release{this, w.get(), require_mutex, deadline};

  // Neighbour slots in ascending rank, then the self slot (the hub's lock order).
  std::vector<std::unique_ptr<SlotGuard>> guards;
  std::vector<const void*> srcs;
  std::vector<double> weights;
  for (const auto& [j, wt] : nbrs) {
    guards.push_back(std::make_unique<SlotGuard>(w->slot(rank_, j), deadline, [&, j = j] {
      return what + ": slot of rank " + std::to_string(j) + " stayed locked";
    }));
    srcs.push_back(w->slot_data(rank_, j));
    weights.push_back(wt);
  }
  WinSlotHeader* self = w->slot(rank_, rank_);
  SlotGuard gs(self, deadline, [&] { return what + ": own slot stayed locked"; });
  weighted_sum(out, w->data, self_weight, srcs, weights, w->count, w->dtype);
  if (with_p) {
    double p = self_weight * self->p;
    for (const auto& [j, wt] : nbrs) p += wt * w->slot(rank_, j)->p;
    self->p = p;
  }
  for (const auto& [j, wt] : nbrs) {
    WinSlotHeader* s = w->slot(rank_, j);
    s->version.store(0, std::memory_order_relaxed);
    if (reset) {
      std::memset(w->slot_data(rank_, j), 0, w->bytes);
      s->p = 0.0;
    }
  }
  if (out == w->data) std::memcpy(w->slot_data(rank_, rank_), w->data, w->bytes);
}

void WindowHub::publish(uint64_t id, const Deadline& deadline) {
  auto w = find(id, "win_publish");
  WinSlotHeader* self = w->slot(rank_, rank_);
  SlotGuard gs(self, deadline, [&] { return w->desc() + ": own slot stayed locked"; });
  std::memcpy(w->slot_data(rank_, rank_), w->data, w->bytes);
}

void WindowHub::wait(const std::shared_ptr<WinOp>& op, const Deadline& deadline) {
  trace::Span span(ctx_->recorder(), "win_wait", trace::Category::kWait);
  try {
    op->wait(deadline);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kTimeout) throw;
    {
      std::lock_guard lk(mu_);
      for (uint32_t peer : op->outstanding())
        if (peer < links_.size() && links_[peer]) links_[peer]->abort_requested = true;
    }
    wake();
    // The progress thread fails the op promptly once it sees the request; only then may the
    // caller's buffers go away.
    std::unique_lock lk(op->mu_);
    op->cv_.wait_for(lk, std::chrono::seconds(10), [&] { return op->pending_.empty(); });
    throw;
  }
}

// ---- window mutexes ----

void WindowHub::mutex_acquire(uint64_t id, std::vector<uint32_t> ranks, const Deadline& deadline) {
  auto w = find(id, "win_mutex");
  trace::Span span(ctx_->recorder(), "win_mutex_acquire", trace::Category::kWait, -1,
                   static_cast<uint32_t>(ranks.size()), w->name);
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::vector<uint32_t> got;
  try {
    for (uint32_t r : ranks) {
      if (r >= size_)
        throw Error(ErrorKind::kInvalidArgument, "win_mutex: rank " + std::to_string(r) + " is invalid");
      {
        std::lock_guard lk(w->held_mu);
        if (w->held.count(r)) continue;
      }
      mutex_acquire_one(*w, r, deadline);
      got.push_back(r);
    }
  } catch (...) {
    for (auto it = got.rbegin(); it != got.rend(); ++it) mutex_release_one(*w, *it, deadline);
    throw;
  }
}

void WindowHub::mutex_release(uint64_t id, std::vector<uint32_t> ranks, const Deadline& deadline) {
  auto w = find(id, "win_mutex");
  trace::Span span(ctx_->recorder(), "win_mutex_release", trace::Category::kComm, -1,
                   static_cast<uint32_t>(ranks.size()), w->name);
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  for (auto it = ranks.rbegin(); it != ranks.rend(); ++it) mutex_release_one(*w, *it, deadline);
}

void WindowHub::mutex_acquire_one(Window& w, uint32_t target, const Deadline& deadline) {
  {
    std::lock_guard lk(w.held_mu);
    if (w.held.count(target)) return;  // held by an enclosing win_mutex of this process
  }
  const std::string what = "win_mutex('" + w.name + "') of rank " + std::to_string(target);
  if (target == rank_ || local(target)) {
    if (target != rank_) check_alive(w, target, what);
    std::atomic<uint32_t>& m = w.header(target)->mutex;
    for (;;) {
      uint32_t expected = 0;
      if (m.compare_exchange_strong(expected, rank_ + 1, std::memory_order_acquire)) break;
      if (deadline.expired())
        throw Error(ErrorKind::kTimeout, what + ": still held by rank " + std::to_string(expected - 1) +
                                             " when the deadline passed");
      futex_wait(&m, expected, 10000);
    }
  } else {
    remote_request(w, target, kMutexAcquire, what, deadline);
  }
  std::lock_guard lk(w.held_mu);
  w.held.insert(target);
}

void WindowHub::mutex_release_one(Window& w, uint32_t target, const Deadline& deadline) {
  {
    std::lock_guard lk(w.held_mu);
    if (!w.held.erase(target)) return;
  }
  if (target == rank_ || local(target)) {
    std::atomic<uint32_t>& m = w.header(target)->mutex;
    m.store(0, std::memory_order_release);
    futex_wake_all(&m);
  } else {
    remote_request(w, target, kMutexRelease,
                   "win_mutex('" + w.name + "') release at rank " + std::to_string(target), deadline);
  }
}

void WindowHub::remote_request(Window& w, uint32_t target, uint8_t kind, const std::string& what,
                               const Deadline& deadline) {
  auto op = std::make_shared<WinOp>(what, w.id);
  OutMsg msg;
  msg.hdr = WinFrame{kFrameMagic, kind, 0, 0, rank_, 0, w.id, 0, 0, 0, 0, 0};
  submit(op, target, std::move(msg));
  wait(op, deadline);
}

void WindowHub::submit(const std::shared_ptr<WinOp>& part, uint32_t peer, OutMsg msg) {
  {
    std::lock_guard lk(mu_);
    const uint64_t op_id = register_op(part, peer);
    msg.hdr.op_id = op_id;
    try {
      enqueue(peer, std::move(msg));
    } catch (...) {
      inflight_.erase(op_id);
      part->complete(peer, std::current_exception());
      throw;
    }
  }
  wake();
}

// ---- progress thread (TCP links) ----

void WindowHub::finish_inflight(uint64_t op_id, uint32_t peer, std::exception_ptr err) {
  std::shared_ptr<WinOp> op;
  {
    std::lock_guard lk(mu_);
    auto it = inflight_.find(op_id);
    if (it == inflight_.end() || it->second.peer != peer) return;  // already failed
    op = it->second.op;
    inflight_.erase(it);
    idle_cv_.notify_all();
  }
  op->complete(peer, std::move(err));
}

void WindowHub::fail_link(Link& l, const std::string& why) {
  std::vector<std::pair<std::shared_ptr<WinOp>, uint32_t>> failed;
  {
    std::lock_guard lk(mu_);
    if (l.dead) return;
    l.dead = true;
    l.why = why;
    l.out.clear();  // drops references to callers' tensors before their ops complete
    l.out_off = 0;
    l.replies_queued = 0;
    l.reply_bytes_queued = 0;
    ::shutdown(l.fd.get(), SHUT_RDWR);
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      if (it->second.peer == l.peer) {
        failed.emplace_back(it->second.op, l.peer);
        it = inflight_.erase(it);
      } else {
        ++it;
      }
    }
    std::erase_if(mutex_waiters_, [&](const auto& t) { return std::get<0>(t) == l.peer; });
    idle_cv_.notify_all();
  }
  // A peer that shut down cleanly closes its link too; only a link that still had work is news.
  if (!failed.empty()) RUMOR_LOG(kWarn, "window link to rank " << l.peer << " failed: " << why);
  // One exception per operation: see WinOp::complete.
  for (auto& [op, peer] : failed)
    op->complete(peer, std::make_exception_ptr(
                           Error(ErrorKind::kPeerGone,
                                 "window link to rank " + std::to_string(l.peer) + " failed: " + why)));
}

void WindowHub::reply(Link& l, const WinFrame& req, uint8_t kind, uint32_t status, double p,
                      std::shared_ptr<std::vector<std::byte>> payload) {
  OutMsg m;
  m.hdr = WinFrame{
      kFrameMagic, kind, req.with_p, 0, rank_, status, req.window, req.op_id, payload ? payload->size() : 0,
      req.weight,  p,    0};
  m.owned = std::move(payload);
  m.reply = true;
  const size_t bytes = m.hdr.bytes;
  std::lock_guard lk(mu_);
  if (l.dead) return;
  // Every reply answers a request the peer sent; a peer that keeps sending without reading the
  // answers would otherwise make this queue (and its snapshots) grow without bound. The first
  // queued reply is always allowed, whatever its size.
  if (l.replies_queued > 0 && (l.replies_queued >= reply_limit_count_.load() ||
                               l.reply_bytes_queued + bytes > reply_limit_bytes_.load()))
    throw Error(ErrorKind::kProtocol,
                "rank " + std::to_string(l.peer) + " sends requests faster than it reads the replies (" +
                    std::to_string(l.replies_queued) + " replies, " + std::to_string(l.reply_bytes_queued) +
                    " bytes queued unread; limits " + std::to_string(reply_limit_count_.load()) + " and " +
                    std::to_string(reply_limit_bytes_.load()) + ")");
  ++l.replies_queued;
  l.reply_bytes_queued += bytes;
  l.out.push_back(std::move(m));
}

void WindowHub::retry_remote_mutexes() {
  std::vector<std::tuple<uint32_t, uint64_t, uint64_t>> granted;
  {
    std::lock_guard lk(mu_);
    for (auto it = mutex_waiters_.begin(); it != mutex_waiters_.end();) {
      auto [requester, win_id, op_id] = *it;
      auto wit = windows_.find(win_id);
      bool drop = wit == windows_.end();
      if (!drop) {
        uint32_t expected = 0;
        if (wit->second->header(rank_)->mutex.compare_exchange_strong(expected, requester + 1)) {
          granted.push_back(*it);
          drop = true;
        }
      }
      it = drop ? mutex_waiters_.erase(it) : it + 1;
    }
  }
  for (auto [requester, win_id, op_id] : granted) {
    WinFrame req{kFrameMagic, kMutexAcquire, 0, 0, requester, 0, win_id, op_id, 0, 0, 0, 0};
    try {
      reply(*links_[requester], req, kAck, kOk, 0, nullptr);
    } catch (const Error& e) {
      fail_link(*links_[requester], e.what());
    }
  }
}

void WindowHub::handle_frame(Link& l) {
  const WinFrame& f = l.in;
  std::shared_ptr<Window> w;
  {
    std::lock_guard lk(mu_);
    auto it = windows_.find(f.window);
    if (it != windows_.end()) w = it->second;
  }
  // A drained payload was thrown away: the frame is answered as for a window that does not
  // exist, even if one with that id appeared in the meantime.
  if (l.draining) w.reset();
  const Deadline dl = Deadline::after(ctx_->timeout_s());
  switch (f.kind) {
    case kPut:
    case kAccumulate: {
      uint32_t st = !w ? kUnknownWindow : f.bytes != w->bytes ? kSizeMismatch : kOk;
      if (st == kOk)
        st = apply_write(*w, l.peer, l.payload.data(), f.kind == kAccumulate, f.weight, f.with_p != 0, f.p,
                         dl);
      frames_applied_.fetch_add(1);
      reply(l, f, kAck, st, 0, nullptr);
      break;
    }
    case kGetRequest: {
      if (!w) {
        reply(l, f, kGetReply, kUnknownWindow, 0, nullptr);
        break;
      }
      auto snap = std::make_shared<std::vector<std::byte>>(w->bytes);
      double p = 0;
      try {
        WinSlotHeader* s = w->slot(rank_, rank_);
        SlotGuard g(s, dl, [&] { return w->desc() + ": own slot stayed locked"; });
        std::memcpy(snap->data(), w->slot_data(rank_, rank_), w->bytes);
        p = s->p;
      } catch (const Error&) {
        reply(l, f, kGetReply, kFailed, 0, nullptr);
        break;
      }
      reply(l, f, kGetReply, kOk, p, std::move(snap));
      break;
    }
    case kGetReply: {
      std::exception_ptr err;
      uint32_t st = f.status;
      if (st == kOk && (!w || f.bytes != w->bytes)) st = !w ? kUnknownWindow : kSizeMismatch;
      if (st == kOk) {
        try {
          WinSlotHeader* s = w->slot(rank_, l.peer);
          SlotGuard g(s, dl, [&] {
            return w->desc() + ": slot of rank " + std::to_string(l.peer) + " stayed locked";
          });
          scaled_write(w->slot_data(rank_, l.peer), l.payload.data(), w->count, w->dtype, f.weight, false);
          if (f.with_p) s->p = f.weight * f.p;
          s->version.fetch_add(1, std::memory_order_relaxed);
          ++s->writes;
        } catch (...) {
          err = std::current_exception();
        }
        frames_applied_.fetch_add(1);
      }
      if (st != kOk)
        err = std::make_exception_ptr(
            Error(ErrorKind::kInvalidArgument,
                  "win_get: rank " + std::to_string(l.peer) + " refused: " + status_text(st)));
      finish_inflight(f.op_id, l.peer, std::move(err));
      break;
    }
    case kAck: {
      std::exception_ptr err;
      if (f.status != kOk)
        err = std::make_exception_ptr(Error(
            f.status == kFailed ? ErrorKind::kTimeout : ErrorKind::kInvalidArgument,
            "window operation refused by rank " + std::to_string(l.peer) + ": " + status_text(f.status)));
      finish_inflight(f.op_id, l.peer, std::move(err));
      break;
    }
    case kMutexAcquire: {
      if (!w) {
        reply(l, f, kAck, kUnknownWindow, 0, nullptr);
        break;
      }
      std::lock_guard lk(mu_);
      // A peer waits for at most a few mutexes at a time (one per thread that asks): a stream of
      // acquire requests it never waits for is refused instead of queued without bound.
      size_t mine = 0;
      for (const auto& t : mutex_waiters_) mine += std::get<0>(t) == l.peer ? 1 : 0;
      if (mine >= kMaxMutexWaitersPerPeer)
        throw Error(ErrorKind::kProtocol, "rank " + std::to_string(l.peer) + " has " + std::to_string(mine) +
                                              " window mutex requests waiting already");
      mutex_waiters_.emplace_back(l.peer, f.window, f.op_id);
      break;
    }
    case kMutexRelease: {
      uint32_t st = kUnknownWindow;
      if (w) {
        uint32_t expected = l.peer + 1;
        st = w->header(rank_)->mutex.compare_exchange_strong(expected, 0) ? kOk : kNotHolder;
        if (st == kOk) futex_wake_all(&w->header(rank_)->mutex);
      }
      reply(l, f, kAck, st, 0, nullptr);
      break;
    }
    default:
      throw Error(ErrorKind::kProtocol, "unknown window frame kind " + std::to_string(f.kind));
  }
}

void WindowHub::progress_loop() {
  std::vector<pollfd> fds;
  std::vector<Link*> order;
  while (!stop_.load()) {
    fds.clear();
    order.clear();
    fds.push_back(pollfd{wake_fd_.get(), POLLIN, 0});
    bool waiters = false;
    {
      std::lock_guard lk(mu_);
      for (auto& lp : links_) {
        if (!lp || lp->dead) continue;
        if (lp->abort_requested) continue;
        short ev = POLLIN;
        if (!lp->out.empty()) ev |= POLLOUT;
        fds.push_back(pollfd{lp->fd.get(), ev, 0});
        order.push_back(lp.get());
      }
      waiters = !mutex_waiters_.empty();
    }
    // A remote mutex request waits for a holder on this host, which releases without telling
    // this thread: poll for it every millisecond while any request waits.
    int rc = ::poll(fds.data(), fds.size(), waiters ? 1 : 200);
    if (rc < 0 && errno != EINTR) {
      RUMOR_LOG(kError, "window progress thread: poll: " << net::errno_string(errno));
      continue;
    }
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] ssize_t n = ::read(wake_fd_.get(), &v, sizeof(v));
    }
    {
      std::vector<Link*> aborts;
      {
        std::lock_guard lk(mu_);
        for (auto& lp : links_)
          if (lp && lp->abort_requested && !lp->dead) aborts.push_back(lp.get());
      }
      for (Link* l : aborts)
        fail_link(*l, "a window operation's deadline passed while waiting for this peer");
    }
    for (size_t i = 0; i < order.size(); ++i) {
      Link& l = *order[i];
      short re = fds[i + 1].revents;
      try {
        if (re & (POLLIN | POLLHUP | POLLERR)) {
          // Read as much as is there: frames, and their payloads.
          for (;;) {
            if (l.in_hdr < sizeof(WinFrame)) {
              ssize_t n = ::recv(l.fd.get(), reinterpret_cast<char*>(&l.in) + l.in_hdr,
                                 sizeof(WinFrame) - l.in_hdr, 0);
              if (n == 0) throw Error(ErrorKind::kPeerGone, "connection closed by the peer");
              if (n < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
                throw Error(ErrorKind::kPeerGone, "recv: " + net::errno_string(errno));
              }
              l.in_hdr += static_cast<size_t>(n);
              if (l.in_hdr < sizeof(WinFrame)) continue;
              // Every size in the frame is checked against the named window before a byte is
              // allocated for it.
              std::optional<uint64_t> window_bytes;
              {
                std::lock_guard lk(mu_);
                auto it = windows_.find(l.in.window);
                if (it != windows_.end()) window_bytes = it->second->bytes;
              }
              Payload what = Payload::kNone;
              if (std::string bad = check_frame(l.in, l.peer, window_bytes, max_window_bytes_.load(), &what);
                  !bad.empty())
                throw Error(ErrorKind::kProtocol, bad);
              l.draining = what == Payload::kDrain;
              l.payload.resize(l.draining ? std::min<size_t>(l.in.bytes, kDrainPiece) : l.in.bytes);
              l.in_got = 0;
            }
            if (l.in_got < l.in.bytes) {
              const size_t want = l.draining ? std::min<size_t>(l.in.bytes - l.in_got, l.payload.size())
                                             : l.in.bytes - l.in_got;
              std::byte* into = l.draining ? l.payload.data() : l.payload.data() + l.in_got;
              ssize_t n = ::recv(l.fd.get(), into, want, 0);
              if (n == 0) throw Error(ErrorKind::kPeerGone, "connection closed by the peer");
              if (n < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
                throw Error(ErrorKind::kPeerGone, "recv: " + net::errno_string(errno));
              }
              l.in_got += static_cast<size_t>(n);
              if (l.in_got < l.in.bytes) continue;
            }
            handle_frame(l);
            l.in_hdr = 0;
            l.in_got = 0;
          }
        }
        // Write queued frames until the socket is full.
        for (;;) {
          OutMsg* m = nullptr;
          {
            std::lock_guard lk(mu_);
            if (l.dead || l.out.empty()) break;
            m = &l.out.front();
          }
          const std::byte* payload = m->owned ? m->owned->data() : m->data;
          const size_t total = sizeof(WinFrame) + m->hdr.bytes;
          iovec iov[2];
          int niov = 0;
          if (l.out_off < sizeof(WinFrame))
            iov[niov++] = {reinterpret_cast<char*>(&m->hdr) + l.out_off, sizeof(WinFrame) - l.out_off};
          size_t pay_off = l.out_off > sizeof(WinFrame) ? l.out_off - sizeof(WinFrame) : 0;
          if (m->hdr.bytes > pay_off)
            iov[niov++] = {const_cast<std::byte*>(payload) + pay_off, m->hdr.bytes - pay_off};
          msghdr mh{};
          mh.msg_iov = iov;
          mh.msg_iovlen = static_cast<size_t>(niov);
          ssize_t n = ::sendmsg(l.fd.get(), &mh, MSG_NOSIGNAL);
          if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            throw Error(ErrorKind::kPeerGone, "send: " + net::errno_string(errno));
          }
          l.out_off += static_cast<size_t>(n);
          if (l.out_off == total) {
            std::lock_guard lk(mu_);
            if (!l.out.empty()) {
              if (l.out.front().reply) {
                --l.replies_queued;
                l.reply_bytes_queued -= l.out.front().hdr.bytes;
              }
              l.out.pop_front();
            }
            l.out_off = 0;
          }
        }
      } catch (const std::exception& e) {
        fail_link(l, e.what());
      }
    }
    retry_remote_mutexes();
  }
}

}  // namespace rumor
