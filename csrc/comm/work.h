// Asynchronous execution of a communicator's operations. Every operation of a communicator
// runs in submission order, on the caller's thread when nothing is queued (no hand-off cost
// for blocking calls) and on the communicator's progress thread otherwise.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "core/types.h"

namespace rumor {

class Work {
 public:
  bool done() const;
  // Blocks until the operation finished; rethrows its error. Throws kTimeout if `deadline`
  // passes first (the operation itself keeps its own deadline and will end too).
  void wait(const Deadline& deadline) const;
  void finish(std::exception_ptr error);

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class Worker {
 public:
  Worker() = default;
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  std::shared_ptr<Work> submit(std::function<void()> fn);
  // Runs fn on this thread if the queue is idle, else queues it; returns once fn has run.
  void run(std::function<void()> fn, const Deadline& deadline);

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<Work>>> queue_;
  bool busy_ = false;  // an op is running (on the thread or inline)
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace rumor
