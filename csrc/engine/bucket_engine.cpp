#include "engine/bucket_engine.h"

#include <chrono>
#include <cstdio>
#include <cstring>

namespace rumor {

namespace {
double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void set_name(char* dst, size_t n, const std::string& s) { std::snprintf(dst, n, "%s", s.c_str()); }

// A bucket's life on the timeline: an async span from ready to finished with its queue wait in
// the args, and the op itself as a span on the thread that ran it (its collective nests inside).
void trace_bucket(trace::Recorder& rec, const BucketTiming& t, double ready_at, uint64_t id, size_t bytes,
                  const std::string& op, const char* comm) {
  const std::string name = "bucket " + std::to_string(t.bucket);
  trace::Event run;
  run.cat = trace::Category::kBucket;
  run.ts = t.started * 1e6;
  run.dur = (t.ended - t.started) * 1e6;
  run.bytes = static_cast<int64_t>(bytes);
  set_name(run.name, sizeof(run.name), name);
  set_name(run.comm, sizeof(run.comm), comm);
  run.tag = t.bucket;
  char args[sizeof(run.args)];
  std::snprintf(args, sizeof(args), "\"op\":\"%.40s\",\"queued_us\":%.3f,\"ready_to_start_us\":%.3f",
                op.c_str(), (t.started - t.launched) * 1e6, (t.started - ready_at) * 1e6);
  std::memcpy(run.args, args, sizeof(args));
  rec.emit(run);
  trace::Event b = run;
  b.ph = 'b';
  b.id = id;
  b.ts = ready_at * 1e6;
  b.dur = 0;
  std::snprintf(args, sizeof(args),
                "\"ready_us\":%.3f,\"queued_us\":%.3f,\"started_us\":%.3f,\"finished_us\":%.3f",
                ready_at * 1e6, t.launched * 1e6, t.started * 1e6, t.ended * 1e6);
  std::memcpy(b.args, args, sizeof(args));
  rec.emit(b);
  trace::Event e = b;
  e.ph = 'e';
  e.ts = t.ended * 1e6;
  e.args[0] = '\0';
  rec.emit(e);
}
}  // namespace

BucketEngine::BucketEngine(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {}

BucketEngine::~BucketEngine() {
  // Buckets point into buffers Python owns; never leave an op running past our lifetime.
  for (auto& b : buckets_) {
    for (const auto& w : {b.work, b.after_work}) {
      if (!w) continue;
      try {
        w->wait(Deadline::after(comm_->timeout_s() * 2));
      } catch (...) {
        // Destructors do not throw; the error was (or will be) reported by finish().
      }
    }
  }
}

void BucketEngine::set_buckets(std::vector<BucketSpec> buckets) {
  std::lock_guard lk(mu_);
  if (next_launch_ != 0)
    throw Error(ErrorKind::kInvalidArgument, "set_buckets: buckets of the current iteration are in flight");
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (!buckets[i].op)
      throw Error(ErrorKind::kInvalidArgument, "set_buckets: bucket " + std::to_string(i) + " has no op");
    if (buckets[i].slots == 0)
      throw Error(ErrorKind::kInvalidArgument, "set_buckets: bucket " + std::to_string(i) + " is empty");
  }
  buckets_.clear();
  for (auto& s : buckets) buckets_.push_back(Bucket{std::move(s), 0, nullptr, nullptr, nullptr});
}

void BucketEngine::set_after(std::vector<std::shared_ptr<BucketOp>> after) {
  std::lock_guard lk(mu_);
  if (next_launch_ != 0)
    throw Error(ErrorKind::kInvalidArgument, "set_after: buckets of the current iteration are in flight");
  if (after.size() != buckets_.size())
    throw Error(ErrorKind::kInvalidArgument, "set_after: got " + std::to_string(after.size()) + " ops for " +
                                                 std::to_string(buckets_.size()) + " buckets");
  for (size_t i = 0; i < after.size(); ++i) buckets_[i].spec.after = std::move(after[i]);
}

void BucketEngine::launch_locked(Bucket& b) {
  Communicator* comm = comm_.get();
  BucketSpec spec = b.spec;
  const uint32_t index = static_cast<uint32_t>(&b - buckets_.data());
  const double now = steady_seconds();
  b.timing = std::make_shared<BucketTiming>(BucketTiming{index, spec.count, now, 0, 0});
  trace::Recorder& rec = comm->recorder();
  const size_t bytes = spec.count * dtype_size(spec.dtype);
  const std::string what = "bucket " + std::to_string(index) + ": " + spec.op->name();
  // The flight recorder sees the bucket from the moment it is queued.
  const uint64_t seq = rec.flight_begin(trace::OpDesc{what, comm->name(), index, static_cast<int64_t>(bytes),
                                                      -1, comm->size(), nullptr, nullptr},
                                        trace::FlightState::kQueued, now * 1e6);
  const double ready_at = b.ready_at > 0 ? b.ready_at : now;
  b.work = comm->worker().submit([comm, spec, timing = b.timing, seq, ready_at, id = launches_++, bytes] {
    trace::Recorder& r = comm->recorder();
    timing->started = steady_seconds();
    r.flight_update(seq, trace::FlightState::kRunning, timing->started * 1e6);
    try {
      spec.op->run(*comm, reinterpret_cast<void*>(spec.data), spec.count, spec.dtype);
    } catch (const std::exception& e) {
      r.flight_update(seq, trace::FlightState::kFailed, steady_seconds() * 1e6, e.what());
      throw;
    }
    timing->ended = steady_seconds();
    r.flight_update(seq, trace::FlightState::kDone, timing->ended * 1e6);
    if (r.active()) trace_bucket(r, *timing, ready_at, id, bytes, spec.op->name(), comm->name().c_str());
  });
  if (spec.after) {
    // A failed op fails its `after` too (the update never sees an unreduced gradient); finish()
    // reports the first error.
    b.after_work = steps_.submit([comm, spec, done = b.work] {
      done->wait(Deadline::after(comm->timeout_s() * 2));
      trace::Recorder& r = comm->recorder();
      const double t0 = r.active() ? trace::now_us() : 0;
      spec.after->run(*comm, reinterpret_cast<void*>(spec.data), spec.count, spec.dtype);
      if (t0 > 0 && r.active()) {
        trace::Event e;
        e.cat = trace::Category::kPhase;
        e.ts = t0;
        e.dur = trace::now_us() - t0;
        e.bytes = static_cast<int64_t>(spec.count * dtype_size(spec.dtype));
        set_name(e.name, sizeof(e.name), "optimizer step: " + spec.after->name());
        r.emit(e);
      }
    });
  }
}

void BucketEngine::launch_ready_locked() {
  while (next_launch_ < buckets_.size() &&
         buckets_[next_launch_].ready == buckets_[next_launch_].spec.slots) {
    launch_locked(buckets_[next_launch_]);
    ++next_launch_;
  }
}

void BucketEngine::mark_ready(uint32_t bucket) {
  std::lock_guard lk(mu_);
  if (bucket >= buckets_.size())
    throw Error(ErrorKind::kInvalidArgument, "mark_ready: no bucket " + std::to_string(bucket));
  Bucket& b = buckets_[bucket];
  if (b.ready >= b.spec.slots)
    throw Error(ErrorKind::kInvalidArgument,
                "mark_ready: bucket " + std::to_string(bucket) +
                    " got more gradients than it has parameters in one iteration (a parameter used "
                    "twice with retain_graph, or backward called twice without optimizer step?)");
  ++b.ready;
  if (b.ready == b.spec.slots) {
    b.ready_at = steady_seconds();
    trace::Recorder& rec = comm_->recorder();
    if (rec.active()) {
      trace::Event e;
      e.ph = 'i';
      e.cat = trace::Category::kBucket;
      e.ts = b.ready_at * 1e6;
      e.tag = bucket;
      set_name(e.name, sizeof(e.name), "bucket " + std::to_string(bucket) + " ready");
      rec.emit(e);
    }
  }
  launch_ready_locked();
}

void BucketEngine::launch_all() {
  std::lock_guard lk(mu_);
  for (auto& b : buckets_) b.ready = b.spec.slots;
  launch_ready_locked();
}

std::vector<uint32_t> BucketEngine::incomplete() const {
  std::lock_guard lk(mu_);
  std::vector<uint32_t> out;
  for (size_t i = 0; i < buckets_.size(); ++i)
    if (buckets_[i].ready < buckets_[i].spec.slots) out.push_back(static_cast<uint32_t>(i));
  return out;
}

std::vector<BucketTiming> BucketEngine::last_timings() const {
  std::lock_guard lk(mu_);
  return last_timings_;
}

bool BucketEngine::idle() const {
  std::lock_guard lk(mu_);
  return next_launch_ == 0;
}

void BucketEngine::finish(const Deadline& deadline) {
  std::vector<std::shared_ptr<Work>> works;
  size_t launched;
  {
    std::lock_guard lk(mu_);
    launched = next_launch_;
    for (size_t i = 0; i < next_launch_; ++i) works.push_back(buckets_[i].work);
    for (size_t i = 0; i < next_launch_; ++i)
      if (buckets_[i].after_work) works.push_back(buckets_[i].after_work);
  }
  std::exception_ptr first;
  for (auto& w : works) {
    try {
      w->wait(deadline);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  std::lock_guard lk(mu_);
  const bool complete = launched == buckets_.size();
  if (!first) {
    // Every launched op has returned (wait() succeeded), so its timing is final.
    last_timings_.clear();
    for (size_t i = 0; i < launched; ++i) last_timings_.push_back(*buckets_[i].timing);
  }
  std::string missing;
  if (!complete)
    for (size_t i = launched; i < buckets_.size(); ++i)
      if (buckets_[i].ready < buckets_[i].spec.slots)
        missing += (missing.empty() ? "" : ", ") + std::to_string(i);
  for (auto& b : buckets_) {
    b.ready = 0;
    b.work.reset();
    b.after_work.reset();
    b.timing.reset();
    b.ready_at = 0;
  }
  next_launch_ = 0;
  if (first) std::rethrow_exception(first);
  if (!complete)
    throw Error(ErrorKind::kInvalidArgument,
                "backward finished but gradient buckets [" + missing +
                    "] never became ready: some parameters received no gradient");
}

}  // namespace rumor
