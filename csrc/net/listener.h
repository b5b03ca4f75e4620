// One listening socket per process. A background thread accepts connections, runs the
// accepting side of the handshake (net/handshake.h) on non-blocking sockets, and parks
// authenticated streams until the communicator that owns them asks (take()).
//
// What a stranger (anyone who can reach the port but does not hold the key) can and cannot do:
// it never gets a stream, and never takes the place of one: a (comm, rank, stream) is handed out
// once, to the first connection that proves the key. No single connection blocks the thread:
// every read and write is non-blocking and a handshake has `handshake_timeout` in all. It can
// make the listener busy: at most `max_pending` connections are kept before they authenticate
// (the oldest is dropped for a new one, and told "busy" so that a real peer dials again), so a
// flood faster than peers can finish their handshakes delays them until it stops or their
// deadline passes. At the process's fd limit the thread pauses accepting instead of spinning.
#pragma once

#include <atomic>
#include <chrono>
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

struct ListenerLimits {
  size_t max_pending = 128;                           // connections not yet authenticated
  std::chrono::milliseconds handshake_timeout{3000};  // from accept to Accept sent
  std::chrono::milliseconds accept_backoff{100};      // pause after EMFILE / ENFILE
  int log_lines_per_s = 5;                            // refusal warnings; the rest are counted
};

class Listener {
 public:
  // bind_host: an address or name to listen on ("" = every interface).
  Listener(const Key& key, uint32_t rank, uint32_t world_size, int port, const std::string& bind_host = "",
           ListenerLimits limits = {});
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  int port() const { return port_; }
  // Waits for the stream (comm_id, from_rank, stream) to be accepted and hands it over.
  Fd take(uint64_t comm_id, uint32_t from_rank, uint32_t stream, const Deadline& deadline);
  // Connections closed without becoming a stream: bad bytes, a failed proof, a second claim of
  // a stream, the handshake deadline, or dropped for the pending cap (tests read it).
  uint64_t rejected() const { return rejected_.load(); }
  // Connections accepted that have not authenticated yet.
  size_t pending() const { return pending_count_.load(); }
  // Times accept() hit the fd limit and the thread paused.
  uint64_t accept_backoffs() const { return backoffs_.load(); }
  // CPU time the listener thread has used: tests check that it does not spin.
  double thread_cpu_seconds() const;

 private:
  using StreamKey = std::tuple<uint64_t, uint32_t, uint32_t>;
  struct Pending;
  enum class Step { kKeep, kDone, kDrop };
  void run();
  Step progress(Pending& p, std::string* why);

  Key key_;
  uint32_t rank_;
  uint32_t world_size_;
  ListenerLimits limits_;
  Fd listen_fd_;
  Fd wake_fd_;  // eventfd that stops the thread
  int port_ = 0;
  std::atomic<uint64_t> rejected_{0};
  std::atomic<size_t> pending_count_{0};
  std::atomic<uint64_t> backoffs_{0};
  // Streams that proved the key, with the first claimant's address, for the Context's life:
  // a second claim of one is refused (only the listener thread touches it).
  std::map<StreamKey, std::string> claimed_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<StreamKey, Fd> ready_;
  std::thread thread_;
};

}  // namespace rumor::net
