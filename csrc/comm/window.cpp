#include "comm/window.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>

#include "comm/neighbor.h"
#include "comm/window_wire.h"
#include "core/futex.h"
#include "core/log.h"

namespace rumor {

using namespace window_wire;  // NOLINT: the frame kinds and statuses read as before the split

namespace {

constexpr uint32_t kSegMagic = 0x444e4957;  // "WIND"

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
    : ctx_(std::move(ctx)), rank_(ctx_->rank()), size_(ctx_->size()), progress_(ctx_, *this) {}

// The progress thread calls back into this object: it stops before any member goes away.
WindowHub::~WindowHub() { progress_.stop(); }

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

std::shared_ptr<WindowHub::Window> WindowHub::lookup(uint64_t id) const {
  std::lock_guard lk(mu_);
  auto it = windows_.find(id);
  return it == windows_.end() ? nullptr : it->second;
}

void WindowHub::check_alive(const Window& w, uint32_t peer, const std::string& what) const {
  // A write into a dead peer's segment would succeed and be lost: fail instead, as TCP does.
  const int32_t pid = w.header(peer)->pid;
  if (pid > 0 && net::process_gone(pid))
    throw Error(ErrorKind::kPeerGone,
                what + ": rank " + std::to_string(peer) + " (pid " + std::to_string(pid) + ") has exited");
}

void WindowHub::ensure_links(const Deadline& deadline) {
  std::vector<uint32_t> remote;
  for (uint32_t r = 0; r < size_; ++r)
    if (r != rank_ && !local(r)) remote.push_back(r);
  progress_.connect(remote, deadline);
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
  if (!progress_.wait_idle(id, deadline))
    throw Error(ErrorKind::kTimeout, "win_free('" + w->name +
                                         "'): operations on it are still in flight after the deadline "
                                         "(the window stays allocated)");
  std::lock_guard lk(mu_);
  windows_.erase(id);
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
      const WinFrame frame{kFrameMagic,
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
      // With the mutex the part is waited for here, before the release.
      auto part = require_mutex ? std::make_shared<WinOp>(what, id) : op;
      progress_.submit(part, dst, frame, static_cast<const std::byte*>(x));
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
      const WinFrame frame{
          kFrameMagic, kGetRequest, static_cast<uint8_t>(with_p), 0, rank_, 0, id, 0, 0, weight, 0, 0};
      auto part = require_mutex ? std::make_shared<WinOp>(what, id) : op;
      progress_.submit(part, src, frame, nullptr);
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
    progress_.abort(op->outstanding());
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
  progress_.submit(op, target, WinFrame{kFrameMagic, kind, 0, 0, rank_, 0, w.id, 0, 0, 0, 0, 0}, nullptr);
  wait(op, deadline);
}

// ---- WindowTarget: what remote peers' frames do here (progress thread) ----

std::optional<uint64_t> WindowHub::window_bytes(uint64_t id) const {
  auto w = lookup(id);
  if (!w) return std::nullopt;
  return w->bytes;
}

uint32_t WindowHub::write_slot(uint64_t id, uint32_t sender, const std::byte* x, uint64_t bytes,
                               bool accumulate, double weight, bool with_p, double p,
                               const Deadline& deadline) {
  auto w = lookup(id);
  if (!w) return kUnknownWindow;
  if (bytes != w->bytes) return kSizeMismatch;
  WinSlotHeader* s = w->slot(rank_, sender);
  SlotGuard g(s, deadline,
              [&] { return w->desc() + ": slot of rank " + std::to_string(sender) + " stayed locked"; });
  scaled_write(w->slot_data(rank_, sender), x, w->count, w->dtype, weight, accumulate);
  if (with_p) s->p = accumulate ? s->p + weight * p : weight * p;
  s->version.fetch_add(1, std::memory_order_relaxed);
  ++s->writes;
  return kOk;
}

uint32_t WindowHub::read_published(uint64_t id, std::vector<std::byte>* out, double* p,
                                   const Deadline& deadline) {
  auto w = lookup(id);
  if (!w) return kUnknownWindow;
  out->resize(w->bytes);
  WinSlotHeader* s = w->slot(rank_, rank_);
  SlotGuard g(s, deadline, [&] { return w->desc() + ": own slot stayed locked"; });
  std::memcpy(out->data(), w->slot_data(rank_, rank_), w->bytes);
  *p = s->p;
  return kOk;
}

MutexGrant WindowHub::try_grant_mutex(uint64_t id, uint32_t requester) {
  auto w = lookup(id);
  if (!w) return MutexGrant::kNoWindow;
  uint32_t expected = 0;
  return w->header(rank_)->mutex.compare_exchange_strong(expected, requester + 1) ? MutexGrant::kGranted
                                                                                  : MutexGrant::kHeld;
}

uint32_t WindowHub::release_mutex(uint64_t id, uint32_t holder) {
  auto w = lookup(id);
  if (!w) return kUnknownWindow;
  uint32_t expected = holder + 1;
  if (!w->header(rank_)->mutex.compare_exchange_strong(expected, 0)) return kNotHolder;
  futex_wake_all(&w->header(rank_)->mutex);
  return kOk;
}

}  // namespace rumor
