#include "comm/communicator.h"

#include <poll.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <thread>
#include <utility>

#include "comm/direct.h"
#include "core/futex.h"
#include "core/log.h"
#include "core/reduce.h"

namespace rumor {

using net::make_recv;
using net::make_recv_reduce;
using net::make_send;
using net::Transfer;

namespace {

// Splits count elements into n blocks whose sizes differ by at most one (larger ones first).
std::vector<size_t> even_split(size_t count, size_t n) {
  std::vector<size_t> c(n, count / n);
  for (size_t i = 0; i < count % n; ++i) ++c[i];
  return c;
}

std::vector<size_t> byte_offsets(std::span<const size_t> counts, size_t es) {
  std::vector<size_t> off(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i] * es;
  return off;
}

// The ring allreduce's pieces (allreduce_ring): at most this many per block, so an operation
// stays a few hundred transfers, and no smaller than this.
constexpr size_t kRingMaxPieces = 32;
constexpr size_t kRingMinPieceBytes = 64 * 1024;
// Sub-communicators used by the hierarchical allreduce get ids that group ids never reach.
constexpr uint64_t kLocalCommBit = 1ull << 48;
constexpr uint64_t kLeaderCommBit = 2ull << 48;
constexpr uint64_t kCrossCommBit = 4ull << 48;

// Below this the overlapped 2-D allreduce's pieces would not pay for their operations.
constexpr size_t kPipeMinPieceBytes = 64 * 1024;

}  // namespace

// allreduce_2d_overlapped's two threads: the caller's runs the site's reduce-scatters and
// allgathers (local_), this one the ring across sites (cross_, allreduce_gated), whose peers and
// channels are its own. `ready` and `done` count pieces and carry the data's hand-over.
struct Communicator::SitePipe {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<size_t> ready{0};     // pieces the site has reduced into the cross ring's buffer
  std::atomic<size_t> done{0};      // pieces whose cross-site allreduce is complete
  std::atomic<bool> cancel{false};  // the caller's side failed: the cross ring gives up
  // The job, under mu.
  Communicator* cross = nullptr;
  size_t pieces = 0;
  DType dtype = DType::F32;
  ReduceOp op = ReduceOp::SUM;
  bool job = false, running = false, stop = false;
  std::exception_ptr error;
  double timeout_s = 0;
  // The caller's layout, kept between calls so that sizing it allocates only once.
  std::vector<size_t> sub;     // sub[j * k + q]: elements of member j's block in cross block q
  std::vector<size_t> counts;  // one piece's elements per site member
  std::thread thread;          // last: starts once everything above exists

  SitePipe() : thread([this] { loop(); }) {}
  ~SitePipe() {
    {
      std::lock_guard lk(mu);
      stop = true;
    }
    cv.notify_all();
    thread.join();
  }
  SitePipe(const SitePipe&) = delete;
  SitePipe& operator=(const SitePipe&) = delete;

  void loop() {
    std::unique_lock lk(mu);
    while (true) {
      cv.wait(lk, [this] { return job || stop; });  // idle between operations, no deadline to keep
      if (stop) return;
      job = false;
      lk.unlock();
      std::exception_ptr err;
      try {
        cross->allreduce_gated(pieces, dtype, op, *this);
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      error = err;
      running = false;
      cv.notify_all();
    }
  }
  void start(Communicator* c, size_t n, DType dt, ReduceOp o, double timeout) {
    {
      std::lock_guard lk(mu);
      cross = c;
      pieces = n;
      dtype = dt;
      op = o;
      timeout_s = timeout;
      ready = 0;
      done = 0;
      cancel = false;
      error = nullptr;
      job = running = true;
    }
    cv.notify_all();
  }
  void publish(std::atomic<size_t>& counter, size_t n) {
    {
      std::lock_guard lk(mu);  // a waiter between its check and its sleep must not miss this
      counter = n;
    }
    cv.notify_all();
  }
  void publish_ready(size_t n) { publish(ready, n); }
  void stop_job() {
    {
      std::lock_guard lk(mu);
      cancel = true;
    }
    cv.notify_all();
  }
  void publish_done(size_t n) { publish(done, n); }
  void check(const net::OpInfo& info) const {
    if (cancel.load())
      throw Error(ErrorKind::kAborted, info.where() + ": the site's own part of the 2-D allreduce failed");
  }
  // Waits until counter passes `above`, or the cross ring ended (waiting for done) or gave up
  // (waiting for ready); RUMOR_TIMEOUT with the counter standing still is an error.
  template <typename What>  // () -> std::string, called only to word a timeout
  void wait_past(const std::atomic<size_t>& counter, size_t above, const What& what) {
    std::unique_lock lk(mu);
    size_t seen = counter.load();
    auto until = Deadline::after(timeout_s);
    const bool for_done = &counter == &done;
    while (counter.load() <= above && !(for_done ? !running : cancel.load())) {
      if (cv.wait_until(lk, until.at()) == std::cv_status::no_timeout) continue;
      if (counter.load() == seen)
        throw Error(ErrorKind::kTimeout,
                    what() + ": nothing for " + std::to_string(timeout_s) + " s (RUMOR_TIMEOUT)");
      seen = counter.load();
      until = Deadline::after(timeout_s);
    }
  }
  void wait_ready(size_t above, const net::OpInfo& info) {
    wait_past(ready, above, [&] {
      return info.where() + ": waiting for this site's reduce-scatter of piece " + std::to_string(above + 1) +
             " of " + std::to_string(pieces);
    });
    check(info);
  }
  void wait_idle() {
    std::unique_lock lk(mu);
    // Bounded: the cross ring ends by its own deadlines, and after stop_job() at its next round
    // of progress (exchange() sleeps at most 100 ms at a time).
    cv.wait(lk, [this] { return !running; });
  }
};

Communicator::Communicator(std::shared_ptr<Context> ctx, uint64_t id, std::string name,
                           std::vector<uint32_t> world_ranks)
    : ctx_(std::move(ctx)), id_(id), name_(std::move(name)), world_ranks_(std::move(world_ranks)) {
  auto it = std::find(world_ranks_.begin(), world_ranks_.end(), ctx_->rank());
  if (it == world_ranks_.end())
    throw Error(ErrorKind::kInvalidArgument,
                name_ + ": world rank " + std::to_string(ctx_->rank()) + " is not a member");
  for (uint32_t r : world_ranks_)
    if (r >= ctx_->size())
      throw Error(ErrorKind::kInvalidArgument,
                  name_ + ": rank " + std::to_string(r) + " is not in the world");
  rank_ = static_cast<uint32_t>(it - world_ranks_.begin());
  shm_prefix_ = ctx_->shm_prefix() + "-c" + std::to_string(id_);
  channels_.resize(world_ranks_.size());
  if (!ctx_->host_ids().empty()) {
    // Distinct values of key(w) over the members, and whether one of them is shared.
    auto groups = [this](auto key) {
      std::vector<std::string> seen;
      bool shared = false;
      for (uint32_t w : world_ranks_) {
        const std::string& k = key(w);
        if (std::find(seen.begin(), seen.end(), k) != seen.end())
          shared = true;
        else
          seen.push_back(k);
      }
      return std::pair{seen.size(), shared};
    };
    const auto [hosts, shared_host] =
        groups([this](uint32_t w) -> const std::string& { return ctx_->host_ids()[w]; });
    all_local_ = hosts == 1;
    // Hierarchical collectives group by site where sites are set (Context::group_key).
    const auto [keys, shared_key] =
        groups([this](uint32_t w) -> const std::string& { return ctx_->group_key(w); });
    hierarchical_ = keys > 1 && shared_key;
  }
  p2p_sent_.assign(world_ranks_.size(), 0);
  p2p_recv_.assign(world_ranks_.size(), 0);
  transport_ = size() == 1                   ? "self"
               : all_local_ && uses_shm()    ? "shm"
               : hierarchical_ && uses_shm() ? "shm+tcp"
                                             : "tcp";
}

trace::OpDesc Communicator::trace_desc(const net::OpInfo& op) const {
  return trace::OpDesc{op.name, op.comm, op.tag, op.bytes, op.peer, size(), op.algo, transport_, blocked_us_};
}

Communicator::~Communicator() = default;

std::string Communicator::peer_desc(uint32_t peer) const {
  return "rank " + std::to_string(world_ranks_.at(peer));
}

net::OpInfo Communicator::begin(const char* name, Opcode code) {
  net::OpInfo op;
  op.name = name;
  op.comm = name_;
  op.opcode = static_cast<uint8_t>(code);
  op.tag = next_tag_++;
  op.timeout_s = ctx_->timeout_s();
  op.deadline = Deadline::after(op.timeout_s).cancelled_by(&broken_);
  if (ctx_->options().adaptive_deadline) op.stall_floor_s = ctx_->options().deadline_floor_s;
  if (broken_.load()) {
    std::lock_guard lk(broken_mu_);
    throw Error(ErrorKind::kAborted, op.where() + ": communicator " + name_ +
                                         " is unusable after an earlier failure: " + broken_why_);
  }
  return op;
}

void Communicator::abort(const std::string& why) {
  {
    std::lock_guard lk(broken_mu_);
    if (broken_.exchange(true)) return;
    broken_why_ = why;
  }
  RUMOR_LOG(kWarn, name_ << ": aborting after error: " << why);
  ctx_->recorder().dump_flight(name_ + ": " + why);
  for (auto& c : channels_)
    if (c) c->abort();
  if (local_) local_->abort(why);
  if (leaders_) leaders_->abort(why);
  if (cross_) cross_->abort(why);
}

net::Channel& Communicator::channel(uint32_t peer, const net::OpInfo& op) {
  if (!channels_[peer]) {
    try {
      // With progress deadlines an op may outlast its start's deadline while bytes move; a
      // channel first needed late in it (a later step's peer) gets a full RUMOR_TIMEOUT to set up.
      const Deadline setup =
          op.stall_floor_s > 0 ? Deadline::after(op.timeout_s).cancelled_by(&broken_) : op.deadline;
      channels_[peer] = ctx_->connect(id_, world_ranks_[peer], setup);
    } catch (const Error& e) {
      if (broken_.load()) {
        std::lock_guard lk(broken_mu_);
        throw Error(ErrorKind::kAborted, op.where() + ": setting up the channel to " + peer_desc(peer) +
                                             ": the communicator was aborted: " + broken_why_);
      }
      throw Error(e.kind(), op.where() + ": setting up the channel to " + peer_desc(peer) + ": " + e.what());
    }
  }
  return *channels_[peer];
}

void Communicator::exchange(std::span<Transfer> ts, const net::OpInfo& op) { exchange(ts, op, nullptr); }

void Communicator::exchange(std::span<Transfer> ts, const net::OpInfo& op, const std::function<bool()>& work,
                            bool beside) {
  const auto spin = std::chrono::microseconds(std::max(0, ctx_->options().spin_us));
  net::Doorbell* bell = ctx_->doorbell();
  auto spin_until = Clock::now() + spin;
  auto next_alive_check = Clock::now() + std::chrono::milliseconds(100);
  std::vector<pollfd> fds;
  // Per (peer, send): the streams earlier transfers still hold (net::kAllStreams: every one).
  struct Lane {
    uint32_t peer;
    bool send;
    net::StreamSet busy;
  };
  std::vector<Lane> busy;
  std::vector<net::Channel*> shm_waiting;
  // The timeline reports how long an operation slept waiting for its peers.
  const bool timed = ctx_->recorder().active();
  // The ceiling: with progress deadlines (net/stall.h), RUMOR_TIMEOUT of silence, restarted by
  // every byte that moves; without, RUMOR_TIMEOUT from the op's start.
  const bool adaptive = op.stall_floor_s > 0;
  const auto ceiling =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(op.timeout_s));
  Deadline quiet = adaptive ? Deadline(Clock::now() + ceiling) : op.deadline;
  while (true) {
    const uint32_t seen = bell != nullptr ? bell->seq.load(std::memory_order_seq_cst) : 0;
    bool moved = false, pending = false, any_tcp = false, held = false;
    busy.clear();
    shm_waiting.clear();
    for (Transfer& t : ts) {
      if (t.finished()) continue;
      pending = true;
      // Messages to one peer in one direction go in order, and without `beside` strictly so.
      auto lane = std::find_if(busy.begin(), busy.end(),
                               [&](const Lane& l) { return l.peer == t.peer && l.send == t.send; });
      if (lane == busy.end()) {
        busy.push_back({t.peer, t.send, 0});
        lane = busy.end() - 1;
      } else if (!beside || lane->busy == net::kAllStreams) {
        continue;
      }
      if (t.held) {
        lane->busy = net::kAllStreams;
        held = true;
        continue;
      }
      net::Channel& ch = channel(t.peer, op);
      if (!t.begun) ch.begin_beside(t, op, lane->busy);
      if (!t.begun) {  // declined: it waits for the earlier ones
        lane->busy = net::kAllStreams;
        continue;
      }
      moved |= ch.progress_beside(t, op, lane->busy);
      lane->busy = ch.streams_in_use(t, lane->busy);
      if (!t.finished()) {
        if (ch.is_shm())
          shm_waiting.push_back(&ch);
        else
          any_tcp = true;
      }
    }
    if (!pending) return;
    // Between rounds of progress, not only when nothing moved: on a steadily moving link the
    // socket buffers keep it busy while the work runs.
    if (work && work()) moved = true;
    if (held && !moved && !any_tcp && shm_waiting.empty())
      throw Error(ErrorKind::kInvalidArgument,
                  op.where() + ": held sends that no remaining work can release");
    auto now = Clock::now();
    if (moved) {
      spin_until = now + spin;
      if (adaptive) quiet = Deadline(now + ceiling);
      continue;
    }
    // Spin only while every pending transfer is over shared memory: a socket wait is cheap in
    // the kernel, and spinning on a slow link would burn a core the computation needs.
    if (!any_tcp && now < spin_until) {
      cpu_relax();
      continue;
    }
    if (adaptive && any_tcp)
      for (const Transfer& t : ts)
        if (t.begun && !t.finished()) channels_[t.peer]->check_stall(t, op, now);
    if (quiet.expired()) {
      std::string waiting;
      for (const Transfer& t : ts) {
        if (t.finished()) continue;
        if (!waiting.empty()) waiting += ", ";
        waiting += peer_desc(t.peer) + (t.send ? " (sending " : " (receiving ") +
                   std::to_string(t.bytes_done()) + " of " + std::to_string(t.len) + " bytes";
        const std::string link = t.begun ? channels_[t.peer]->link_desc() : std::string();
        if (!link.empty()) waiting += "; " + link;
        waiting += ")";
      }
      throw Error(ErrorKind::kTimeout,
                  op.where() + ": timed out after " + std::to_string(op.timeout_s) +
                      (adaptive ? " s with no byte moving (RUMOR_TIMEOUT; a message a peer has begun "
                                  "has its own progress deadline) waiting for "
                                : " s waiting for ") +
                      waiting);
    }
    if (any_tcp) {
      fds.clear();
      for (const Transfer& t : ts) {
        if (t.finished() || !t.begun) continue;
        net::Channel& ch = *channels_[t.peer];
        if (!ch.is_shm()) ch.want(t, fds);
      }
      // With shared-memory transfers also pending, nothing wakes poll() for them: keep the
      // sleep short. Otherwise sleep until a socket is ready (bounded, to re-check the deadline).
      timespec ts_wait{0, shm_waiting.empty() ? 0 : 200 * 1000};
      if (shm_waiting.empty()) {
        int ms = quiet.ms_left(100);
        ts_wait = {ms / 1000, static_cast<long>(ms % 1000) * 1000000};
      }
      const double t0 = timed ? trace::now_us() : 0;
      ::ppoll(fds.data(), fds.size(), &ts_wait, nullptr);
      if (timed) blocked_us_ += trace::now_us() - t0;
    } else if (!shm_waiting.empty() && bell != nullptr) {
      const double t0 = timed ? trace::now_us() : 0;
      net::wait_doorbell(bell, seen, 50 * 1000);
      if (timed) blocked_us_ += trace::now_us() - t0;
    }
    if (!shm_waiting.empty() && Clock::now() >= next_alive_check) {
      for (net::Channel* ch : shm_waiting) ch->check_alive(op);
      next_alive_check = Clock::now() + std::chrono::milliseconds(100);
    }
  }
}

// ---- allreduce -------------------------------------------------------------------------------

void Communicator::allreduce(void* buf, size_t count, DType dtype, ReduceOp op, AllreduceAlgo algo) {
  auto* b = static_cast<std::byte*>(buf);
  allreduce_impl(b, b, count, dtype, op, algo);
}

void Communicator::allreduce_into(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                                  AllreduceAlgo algo) {
  const auto* i = static_cast<const std::byte*>(in);
  auto* o = static_cast<std::byte*>(out);
  const size_t bytes = count * dtype_size(dtype);
  if (i != o && i < o + bytes && o < i + bytes)
    throw Error(ErrorKind::kInvalidArgument,
                "allreduce_into: the output overlaps the input without being it");
  allreduce_impl(i, o, count, dtype, op, algo);
}

void Communicator::allreduce_impl(const std::byte* in, std::byte* b, size_t count, DType dtype, ReduceOp op,
                                  AllreduceAlgo algo) {
  net::OpInfo info = begin("allreduce", Opcode::kAllreduce);
  const size_t bytes = count * dtype_size(dtype);
  // Every path but the direct one reduces `b` in place, from a copy of the input.
  auto take_input = [&] {
    if (in != b && bytes > 0) std::memcpy(b, in, bytes);
  };
  // An empty buffer still exchanges (empty) frames, so a rank whose size differs is caught.
  if (size() == 1) return take_input();
  AllreduceAlgo chosen = AllreduceAlgo::kRing;
  // Hierarchical within one host is one level: the host's own paths (direct, shared slots) are
  // that level already, and give the bits of a plain allreduce.
  if (algo == AllreduceAlgo::kHierarchical && all_local_) algo = AllreduceAlgo::kAuto;
  if (algo == AllreduceAlgo::kHierarchical)
    chosen = AllreduceAlgo::kHierarchical;
  else if (algo == AllreduceAlgo::kRecursiveDoubling ||
           (algo == AllreduceAlgo::kAuto && bytes <= small_bytes()) || count < size())
    chosen = AllreduceAlgo::kRecursiveDoubling;
  else if (algo == AllreduceAlgo::kAuto && hierarchical_)
    chosen = AllreduceAlgo::kHierarchical;
  // Every rank of one host: reduce in each other's buffers directly (comm/direct.h) rather than
  // through the rings, unless the kernel refuses it (then the ring, from then on).
  const bool ring_auto = chosen == AllreduceAlgo::kRing && algo == AllreduceAlgo::kAuto;
  const bool direct = ring_auto && use_direct(bytes);
  // Two ranks in the window where neither the rings nor the direct path always win: rank 0
  // names one, by its own recent times unless RUMOR_TWO_RANK_PATH fixes it.
  const bool choose = ring_auto && !direct && two_rank_choice(bytes);
  // Small ones: one shared slot per rank and a single wait (comm/direct.h) instead of log2(P)
  // rounds, each of which waits for a peer that may not be running.
  const bool small = chosen == AllreduceAlgo::kRecursiveDoubling && algo == AllreduceAlgo::kAuto &&
                     HostSmall::fits(bytes) && use_small();
  info.bytes = static_cast<int64_t>(bytes);
  info.algo = chosen == AllreduceAlgo::kHierarchical        ? "hierarchical"
              : small                                       ? "shared slots"
              : chosen == AllreduceAlgo::kRecursiveDoubling ? "recursive doubling"
              : direct || choose                            ? "direct"
                                                            : "ring";
  const auto t0 = std::chrono::steady_clock::now();
  guarded(info, [&] {
    if (direct && host_direct().allreduce(in, b, count, dtype, op, info)) return;
    if (choose && host_direct().allreduce_chosen(in, b, count, dtype, op, info)) return;
    if (choose) info.algo = "ring";  // rank 0 named the rings
    take_input();
    if (chosen == AllreduceAlgo::kHierarchical)
      allreduce_hier(b, count, dtype, op);
    else if (small)
      host_small().allreduce(b, count, dtype, op, info);
    else if (chosen == AllreduceAlgo::kRecursiveDoubling)
      allreduce_rd(b, count, dtype, op, info);
    else
      allreduce_ring(b, count, dtype, op, info);
  });
  if (choose && rank_ == 0)
    host_direct().choice().record(
        bytes, info.algo[0] == 'd',
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// The ring reduce-scatter and allgather as one pipeline. Each block travels in pieces, and the
// piece a rank received at step s is what it sends at step s+1, so that send is released as soon
// as that piece (not the whole block) has arrived. Step by step with whole blocks, every step
// waited for the last byte of the previous one: one link delay per step, 2(n-1) per operation,
// which on a 100 ms round trip cost a quarter of a 256 MiB allreduce at 1 Gbit. Each element is
// still reduced along the same path in the same order, so the bits are those of the stepwise ring.
// The pieces go `beside` each other over a striped TCP channel: a stream done with its share of
// one piece starts on the next instead of idling until the piece's slowest stream is done. At 4
// hosts, 1 Gbit, 64 MiB, 30 samples each, two streams beside came to a mean of 885.5 ms against
// gloo's 873.7 and one stream 907.0 against 883.9 (half the samples of every variant sit at
// 844-860 ms, the rest 80-160 ms above: the shaped link's drops); strictly in order, two streams
// had given 874-922 ms medians of 10. A piece's destination is written only once the same
// region's previous piece has fully arrived: the sender cannot have it sooner.
void Communicator::allreduce_ring(std::byte* buf, size_t count, DType dtype, ReduceOp op,
                                  const net::OpInfo& info) {
  const uint32_t n = size();
  const size_t es = dtype_size(dtype);
  const auto counts = even_split(count, n);
  const auto off = byte_offsets(counts, es);
  // Pieces no smaller than the striping threshold, so a TCP channel still stripes each one over
  // its streams. That threshold is the same on every rank (a receiver splits a message as its
  // sender does), so every rank cuts the same pieces.
  const size_t piece_min = std::max(ctx_->options().stripe_min, kRingMinPieceBytes);
  const size_t pieces = std::clamp<size_t>(counts[0] * es / piece_min, 1, kRingMaxPieces);
  ring_at_.clear();
  for (uint32_t b = 0; b < n; ++b)
    for (size_t c = 0; c < pieces; ++c) {
      const size_t lo = counts[b] * c / pieces, hi = counts[b] * (c + 1) / pieces;
      ring_at_.emplace_back(buf + off[b] + lo * es, (hi - lo) * es);
    }
  ring_run(pieces, dtype, op, info, nullptr);
}

void Communicator::ring_run(size_t pieces, DType dtype, ReduceOp op, const net::OpInfo& info,
                            SitePipe* pipe) {
  const uint32_t n = size(), r = rank_;
  const size_t es = dtype_size(dtype);
  const uint32_t next = (r + 1) % n, prev = (r + n - 1) % n;
  const uint32_t steps = 2 * (n - 1);
  std::vector<Transfer>& ts = ring_ts_;
  ts.clear();
  ts.reserve(2 * steps * pieces);
  // ts[2k] sends and ts[2k+1] receives piece k = s * pieces + c.
  for (uint32_t s = 0; s < steps; ++s) {
    const bool rs = s + 1 < n;  // reduce-scatter steps, then allgather steps
    const uint32_t sb = rs ? (r + 2 * n - 1 - s) % n : (r + 2 * n - (s - (n - 1))) % n;
    const uint32_t rb = rs ? (r + 2 * n - 2 - s) % n : (r + 2 * n - (s - (n - 1)) - 1) % n;
    for (size_t c = 0; c < pieces; ++c) {
      auto [sp, sl] = ring_at_[sb * pieces + c];
      auto [rp, rl] = ring_at_[rb * pieces + c];
      ts.push_back(make_send(next, sp, sl));
      // Behind a pipe the first step's pieces, received into as well as sent, are not there yet.
      ts.back().held = s > 0 || pipe != nullptr;
      ts.push_back(rs ? make_recv_reduce(prev, rp, rl, dtype, op) : make_recv(prev, rp, rl));
      ts.back().held = s == 0 && pipe != nullptr;
    }
  }
  const size_t total = steps * pieces;
  size_t released = pieces;                      // the first step's pieces are the rank's own data
  size_t opened = pipe != nullptr ? 0 : pieces;  // first-step pieces let go
  size_t announced = 0;                          // pieces the pipe was told are complete
  // Whether the first unfinished send and receive are both held (or none is left): then nothing
  // can move, as transfers to one peer in one direction go in order.
  size_t first_send = 0, first_recv = 0;
  auto stuck = [&] {
    while (first_send < total && ts[2 * first_send].finished()) ++first_send;
    while (first_recv < total && ts[2 * first_recv + 1].finished()) ++first_recv;
    return (first_send == total || ts[2 * first_send].held) &&
           (first_recv == total || ts[2 * first_recv + 1].held);
  };
  exchange(
      ts, info,
      [&] {
        bool any = false;
        auto open = [&] {
          bool opened_any = false;
          for (const size_t ready = pipe->ready.load(); opened < std::min(ready, pieces); ++opened) {
            ts[2 * opened].held = ts[2 * opened + 1].held = false;
            opened_any = true;
          }
          return opened_any;
        };
        if (pipe != nullptr) {
          pipe->check(info);
          any = open();
        }
        for (; released < total && ts[2 * (released - pieces) + 1].finished(); ++released) {
          // The owner's block is complete after the last reduce-scatter step: divide it once, by the
          // owner, before it is sent on, so every rank receives identical bits.
          if (op == ReduceOp::AVG && released / pieces == n - 1) {
            auto [p, len] = ring_at_[r * pieces + released % pieces];
            finish_average(p, len / es, dtype, n);
          }
          ts[2 * released].held = false;
          any = true;
        }
        if (pipe == nullptr) return any;
        // Receives from one peer finish in order, so a piece whose last step has arrived is complete
        // in every block.
        const size_t before = announced;
        while (announced < pieces && ts[2 * ((steps - 1) * pieces + announced) + 1].finished()) ++announced;
        if (announced != before) pipe->publish_done(announced);
        if (!any && opened < pieces && stuck()) {
          pipe->wait_ready(opened, info);  // nothing in flight: only the site's next piece moves it on
          any = open();
        }
        return any;
      },
      /*beside=*/true);
}

// Latency-optimal for small messages: log2(n) rounds of full-buffer exchange. Ranks beyond the
// largest power of two fold their data into a partner first and receive the result at the end.
void Communicator::allreduce_rd(std::byte* buf, size_t count, DType dtype, ReduceOp op,
                                const net::OpInfo& info) {
  const uint32_t n = size(), r = rank_;
  const size_t bytes = count * dtype_size(dtype);
  uint32_t p2 = 1;
  while (p2 * 2 <= n) p2 *= 2;
  const uint32_t extra = n - p2;
  if (r >= p2) {
    Transfer s[1] = {make_send(r - p2, buf, bytes)};
    exchange(s, info);
    Transfer q[1] = {make_recv(r - p2, buf, bytes)};
    exchange(q, info);
    return;
  }
  if (r < extra) {
    Transfer q[1] = {make_recv_reduce(r + p2, buf, bytes, dtype, op)};
    exchange(q, info);
  }
  scratch_.resize(bytes);
  for (uint32_t mask = 1; mask < p2; mask <<= 1) {
    uint32_t partner = r ^ mask;
    Transfer ts[2] = {make_send(partner, buf, bytes), make_recv(partner, scratch_.data(), bytes)};
    exchange(ts, info);
    // a op b == b op a bit for bit, so both partners hold identical results.
    reduce_into(buf, scratch_.data(), count, dtype, op);
  }
  if (op == ReduceOp::AVG) finish_average(buf, count, dtype, n);
  if (r < extra) {
    Transfer s[1] = {make_send(r + p2, buf, bytes)};
    exchange(s, info);
  }
}

bool Communicator::use_direct(size_t bytes) const {
  // Below this, the rings' latency is lower than announcing buffers and sharing out chunks.
  // Where cores are shared, from a few MiB only (Options::host_direct_min_bytes). From 3 ranks on
  // the direct path won (4 ranks, 64 MiB: allreduce 1.43x, reduce_scatter 1.25x, allgather 1.28x
  // on 4 KiB pages). Two ranks keep the rings up to Options::kTwoRankDirectMinBytes: there each
  // byte is staged in cache only, and on 4 KiB pages the ring stayed as fast or 10-40% faster
  // than the direct path's system calls from 1 to 64 MiB; on 2 MiB pages (huge_pages) the direct
  // path took 1.20 ms for 16 MiB against the ring's 1.67 and 5.46 ms for 64 MiB against 8.11,
  // but 0.59 against 0.51 ms at 8 MiB, which stays in cache.
  const Options& o = ctx_->options();
  if (!(all_local_ && uses_shm() && o.host_direct && size() >= 2 && bytes > o.small_allreduce_bytes &&
        static_cast<int64_t>(bytes) >= o.host_direct_min_bytes))
    return false;
  return size() > 2 || (o.huge_pages && static_cast<int64_t>(bytes) >= Options::kTwoRankDirectMinBytes);
}

bool Communicator::two_rank_choice(size_t bytes) const {
  const Options& o = ctx_->options();
  return all_local_ && uses_shm() && o.host_direct && size() == 2 && bytes > o.small_allreduce_bytes &&
         static_cast<int64_t>(bytes) >= std::max(o.host_direct_min_bytes, Options::kTwoRankChoiceMinBytes) &&
         static_cast<int64_t>(bytes) < Options::kTwoRankDirectMinBytes;
}

bool Communicator::use_small() const {
  return all_local_ && uses_shm() && ctx_->options().host_direct && size() <= HostSmall::kMaxRanks;
}

HostDirect& Communicator::host_direct() {
  if (!direct_) direct_ = std::make_unique<HostDirect>(*this);
  return *direct_;
}

HostSmall& Communicator::host_small() {
  if (!small_) small_ = std::make_unique<HostSmall>(*this);
  return *small_;
}

size_t Communicator::small_bytes() const {
  size_t s = ctx_->options().small_allreduce_bytes;
  return all_local_ ? s : std::min<size_t>(s, 16 * 1024);
}

void Communicator::ensure_hierarchy() {
  if (hierarchy_built_) return;
  hierarchy_built_ = true;
  const std::string& mine = ctx_->group_key(ctx_->rank());
  std::vector<uint32_t> local, leaders;
  std::vector<std::vector<uint32_t>> groups;  // members by host (or site), in order of first member
  std::vector<std::string> seen;
  for (uint32_t w : world_ranks_) {
    const std::string& key = ctx_->group_key(w);
    if (key == mine) local.push_back(w);
    auto it = std::find(seen.begin(), seen.end(), key);
    if (it == seen.end()) {
      seen.push_back(key);
      leaders.push_back(w);
      groups.push_back({w});
    } else {
      groups[static_cast<size_t>(it - seen.begin())].push_back(w);
    }
  }
  local_ = std::make_unique<Communicator>(ctx_, id_ | kLocalCommBit, name_ + "/local", local);
  is_leader_ = local.front() == ctx_->rank();
  if (is_leader_)
    leaders_ = std::make_unique<Communicator>(ctx_, id_ | kLeaderCommBit, name_ + "/leaders", leaders);
  // Between sites every member can use its own slow link (allreduce_2d) when the sites are the
  // same size; between hosts of one machine room the leaders' scheme stays (shared memory inside).
  if (!ctx_->has_sites()) return;
  for (const auto& g : groups)
    if (g.size() != local.size()) return;
  const size_t index =
      static_cast<size_t>(std::find(local.begin(), local.end(), ctx_->rank()) - local.begin());
  std::vector<uint32_t> cross;
  for (const auto& g : groups) cross.push_back(g[index]);
  cross_ = std::make_unique<Communicator>(ctx_, id_ | kCrossCommBit, name_ + "/cross", cross);
}

Communicator& Communicator::local_comm() {
  ensure_hierarchy();
  return *local_;
}

Communicator* Communicator::leaders_comm() {
  ensure_hierarchy();
  return leaders_.get();
}

// Reduce inside the host (shared memory), allreduce among one leader per host (network),
// broadcast inside the host. The network carries each byte once per host instead of per rank.
void Communicator::allreduce_hier(std::byte* buf, size_t count, DType dtype, ReduceOp op) {
  ensure_hierarchy();
  if (cross_ && count >= local_->size()) return allreduce_2d(buf, count, dtype, op);
  const ReduceOp partial = op == ReduceOp::AVG ? ReduceOp::SUM : op;
  local_->reduce(buf, count, dtype, partial, 0);
  if (is_leader_) {
    leaders_->allreduce(buf, count, dtype, partial, AllreduceAlgo::kAuto);
    if (op == ReduceOp::AVG) finish_average(buf, count, dtype, size());
  }
  local_->broadcast(buf, count, dtype, 0);
}

// Sites of m members each: reduce-scatter inside the site, allreduce each 1/m block with the
// members of the same index in the other sites, allgather inside the site. Each member's own
// slow link carries S/m (the leaders' scheme sends all S over one), and the fast links move
// about what a ring would.
void Communicator::allreduce_gated(size_t pieces, DType dtype, ReduceOp op, SitePipe& pipe) {
  net::OpInfo info = begin("allreduce", Opcode::kAllreduce);
  size_t bytes = 0;
  for (const auto& p : ring_at_) bytes += p.second;
  info.bytes = static_cast<int64_t>(bytes);
  info.algo = "ring, overlapped with the site's phases";
  guarded(info, [&] { ring_run(pieces, dtype, op, info, &pipe); });
  pipe.publish_done(pieces);
}

void Communicator::allreduce_2d(std::byte* buf, size_t count, DType dtype, ReduceOp op) {
  const ReduceOp partial = op == ReduceOp::AVG ? ReduceOp::SUM : op;
  const uint32_t m = local_->size(), mine = local_->rank();
  const size_t es = dtype_size(dtype);
  // Pieces as allreduce_2d_overlapped cuts them, from the largest cross-site block (the same on
  // every rank). Across one host the cross allreduce would take the direct path, whose bits the
  // pipeline's ring would not reproduce.
  const size_t largest = (count / m + (count % m != 0) + cross_->size() - 1) / cross_->size();
  const size_t pieces = std::min(kRingMaxPieces, largest * es / kPipeMinPieceBytes);
  if (ctx_->options().site_overlap && pieces >= 2 && !cross_->all_local_)
    return allreduce_2d_overlapped(buf, count, dtype, op, pieces);
  std::vector<size_t> counts(m, count / m);
  for (uint32_t i = 0; i < count % m; ++i) ++counts[i];
  size_t offset = 0;
  for (uint32_t i = 0; i < mine; ++i) offset += counts[i];
  // The outer communicator's scratch: the sub-communicators' ops below use their own.
  const size_t block_bytes = counts[mine] * es;
  scratch_.resize(block_bytes);
  std::byte* block = scratch_.data();
  local_->reduce_scatter(buf, block, counts, dtype, partial);
  cross_->allreduce(block, counts[mine], dtype, partial, AllreduceAlgo::kAuto);
  if (op == ReduceOp::AVG) finish_average(block, counts[mine], dtype, size());
  std::memcpy(buf + offset * es, block, block_bytes);
  local_->allgather(buf, counts, dtype);
}

// allreduce_2d with its phases overlapped. Piece c holds the c-th of `pieces` slices of every
// cross-site block of every member's block, so that the site's reduce-scatter of piece c gives the
// cross ring (one ring over the whole block, run by pipe_'s thread with the site's peers out of
// its way) the c-th piece of each of its blocks at once: the ring starts after the first piece
// and takes each next one as it comes, and the site allgathers piece c as soon as the ring has
// finished it. Each element meets the same operations in the same order as in allreduce_2d (its
// site block and its cross block are the same), so the bits are the same; the price is a copy of
// the buffer in piece order (scratch, kept) and two memory copies per byte.
void Communicator::allreduce_2d_overlapped(std::byte* buf, size_t count, DType dtype, ReduceOp op,
                                           size_t pieces) {
  const ReduceOp partial = op == ReduceOp::AVG ? ReduceOp::SUM : op;
  const uint32_t m = local_->size(), mine = local_->rank(), k = cross_->size();
  const size_t es = dtype_size(dtype);
  if (!pipe_) pipe_ = std::make_unique<SitePipe>();
  SitePipe& pipe = *pipe_;
  pipe.sub.resize(size_t{m} * k);
  pipe.counts.resize(m);
  for (uint32_t j = 0; j < m; ++j) {
    const size_t block = count / m + (j < count % m);
    for (uint32_t q = 0; q < k; ++q) pipe.sub[j * k + q] = block / k + (q < block % k);
  }
  const size_t own_count = count / m + (mine < count % m);
  // Elements before slice c of (member j, cross block q): within the block, and summed over all.
  auto lo = [&](uint32_t j, uint32_t q, size_t c) { return pipe.sub[j * k + q] * c / pieces; };
  auto before = [&](size_t c, uint32_t only_j, bool one) {
    size_t t = 0;
    for (uint32_t j = one ? only_j : 0; j < (one ? only_j + 1 : m); ++j)
      for (uint32_t q = 0; q < k; ++q) t += lo(j, q, c);
    return t;
  };
  scratch_.resize((count + own_count) * es);
  std::byte* const gathered = scratch_.data();   // the buffer in piece order
  std::byte* const own = gathered + count * es;  // this member's block in piece order
  cross_->ring_at_.clear();
  for (uint32_t q = 0; q < k; ++q)
    for (size_t c = 0; c < pieces; ++c) {
      size_t at = before(c, mine, true);
      for (uint32_t p = 0; p < q; ++p) at += lo(mine, p, c + 1) - lo(mine, p, c);
      cross_->ring_at_.emplace_back(own + at * es, (lo(mine, q, c + 1) - lo(mine, q, c)) * es);
    }
  // Piece c's elements per member into pipe.counts; kIn copies it from buf to its place in
  // `gathered`, kOut back.
  enum class Copy { kNone, kIn, kOut };
  auto piece = [&](size_t c, Copy copy) {
    std::byte* at = gathered + before(c, 0, false) * es;
    size_t block_at = 0;
    for (uint32_t j = 0; j < m; ++j) {
      pipe.counts[j] = 0;
      size_t sub_at = block_at;
      for (uint32_t q = 0; q < k; ++q) {
        const size_t n = lo(j, q, c + 1) - lo(j, q, c);
        std::byte* in_buf = buf + (sub_at + lo(j, q, c)) * es;
        if (n > 0 && copy != Copy::kNone)
          std::memcpy(copy == Copy::kIn ? at : in_buf, copy == Copy::kIn ? in_buf : at, n * es);
        at += n * es;
        pipe.counts[j] += n;
        sub_at += pipe.sub[j * k + q];
      }
      block_at = sub_at;
    }
  };
  pipe.start(cross_.get(), pieces, dtype, partial, timeout_s());
  try {
    for (size_t c = 0; c < pieces; ++c) {
      piece(c, Copy::kIn);
      local_->reduce_scatter(gathered + before(c, 0, false) * es, own + before(c, mine, true) * es,
                             pipe.counts, dtype, partial);
      pipe.publish_ready(c + 1);
    }
    for (size_t c = 0; c < pieces; ++c) {
      pipe.wait_past(pipe.done, c, [&] {
        return "allreduce on " + name_ + " (2-D over sites): waiting for the cross-site allreduce of piece " +
               std::to_string(c + 1) + " of " + std::to_string(pieces);
      });
      if (pipe.done.load() <= c) break;  // the cross ring failed: its error is rethrown below
      piece(c, Copy::kNone);
      std::byte* const start = gathered + before(c, 0, false) * es;
      std::byte* mine_at = start;
      for (uint32_t j = 0; j < mine; ++j) mine_at += pipe.counts[j] * es;
      // Copied before dividing: the cross ring may still be sending from `own`.
      std::memcpy(mine_at, own + before(c, mine, true) * es, pipe.counts[mine] * es);
      if (op == ReduceOp::AVG) finish_average(mine_at, pipe.counts[mine], dtype, size());
      local_->allgather(start, pipe.counts, dtype);
      piece(c, Copy::kOut);
    }
    pipe.wait_idle();
  } catch (...) {
    // The cross ring reads and writes scratch_: it must have stopped before this call returns.
    pipe.stop_job();
    pipe.wait_idle();
    throw;
  }
  if (pipe.error) std::rethrow_exception(pipe.error);
}

// ---- reduce_scatter / allgather --------------------------------------------------------------

void Communicator::ring_reduce_scatter(std::byte* buf, std::span<const size_t> counts, DType dtype,
                                       ReduceOp op, const net::OpInfo& info) {
  const uint32_t n = size(), r = rank_;
  const size_t es = dtype_size(dtype);
  auto off = byte_offsets(counts, es);
  const uint32_t next = (r + 1) % n, prev = (r + n - 1) % n;
  // Block b starts at rank b+1 and travels the ring, gathering one contribution per hop,
  // until rank b adds the last one.
  for (uint32_t s = 0; s + 1 < n; ++s) {
    uint32_t sb = (r + 2 * n - 1 - s) % n;
    uint32_t rb = (r + 2 * n - 2 - s) % n;
    Transfer ts[2] = {make_send(next, buf + off[sb], counts[sb] * es),
                      make_recv_reduce(prev, buf + off[rb], counts[rb] * es, dtype, op)};
    exchange(ts, info);
  }
}

void Communicator::ring_allgather(std::byte* buf, std::span<const size_t> counts, DType dtype,
                                  const net::OpInfo& info) {
  const uint32_t n = size(), r = rank_;
  const size_t es = dtype_size(dtype);
  auto off = byte_offsets(counts, es);
  const uint32_t next = (r + 1) % n, prev = (r + n - 1) % n;
  for (uint32_t s = 0; s + 1 < n; ++s) {
    uint32_t sb = (r + n - s) % n;
    uint32_t rb = (r + 2 * n - s - 1) % n;
    Transfer ts[2] = {make_send(next, buf + off[sb], counts[sb] * es),
                      make_recv(prev, buf + off[rb], counts[rb] * es)};
    exchange(ts, info);
  }
}

void Communicator::reduce_scatter(const void* in, void* out, std::span<const size_t> counts, DType dtype,
                                  ReduceOp op) {
  if (counts.size() != size())
    throw Error(ErrorKind::kInvalidArgument, "reduce_scatter: " + std::to_string(counts.size()) +
                                                 " block counts for a group of " + std::to_string(size()));
  net::OpInfo info = begin("reduce_scatter", Opcode::kReduceScatter);
  const size_t es = dtype_size(dtype);
  auto off = byte_offsets(counts, es);
  info.bytes = static_cast<int64_t>(off.back());
  info.algo = "ring";
  const auto* src = static_cast<const std::byte*>(in);
  auto* dst = static_cast<std::byte*>(out);
  if (size() == 1) {
    if (counts[0] > 0) std::memcpy(dst, src, counts[0] * es);
    return;
  }
  // One wait through the shared slots where the whole input fits a slot (comm/direct.h).
  const bool small = use_small() && HostSmall::fits_reduce_scatter(counts, dtype);
  const bool direct = !small && use_direct(off.back());
  if (small) info.algo = "shared slots";
  if (direct) info.algo = "direct";
  guarded(info, [&] {
    if (small) return host_small().reduce_scatter(src, dst, counts, dtype, op, info);
    if (direct && host_direct().reduce_scatter(src, dst, counts, dtype, op, info)) return;
    // The ring of ring_reduce_scatter, but partial sums live in two scratch blocks (one being
    // sent while the next is received) instead of a full-size copy of the input.
    const uint32_t n = size(), r = rank_;
    const uint32_t next = (r + 1) % n, prev = (r + n - 1) % n;
    const size_t block = *std::max_element(counts.begin(), counts.end()) * es;
    scratch_.resize(2 * block);
    std::byte* work[2] = {scratch_.data(), scratch_.data() + block};
    for (uint32_t s = 0; s + 1 < n; ++s) {
      uint32_t sb = (r + 2 * n - 1 - s) % n;
      uint32_t rb = (r + 2 * n - 2 - s) % n;
      const std::byte* send_from = s == 0 ? src + off[sb] : work[(s + 1) % 2];
      std::byte* recv_into = s + 2 == n ? dst : work[s % 2];
      if (counts[rb] > 0) std::memcpy(recv_into, src + off[rb], counts[rb] * es);
      Transfer ts[2] = {make_send(next, send_from, counts[sb] * es),
                        make_recv_reduce(prev, recv_into, counts[rb] * es, dtype, op)};
      exchange(ts, info);
    }
    if (op == ReduceOp::AVG) finish_average(dst, counts[r], dtype, size());
  });
}

bool Communicator::allgather_checks_blocks(std::span<const size_t> counts, DType dtype) const {
  return size() == 1 || (use_small() && HostSmall::fits_allgather(counts, dtype));
}

void Communicator::allgather(void* buf, std::span<const size_t> counts, DType dtype, const void* own) {
  if (counts.size() != size())
    throw Error(ErrorKind::kInvalidArgument, "allgather: " + std::to_string(counts.size()) +
                                                 " block counts for a group of " + std::to_string(size()));
  net::OpInfo info = begin("allgather", Opcode::kAllgather);
  const std::vector<size_t> offs = byte_offsets(counts, dtype_size(dtype));
  const size_t bytes = offs.back(), own_bytes = offs[rank_ + 1] - offs[rank_];
  auto* b = static_cast<std::byte*>(buf);
  const auto* mine = static_cast<const std::byte*>(own);
  // `own` read in place only where it is this rank's block itself or lies outside buf: peers
  // write all of buf meanwhile.
  if (mine != nullptr && mine != b + offs[rank_] && mine < b + bytes && b < mine + own_bytes) {
    std::memmove(b + offs[rank_], mine, own_bytes);
    mine = nullptr;
  }
  if (mine == nullptr) mine = b + offs[rank_];
  auto place_own = [&] {
    if (mine != b + offs[rank_] && own_bytes > 0) std::memcpy(b + offs[rank_], mine, own_bytes);
  };
  if (size() == 1) return place_own();
  info.bytes = static_cast<int64_t>(bytes);
  // One wait through the shared slots where every rank's block fits its slot (comm/direct.h).
  const bool small = allgather_checks_blocks(counts, dtype);
  const bool direct = !small && use_direct(bytes);
  info.algo = small ? "shared slots" : direct ? "direct" : "ring";
  guarded(info, [&] {
    if (direct && host_direct().allgather(mine, b, counts, dtype, info)) return;
    place_own();
    if (small)
      host_small().allgather(b, counts, dtype, info);
    else
      ring_allgather(b, counts, dtype, info);
  });
}

// ---- broadcast / reduce ----------------------------------------------------------------------

void Communicator::binomial_broadcast(std::byte* buf, size_t bytes, uint32_t root, const net::OpInfo& info) {
  const uint32_t n = size();
  const uint32_t vr = (rank_ + n - root) % n;
  for (uint32_t mask = 1; mask < n; mask <<= 1) {
    if (vr < mask) {
      if (vr + mask < n) {
        Transfer s[1] = {make_send((vr + mask + root) % n, buf, bytes)};
        exchange(s, info);
      }
    } else if (vr < 2 * mask) {
      Transfer q[1] = {make_recv((vr - mask + root) % n, buf, bytes)};
      exchange(q, info);
    }
  }
}

void Communicator::chain_broadcast(std::byte* buf, size_t bytes, uint32_t root, const net::OpInfo& info) {
  const uint32_t n = size();
  const uint32_t pos = (rank_ + n - root) % n;  // place in the chain
  const uint32_t next = (rank_ + 1) % n, prev = (rank_ + n - 1) % n;
  // About 64 chunks: the chain's fill and drain (n - 2 chunks) stay a few percent of the whole,
  // and a chunk is large enough that its step's fixed costs do not count.
  const size_t chunk = std::max<size_t>(256 * 1024, (bytes + 63) / 64);
  const size_t chunks = (bytes + chunk - 1) / chunk;
  auto at = [&](size_t c) { return buf + c * chunk; };
  auto len = [&](size_t c) { return std::min(chunk, bytes - c * chunk); };
  std::vector<Transfer> ts;
  if (pos == 0 || pos + 1 == n) {
    // The ends only send or only receive: every chunk in one exchange, in order on the one peer.
    for (size_t c = 0; c < chunks; ++c)
      ts.push_back(pos == 0 ? make_send(next, at(c), len(c)) : make_recv(prev, at(c), len(c)));
    exchange(ts, info);
    return;
  }
  for (size_t k = 0; k <= chunks; ++k) {
    ts.clear();
    if (k < chunks) ts.push_back(make_recv(prev, at(k), len(k)));
    if (k > 0) ts.push_back(make_send(next, at(k - 1), len(k - 1)));
    exchange(ts, info);
  }
}

void Communicator::broadcast(void* buf, size_t count, DType dtype, uint32_t root) {
  if (root >= size())
    throw Error(ErrorKind::kInvalidArgument, "broadcast: root " + std::to_string(root) +
                                                 " is not a rank of a group of " + std::to_string(size()));
  net::OpInfo info = begin("broadcast", Opcode::kBroadcast);
  if (size() == 1) return;
  auto* b = static_cast<std::byte*>(buf);
  const size_t es = dtype_size(dtype);
  info.bytes = static_cast<int64_t>(count * es);
  // One host: an allgather whose only block is the root's (comm/direct.h): each chunk read once
  // from the root and written once into every other rank, by whichever rank is running. Small
  // ones stay on the tree: through the shared slots every rank waited for every other, and the
  // root, which the tree lets go as soon as its data is on its way, took 4-10x longer per 4 KiB
  // broadcast in a loop.
  const bool direct = use_direct(count * es);
  const bool large = count * es >= ctx_->options().large_broadcast_bytes && count >= size();
  // Across hosts a link, not memory, is the bound: scatter + allgather makes the root send
  // 2 (n - 1) / n of the buffer, the chain sends it once (a 50 MB state to a newcomer on 4
  // emulated hosts at 1 Gbit: 0.61 of the link against 0.89, benchmarks/elastic.py --hosts 4).
  // One host keeps scatter + allgather, whose transfers run in parallel over shared memory.
  const bool chain = large && !all_local_ && size() >= 3;
  info.algo = direct   ? "direct"
              : !large ? "binomial tree"
              : chain  ? "pipelined chain"
                       : "scatter + ring allgather";
  guarded(info, [&] {
    if (direct) {
      std::vector<size_t> blocks(size(), 0);
      blocks[root] = count * es;
      // In place: each rank's (empty but the root's) block is where the buffer has it.
      if (host_direct().allgather(b + (rank_ > root ? count * es : 0), b, blocks, DType::U8, info)) return;
    }
    if (!large) {
      binomial_broadcast(b, count * es, root, info);
      return;
    }
    if (chain) {
      chain_broadcast(b, count * es, root, info);
      return;
    }
    // Large: the root scatters one block to each rank, then a ring allgather completes
    // everyone. The root sends each byte once instead of log2(n) times.
    auto counts = even_split(count, size());
    auto off = byte_offsets(counts, es);
    std::vector<Transfer> ts;
    if (rank_ == root) {
      for (uint32_t i = 0; i < size(); ++i)
        if (i != root) ts.push_back(make_send(i, b + off[i], counts[i] * es));
    } else {
      ts.push_back(make_recv(root, b + off[rank_], counts[rank_] * es));
    }
    exchange(ts, info);
    ring_allgather(b, counts, dtype, info);
  });
}

void Communicator::reduce(void* buf, size_t count, DType dtype, ReduceOp op, uint32_t root) {
  if (root >= size())
    throw Error(ErrorKind::kInvalidArgument, "reduce: root " + std::to_string(root) +
                                                 " is not a rank of a group of " + std::to_string(size()));
  net::OpInfo info = begin("reduce", Opcode::kReduce);
  if (size() == 1) return;
  auto* b = static_cast<std::byte*>(buf);
  const size_t es = dtype_size(dtype);
  info.bytes = static_cast<int64_t>(count * es);
  // One host: a reduce_scatter whose only block is the root's (comm/direct.h), so each chunk is
  // read once from every rank and written once into the root; the others' buffers stay as they
  // were. (The hierarchical allreduce's first leg.)
  // Small ones likewise through the shared slots: only the root reads them.
  const bool small = use_small() && HostSmall::fits(count * es);
  const bool direct = !small && use_direct(count * es);
  if (small) info.algo = "shared slots";
  if (direct) info.algo = "direct";
  guarded(info, [&] {
    if (small || direct) {
      std::vector<size_t> blocks(size(), 0);
      blocks[root] = count;
      if (small) return host_small().reduce_scatter(b, b, blocks, dtype, op, info);
      if (host_direct().reduce_scatter(b, b, blocks, dtype, op, info)) return;
    }
    if (count * es <= small_bytes() || count < size()) {
      allreduce_rd(b, count, dtype, op, info);
      return;
    }
    auto counts = even_split(count, size());
    auto off = byte_offsets(counts, es);
    ring_reduce_scatter(b, counts, dtype, op, info);
    if (op == ReduceOp::AVG) finish_average(b + off[rank_], counts[rank_], dtype, size());
    std::vector<Transfer> ts;
    if (rank_ == root) {
      for (uint32_t i = 0; i < size(); ++i)
        if (i != root) ts.push_back(make_recv(i, b + off[i], counts[i] * es));
    } else {
      ts.push_back(make_send(root, b + off[rank_], counts[rank_] * es));
    }
    exchange(ts, info);
  });
}

// ---- alltoall, barrier, point to point ------------------------------------------------------

void Communicator::alltoall(const void* in, std::span<const size_t> send_counts, void* out,
                            std::span<const size_t> recv_counts, DType dtype) {
  if (send_counts.size() != size() || recv_counts.size() != size())
    throw Error(ErrorKind::kInvalidArgument,
                "alltoall: split sizes must have one entry per rank (" + std::to_string(size()) + ")");
  net::OpInfo info = begin("alltoall", Opcode::kAlltoall);
  const size_t es = dtype_size(dtype);
  auto soff = byte_offsets(send_counts, es);
  info.bytes = static_cast<int64_t>(soff.back());
  auto roff = byte_offsets(recv_counts, es);
  const auto* src = static_cast<const std::byte*>(in);
  auto* dst = static_cast<std::byte*>(out);
  if (send_counts[rank_] != recv_counts[rank_])
    throw Error(ErrorKind::kInvalidArgument,
                "alltoall: this rank sends itself " + std::to_string(send_counts[rank_]) +
                    " elements but expects " + std::to_string(recv_counts[rank_]));
  if (send_counts[rank_] > 0) std::memcpy(dst + roff[rank_], src + soff[rank_], send_counts[rank_] * es);
  if (size() == 1) return;
  guarded(info, [&] {
    std::vector<Transfer> ts;
    for (uint32_t s = 1; s < size(); ++s) {
      uint32_t to = (rank_ + s) % size(), from = (rank_ + size() - s) % size();
      ts.push_back(make_send(to, src + soff[to], send_counts[to] * es));
      ts.push_back(make_recv(from, dst + roff[from], recv_counts[from] * es));
    }
    exchange(ts, info);
  });
}

std::vector<double> Communicator::peer_rtts() {
  const std::vector<size_t> none(size(), 0);
  alltoall(nullptr, none, nullptr, none, DType::U8);
  return link_rtts();
}

std::vector<double> Communicator::link_rtts() const {
  std::vector<double> rtt(size(), 0.0);
  for (uint32_t p = 0; p < size(); ++p)
    if (channels_[p]) rtt[p] = channels_[p]->min_rtt_s();
  return rtt;
}

void Communicator::barrier() {
  net::OpInfo info = begin("barrier", Opcode::kBarrier);
  if (size() == 1) return;
  guarded(info, [&] { barrier_within(info); });
}

void Communicator::barrier_within(const net::OpInfo& info) {
  // Dissemination: after round k every rank has heard, indirectly, from 2^(k+1) ranks.
  for (uint32_t k = 1; k < size(); k <<= 1) {
    Transfer ts[2] = {make_send((rank_ + k) % size(), nullptr, 0),
                      make_recv((rank_ + size() - k) % size(), nullptr, 0)};
    exchange(ts, info);
  }
}

void Communicator::send(const void* buf, size_t bytes, uint32_t dst) {
  if (dst >= size() || dst == rank_)
    throw Error(ErrorKind::kInvalidArgument, "send: destination " + std::to_string(dst) +
                                                 " is not another rank of a group of " +
                                                 std::to_string(size()));
  net::OpInfo info = begin("send", Opcode::kSendRecv);
  --next_tag_;  // point-to-point messages are numbered per peer, not per collective
  info.tag = p2p_sent_[dst]++;
  info.name = "send to " + peer_desc(dst);
  info.bytes = static_cast<int64_t>(bytes);
  info.peer = static_cast<int32_t>(world_ranks_[dst]);
  guarded(info, [&] {
    Transfer t[1] = {make_send(dst, buf, bytes)};
    exchange(t, info);
  });
}

void Communicator::recv(void* buf, size_t bytes, uint32_t src) {
  if (src >= size() || src == rank_)
    throw Error(ErrorKind::kInvalidArgument, "recv: source " + std::to_string(src) +
                                                 " is not another rank of a group of " +
                                                 std::to_string(size()));
  net::OpInfo info = begin("recv", Opcode::kSendRecv);
  --next_tag_;
  info.tag = p2p_recv_[src]++;
  info.name = "recv from " + peer_desc(src);
  info.bytes = static_cast<int64_t>(bytes);
  info.peer = static_cast<int32_t>(world_ranks_[src]);
  guarded(info, [&] {
    Transfer t[1] = {make_recv(src, buf, bytes)};
    exchange(t, info);
  });
}

}  // namespace rumor
