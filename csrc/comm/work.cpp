#include "comm/work.h"

#include <pthread.h>

namespace rumor {

bool Work::done() const {
  std::lock_guard lk(mu_);
  return done_;
}

void Work::wait(const Deadline& deadline) const {
  std::unique_lock lk(mu_);
  if (!cv_.wait_until(lk, deadline.at(), [&] { return done_; }))
    throw Error(ErrorKind::kTimeout, "waiting for an asynchronous operation: deadline passed");
  if (error_) std::rethrow_exception(error_);
}

void Work::finish(std::exception_ptr error) {
  std::lock_guard lk(mu_);
  error_ = std::move(error);
  done_ = true;
  cv_.notify_all();
}

Worker::~Worker() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<Work> Worker::submit(std::function<void()> fn) {
  auto work = std::make_shared<Work>();
  std::lock_guard lk(mu_);
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  queue_.emplace_back(std::move(fn), work);
  cv_.notify_all();
  return work;
}

void Worker::run(std::function<void()> fn, const Deadline& deadline) {
  {
    std::unique_lock lk(mu_);
    if (!busy_ && queue_.empty()) {
      busy_ = true;
      lk.unlock();
      std::exception_ptr err;
      try {
        fn();
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      busy_ = false;
      // The thread waits only for queued work, so wake it only if some was queued meanwhile. A
      // wake-up after every inline operation cost each small collective a context switch into a
      // thread that found nothing to do and slept again.
      if (!queue_.empty()) cv_.notify_all();
      if (err) std::rethrow_exception(err);
      return;
    }
  }
  submit(std::move(fn))->wait(deadline);
}

void Worker::loop() {
  // Named so that timelines and debuggers can tell the communication threads apart.
  ::pthread_setname_np(::pthread_self(), "rumor worker");
  std::unique_lock lk(mu_);
  while (true) {
    cv_.wait(lk, [&] { return stop_ || (!busy_ && !queue_.empty()); });
    if (queue_.empty() && stop_) return;
    if (queue_.empty()) continue;
    auto [fn, work] = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lk.unlock();
    std::exception_ptr err;
    try {
      fn();
    } catch (...) {
      err = std::current_exception();
    }
    // Release the task's captures before anyone can see it done. A waiter may drop the last other
    // owner of this worker's communicator the moment wait() returns: a capture released after
    // finish() could then run ~Worker on this very thread, which cannot join itself. And
    // before mu_: a capture may hold an op whose destructor takes another lock (a Python-backed
    // op takes the GIL), and a thread holding that lock while submitting here waits for mu_.
    fn = nullptr;
    work->finish(err);
    work.reset();
    lk.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

}  // namespace rumor
