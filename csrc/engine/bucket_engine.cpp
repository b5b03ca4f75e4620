#include "engine/bucket_engine.h"

#include <chrono>

namespace rumor {

namespace {
double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
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
  b.timing = std::make_shared<BucketTiming>(
      BucketTiming{static_cast<uint32_t>(&b - buckets_.data()), spec.count, steady_seconds(), 0, 0});
  b.work = comm->worker().submit([comm, spec, timing = b.timing] {
    timing->started = steady_seconds();
    spec.op->run(*comm, reinterpret_cast<void*>(spec.data), spec.count, spec.dtype);
    timing->ended = steady_seconds();
  });
  if (spec.after) {
    // A failed op fails its `after` too (the update never sees an unreduced gradient); finish()
    // reports the first error.
    b.after_work = steps_.submit([comm, spec, done = b.work] {
      done->wait(Deadline::after(comm->timeout_s() * 2));
      spec.after->run(*comm, reinterpret_cast<void*>(spec.data), spec.count, spec.dtype);
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
  }
  next_launch_ = 0;
  if (first) std::rethrow_exception(first);
  if (!complete)
    throw Error(ErrorKind::kInvalidArgument,
                "backward finished but gradient buckets [" + missing +
                    "] never became ready: some parameters received no gradient");
}

}  // namespace rumor
