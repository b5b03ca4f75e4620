// One listening socket per process. A background thread accepts connections, validates their
// Hello without ever blocking on a single slow or hostile client, and parks accepted streams
// until the communicator that owns them asks (take()).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>

#include "core/types.h"
#include "net/handshake.h"
#include "net/socket.h"

namespace rumor::net {

class Listener {
 public:
  Listener(const Token& token, uint32_t world_size, int port);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  int port() const { return port_; }
  // Waits for the stream (comm_id, from_rank, stream) to be accepted and hands it over.
  Fd take(uint64_t comm_id, uint32_t from_rank, uint32_t stream, const Deadline& deadline);
  // Connections closed because of bad magic, version, token or rank (tests read it).
  uint64_t rejected() const { return rejected_.load(); }

 private:
  using Key = std::tuple<uint64_t, uint32_t, uint32_t>;
  void run();

  Token token_;
  uint32_t world_size_;
  Fd listen_fd_;
  Fd wake_fd_;  // eventfd that stops the thread
  int port_ = 0;
  std::atomic<uint64_t> rejected_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, Fd> ready_;
  std::thread thread_;
};

}  // namespace rumor::net
