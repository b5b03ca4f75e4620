// Connections of the NCCL net plugin: listen / connect / accept, the send and receive comms with
// their stream threads, requests and test().
//
// Threads: each stream of a comm has one thread doing blocking I/O on its socket (a sender thread
// sleeps on the comm's condition variable until a chunk is queued; a receiver thread sleeps in
// recv()), and each send comm has one watcher thread blocked in poll() that notices the peer
// closing. Nothing spins while idle; every lock is the comm's own.
//
// Errors: the first I/O error fails the comm: every socket is shut down (which wakes the other
// threads), outstanding and later requests complete with the error. test() reports it only once
// all stream threads have left, so no thread still reads or writes a buffer NCCL gets back.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/types.h"
#include "net/socket.h"
#include "netplugin/plugin.h"

namespace rumor::netplugin {
namespace {

using net::Fd;

constexpr uint32_t kHandleMagic = 0x524d4e50;  // "RMNP"
constexpr uint32_t kHelloMagic = 0x524d4e48;   // "RMNH"
constexpr uint32_t kChunkMagic = 0x524d4e43;   // "RMNC"
constexpr uint16_t kProtocolVersion = 1;

class ConnectState;

// What listen() writes into NCCL's 128-byte handle. `pending` is only ever set in the connecting
// process's copy: NCCL passes the same handle memory to every connect() retry.
struct Handle {
  uint32_t magic;
  uint16_t family;  // AF_INET or AF_INET6
  uint16_t port;    // host order
  uint8_t addr[16];
  uint64_t listen_id;  // random: a stray connection to a reused port is refused
  ConnectState* pending;
};
static_assert(sizeof(Handle) <= abi::kHandleMaxSize);

// First bytes on every stream, connector to acceptor.
struct Hello {
  uint32_t magic;
  uint16_t version;
  uint16_t stream;
  uint16_t nstreams;
  uint16_t pad[3];
  uint64_t conn_id;    // groups the streams of one connection
  uint64_t listen_id;  // from the handle
};
static_assert(sizeof(Hello) == 32);

// Precedes every chunk. A message always sends at least one chunk (a 0-byte one for size 0).
struct ChunkHeader {
  uint32_t magic;
  int32_t tag;
  uint64_t seq;     // message number on this connection, from 0
  uint64_t total;   // message size
  uint64_t offset;  // of this chunk in the message
  uint64_t len;     // of this chunk
};
static_assert(sizeof(ChunkHeader) == 40);

// RUMOR_NET_PLUGIN_TRACE: one INFO line per data-path event while its budget lasts.
// The message is built only when it will be logged: the calls sit on the data path (every chunk).
template <typename Msg>
void trace(Msg&& msg) {
  if (tracing()) log(abi::kLogInfo, "NET/rumor trace: " + msg());
}

std::string ptr_str(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

uint64_t random_id() {
  static thread_local std::mt19937_64 rng(std::random_device{}() ^
                                          static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  return rng();
}

// Blocking full transfers on a stream socket; false on EOF or error (errno kept, 0 for EOF).
// `got` (optional) tells how many bytes arrived before a failure.
bool recv_full(int fd, void* data, size_t len, size_t* got = nullptr) {
  char* p = static_cast<char*>(data);
  if (got != nullptr) *got = 0;
  while (len > 0) {
    ssize_t n = ::recv(fd, p, len, MSG_WAITALL);
    if (n == 0) {
      errno = 0;
      return false;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    len -= static_cast<size_t>(n);
    if (got != nullptr) *got += static_cast<size_t>(n);
  }
  return true;
}

// Header and payload in one sendmsg() where the kernel takes it, so a small message is one segment.
bool send_chunk(int fd, const ChunkHeader& h, const char* payload) {
  iovec iov[2] = {{const_cast<ChunkHeader*>(&h), sizeof(h)}, {const_cast<char*>(payload), h.len}};
  int iovcnt = h.len > 0 ? 2 : 1;
  iovec* cur = iov;
  while (iovcnt > 0) {
    msghdr m{};
    m.msg_iov = cur;
    m.msg_iovlen = static_cast<size_t>(iovcnt);
    ssize_t n = ::sendmsg(fd, &m, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    auto left = static_cast<size_t>(n);
    while (iovcnt > 0 && left >= cur->iov_len) {
      left -= cur->iov_len;
      ++cur;
      --iovcnt;
    }
    if (iovcnt > 0) {
      cur->iov_base = static_cast<char*>(cur->iov_base) + left;
      cur->iov_len -= left;
    }
  }
  return true;
}

std::string describe_errno(int err) {
  return err == 0 ? "connection closed by peer" : net::errno_string(err);
}

std::string peer_name(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char buf[INET6_ADDRSTRLEN] = {};
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
    port = ntohs(a->sin_port);
  } else {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf));
    port = ntohs(a->sin6_port);
  }
  return net::HostPort{buf, port}.str();
}

class CommBase;

struct Request {
  enum class Kind { kSend, kRecv, kFlush };
  Kind kind = Kind::kSend;
  CommBase* comm = nullptr;
  bool done = false;
  int n = 1;
  std::array<size_t, kMaxRecvs> sizes{};  // bytes sent / received per buffer
  // send
  size_t chunks_left = 0;
  // recv
  std::array<char*, kMaxRecvs> bufs{};
  std::array<size_t, kMaxRecvs> caps{};
  std::array<int, kMaxRecvs> tags{};
  std::array<bool, kMaxRecvs> matched{};
  int matched_count = 0;
  int done_count = 0;
  std::string truncation;  // non-empty: a message did not fit its buffer
};

// State and lifetime shared by send and recv comms. Subclasses start the threads in their
// constructor and call stop_threads() first thing in their destructor (the threads run their
// member functions).
class CommBase {
 public:
  CommBase(std::vector<Fd> fds, std::string what) : fds_(std::move(fds)), what_(std::move(what)) {
    for (auto& fd : fds_) {
      net::set_nonblocking(fd.get(), false);
      net::tune_stream_socket(fd.get());
    }
    peer_ = peer_name(fds_.at(0).get());
  }
  CommBase(const CommBase&) = delete;
  CommBase& operator=(const CommBase&) = delete;
  virtual ~CommBase() = default;

  abi::Result test(Request* r, int* done, int* sizes) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = requests_.find(r);
    if (it == requests_.end()) return abi::kInvalidArgument;
    if (!r->done) {
      // Failed: report it once no stream thread can still touch the request's buffers.
      if (!failed_ || running_ > 0) {
        *done = 0;
        return abi::kSuccess;
      }
      requests_.erase(it);
      return error_code_;
    }
    if (!r->truncation.empty()) {
      log(abi::kLogWarn, "NET/rumor: " + what_ + " from " + peer_ + ": " + r->truncation);
      requests_.erase(it);
      return abi::kInvalidUsage;
    }
    *done = 1;
    trace([&] { return "test done req " + ptr_str(r); });
    if (sizes != nullptr)
      for (int i = 0; i < r->n; ++i) sizes[i] = static_cast<int>(r->sizes[static_cast<size_t>(i)]);
    requests_.erase(it);
    return abi::kSuccess;
  }

  void* add_flush_request() {
    std::lock_guard<std::mutex> lk(mu_);
    Request* r = new_request(Request::Kind::kFlush);
    r->done = true;
    r->n = 0;
    return r;
  }

 protected:
  // Caller holds mu_.
  Request* new_request(Request::Kind kind) {
    auto owned = std::make_unique<Request>();
    Request* r = owned.get();
    r->kind = kind;
    r->comm = this;
    requests_.emplace(r, std::move(owned));
    return r;
  }

  // Caller holds mu_. The first failure wins; the sockets are shut down so every thread blocked
  // on one returns, and waiters on cv_ wake up.
  void fail(abi::Result code, const std::string& why) {
    if (failed_ || stop_) return;
    failed_ = true;
    error_code_ = code;
    for (auto& fd : fds_) ::shutdown(fd.get(), SHUT_RDWR);
    cv_.notify_all();
    on_fail();
    bool pending = false;
    for (auto& [p, r] : requests_) pending |= !r->done;
    // A peer closing an idle connection is how NCCL tears down; only lost work is a warning.
    log(pending ? abi::kLogWarn : abi::kLogInfo,
        "NET/rumor: " + what_ + " with " + peer_ + " failed: " + why);
  }
  virtual void on_fail() {}

  void thread_exit() {
    std::lock_guard<std::mutex> lk(mu_);
    --running_;
    cv_.notify_all();
  }

  template <typename F>
  void start_threads(F body) {
    running_ = static_cast<int>(fds_.size());
    for (size_t i = 0; i < fds_.size(); ++i) threads_.emplace_back(body, i);
  }

  void stop_threads() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      for (auto& fd : fds_) ::shutdown(fd.get(), SHUT_RDWR);
      cv_.notify_all();
    }
    on_fail();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Fd> fds_;
  std::vector<std::thread> threads_;
  std::unordered_map<Request*, std::unique_ptr<Request>> requests_;
  int running_ = 0;  // stream threads still running
  bool stop_ = false;
  bool failed_ = false;
  abi::Result error_code_ = abi::kSuccess;
  std::string what_;
  std::string peer_;
};

class SendComm : public CommBase {
 public:
  explicit SendComm(std::vector<Fd> fds)
      : CommBase(std::move(fds), "send connection"), chunk_(config().chunk) {
    wake_ = Fd(::eventfd(0, EFD_CLOEXEC));
    start_threads([this](size_t s) { stream_loop(s); });
    watcher_ = std::thread(&SendComm::watch_loop, this);
  }
  ~SendComm() override {
    stop_threads();
    if (watcher_.joinable()) watcher_.join();
  }

  void* isend(const char* data, size_t size, int tag) {
    std::lock_guard<std::mutex> lk(mu_);
    Request* r = new_request(Request::Kind::kSend);
    r->sizes[0] = size;
    r->chunks_left = size == 0 ? 1 : (size + chunk_ - 1) / chunk_;
    trace([&] {
      return "isend comm " + ptr_str(this) + " seq " + std::to_string(next_seq_) + " size " +
             std::to_string(size) + " tag " + std::to_string(tag) + " req " + ptr_str(r) +
             (failed_ ? " (comm failed)" : "");
    });
    if (!failed_) {
      queue_.push_back({r, next_seq_++, data, size, 0, tag});
      cv_.notify_all();
    }
    return r;
  }

 private:
  struct Pending {
    Request* req;
    uint64_t seq;
    const char* data;
    size_t size;
    size_t next;  // offset of the next chunk to hand out
    int tag;
  };

  void on_fail() override {
    uint64_t one = 1;
    // Best effort: the watcher also wakes on the sockets fail() shut down.
    if (wake_.valid() && ::write(wake_.get(), &one, sizeof(one)) < 0) return;
  }

  // Takes the next chunk of the oldest message: whichever stream is free sends it.
  void stream_loop(size_t s) {
    int fd = fds_[s].get();
    while (true) {
      ChunkHeader h{};
      const char* payload = nullptr;
      Request* req = nullptr;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || failed_ || !queue_.empty(); });
        if (stop_ || failed_) break;
        Pending& m = queue_.front();
        size_t len = std::min(chunk_, m.size - m.next);
        h = {kChunkMagic, m.tag, m.seq, m.size, m.next, len};
        payload = m.data + m.next;
        req = m.req;
        m.next += len;
        if (m.next >= m.size) queue_.pop_front();
      }
      bool ok = send_chunk(fd, h, payload);
      int err = errno;
      std::lock_guard<std::mutex> lk(mu_);
      if (!ok) {
        fail(err == EPIPE || err == ECONNRESET ? abi::kRemoteError : abi::kSystemError,
             "send on stream " + std::to_string(s) + ": " + describe_errno(err));
        break;
      }
      // The chunk is with the kernel: it counts even if the peer closed meanwhile (it may have
      // read everything and exited; a later chunk, if any, fails the request).
      if (--req->chunks_left == 0) {
        req->done = true;
        trace([&] {
          return "sent comm " + ptr_str(this) + " seq " + std::to_string(h.seq) + " req " + ptr_str(req);
        });
      }
      if (stop_ || failed_) break;
    }
    thread_exit();
  }

  // The receiver never writes back, so a readable or hung-up socket means the peer closed (or
  // died): fail at once instead of at the next send, which TCP might still accept.
  void watch_loop() {
    std::vector<pollfd> pfds;
    for (auto& fd : fds_) pfds.push_back({fd.get(), POLLRDHUP, 0});
    pfds.push_back({wake_.get(), POLLIN, 0});
    while (true) {
      int rc = ::poll(pfds.data(), pfds.size(), -1);
      if (rc < 0 && errno == EINTR) continue;
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_ || failed_) return;
      if (rc < 0) {
        fail(abi::kSystemError, "poll: " + net::errno_string(errno));
        return;
      }
      for (size_t i = 0; i + 1 < pfds.size(); ++i)
        if (pfds[i].revents != 0) {
          fail(abi::kRemoteError, "peer closed stream " + std::to_string(i) + " (process exited?)");
          return;
        }
    }
  }

  size_t chunk_;
  Fd wake_;  // eventfd: wakes the watcher on failure / close
  std::thread watcher_;
  std::deque<Pending> queue_;
  uint64_t next_seq_ = 0;
};

class RecvComm : public CommBase {
 public:
  explicit RecvComm(std::vector<Fd> fds) : CommBase(std::move(fds), "receive connection") {
    start_threads([this](size_t s) { stream_loop(s); });
  }
  ~RecvComm() override { stop_threads(); }

  void* irecv(int n, void* const* data, const size_t* sizes, const int* tags) {
    std::lock_guard<std::mutex> lk(mu_);
    Request* r = new_request(Request::Kind::kRecv);
    r->n = n;
    for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
      r->bufs[i] = static_cast<char*>(data[i]);
      r->caps[i] = sizes[i];
      r->tags[i] = tags != nullptr ? tags[i] : 0;
    }
    if (tracing()) {
      std::string what =
          "irecv comm " + ptr_str(this) + " req " + ptr_str(r) + " n " + std::to_string(n) + ":";
      for (int i = 0; i < n; ++i)
        what +=
            " [" + std::to_string(sizes[i]) + " B tag " + std::to_string(tags != nullptr ? tags[i] : 0) + "]";
      log(abi::kLogInfo, "NET/rumor trace: " + what + (failed_ ? " (comm failed)" : ""));
    }
    if (!failed_) {
      posted_.push_back(r);
      cv_.notify_all();
    }
    return r;
  }

 private:
  struct InFlight {
    Request* req;
    size_t slot;
    uint64_t total;
    uint64_t received;
    bool discard;  // truncated: the bytes are drained so the streams stay in step
  };

  // Caller holds mu_. Message `h.seq` (the next in sender order) takes the first unmatched buffer
  // with its tag, oldest posted receive first. False: no such buffer is posted yet.
  bool match(const ChunkHeader& h) {
    for (auto it = posted_.begin(); it != posted_.end(); ++it) {
      Request* r = *it;
      for (size_t i = 0; i < static_cast<size_t>(r->n); ++i) {
        if (r->matched[i] || r->tags[i] != h.tag) continue;
        r->matched[i] = true;
        r->sizes[i] = h.total;
        bool discard = h.total > r->caps[i];
        if (discard && r->truncation.empty())
          r->truncation = "message truncated: " + std::to_string(h.total) + " bytes sent with tag " +
                          std::to_string(h.tag) + " into a " + std::to_string(r->caps[i]) + "-byte buffer";
        inflight_.emplace(h.seq, InFlight{r, i, h.total, 0, discard});
        trace([&] {
          return "matched comm " + ptr_str(this) + " seq " + std::to_string(h.seq) + " (" +
                 std::to_string(h.total) + " B tag " + std::to_string(h.tag) + ") to req " + ptr_str(r) +
                 " slot " + std::to_string(i);
        });
        if (++r->matched_count == r->n) posted_.erase(it);
        ++next_match_;
        cv_.notify_all();
        return true;
      }
    }
    return false;
  }

  void stream_loop(size_t s) {
    int fd = fds_[s].get();
    std::vector<char> scratch;  // drain buffer for truncated messages
    auto io_error = [&](const std::string& what, int err) {
      std::lock_guard<std::mutex> lk(mu_);
      fail(err == 0 || err == ECONNRESET ? abi::kRemoteError : abi::kSystemError,
           what + " on stream " + std::to_string(s) + ": " + describe_errno(err));
    };
    while (true) {
      ChunkHeader h{};
      size_t got = 0;
      if (!recv_full(fd, &h, sizeof(h), &got)) {
        if (errno == 0 && got == 0) {
          // A clean end between chunks: the sender closed after its last send. The other streams
          // may still carry data, so only the last stream to end fails what is left.
          std::lock_guard<std::mutex> lk(mu_);
          if (++ended_ == fds_.size())
            fail(abi::kRemoteError, "the peer closed the connection (process exited?)");
          break;
        }
        io_error("receive", errno);
        break;
      }
      if (h.magic != kChunkMagic || h.len > h.total || h.offset > h.total - h.len) {
        std::lock_guard<std::mutex> lk(mu_);
        fail(abi::kSystemError, "corrupt chunk header on stream " + std::to_string(s));
        break;
      }
      char* dest = nullptr;
      trace([&] {
        return "chunk header comm " + ptr_str(this) + " stream " + std::to_string(s) + " seq " +
               std::to_string(h.seq) + " offset " + std::to_string(h.offset) + " len " +
               std::to_string(h.len) + " of " + std::to_string(h.total);
      });
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] {
          return stop_ || failed_ || h.seq < next_match_ || (h.seq == next_match_ && match(h));
        });
        if (stop_ || failed_) break;
        auto it = inflight_.find(h.seq);
        if (it == inflight_.end() || it->second.total != h.total) {
          fail(abi::kSystemError,
               "chunk of unknown message " + std::to_string(h.seq) + " on stream " + std::to_string(s));
          break;
        }
        if (!it->second.discard) dest = it->second.req->bufs[it->second.slot] + h.offset;
      }
      bool ok = true;
      if (dest != nullptr) {
        ok = recv_full(fd, dest, h.len);
      } else {
        scratch.resize(std::min<size_t>(h.len, 1 << 16));
        for (uint64_t left = h.len; ok && left > 0;) {
          size_t n = std::min<uint64_t>(left, scratch.size());
          ok = recv_full(fd, scratch.data(), n);
          left -= n;
        }
      }
      if (!ok) {
        io_error("receive", errno);
        break;
      }
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_ || failed_) break;
      auto it = inflight_.find(h.seq);
      InFlight& m = it->second;
      m.received += h.len;
      if (m.received == m.total) {
        Request* r = m.req;
        trace([&] {
          return "received comm " + ptr_str(this) + " seq " + std::to_string(h.seq) + " req " + ptr_str(r);
        });
        inflight_.erase(it);
        if (++r->done_count == r->n) r->done = true;
      }
    }
    thread_exit();
  }

  size_t ended_ = 0;             // streams closed cleanly by the peer
  std::deque<Request*> posted_;  // receives with unmatched buffers, in post order
  std::map<uint64_t, InFlight> inflight_;
  uint64_t next_match_ = 0;
};

// A connect() in progress: the streams' sockets and how much of each hello went out.
class ConnectState {
 public:
  ConnectState(const Handle& h, int nstreams, double timeout_s)
      : deadline_(Deadline::after(timeout_s)), streams_(static_cast<size_t>(nstreams)) {
    std::memset(&to_, 0, sizeof(to_));
    if (h.family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&to_);
      a->sin6_family = AF_INET6;
      a->sin6_port = htons(h.port);
      std::memcpy(&a->sin6_addr, h.addr, 16);
      to_len_ = sizeof(sockaddr_in6);
    } else {
      auto* a = reinterpret_cast<sockaddr_in*>(&to_);
      a->sin_family = AF_INET;
      a->sin_port = htons(h.port);
      std::memcpy(&a->sin_addr, h.addr, 4);
      to_len_ = sizeof(sockaddr_in);
    }
    char buf[INET6_ADDRSTRLEN] = {};
    ::inet_ntop(h.family, h.addr, buf, sizeof(buf));
    target_ = net::HostPort{buf, h.port}.str();
    uint64_t conn_id = random_id();
    for (size_t i = 0; i < streams_.size(); ++i) {
      Hello& hello = streams_[i].hello;
      hello.magic = kHelloMagic;
      hello.version = kProtocolVersion;
      hello.stream = static_cast<uint16_t>(i);
      hello.nstreams = static_cast<uint16_t>(nstreams);
      hello.conn_id = conn_id;
      hello.listen_id = h.listen_id;
    }
  }

  // One non-blocking pass. kSuccess with *ready = true: every stream connected and greeted.
  abi::Result progress(bool* ready) {
    *ready = true;
    for (auto& st : streams_) {
      if (st.sent == sizeof(Hello)) continue;
      *ready = false;
      if (!st.fd.valid()) {
        if (Clock::now() < st.retry_at) continue;
        st.fd = Fd(::socket(to_.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
        if (!st.fd.valid()) return error("socket(): " + net::errno_string(errno));
        int rc = ::connect(st.fd.get(), reinterpret_cast<sockaddr*>(&to_), to_len_);
        st.connected = rc == 0;
        if (rc != 0 && errno != EINPROGRESS && !retry_later(st, errno))
          return error(net::errno_string(errno));
        continue;
      }
      if (!st.connected) {
        pollfd p{st.fd.get(), POLLOUT, 0};
        if (::poll(&p, 1, 0) != 1) continue;
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(st.fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0) {
          if (!retry_later(st, err)) return error(net::errno_string(err));
          continue;
        }
        st.connected = true;
      }
      const char* p = reinterpret_cast<const char*>(&st.hello) + st.sent;
      ssize_t n = ::send(st.fd.get(), p, sizeof(Hello) - st.sent, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0)
        st.sent += static_cast<size_t>(n);
      else if (n < 0 && errno != EAGAIN && errno != EINTR)
        return error("sending hello: " + net::errno_string(errno));
    }
    if (!*ready && deadline_.expired())
      return error("not connected before the deadline (RUMOR_NET_PLUGIN_TIMEOUT=" +
                   std::to_string(static_cast<int>(config().timeout_s)) + " s)");
    return abi::kSuccess;
  }

  std::vector<Fd> take_fds() {
    std::vector<Fd> out;
    for (auto& st : streams_) out.push_back(std::move(st.fd));
    return out;
  }

 private:
  struct Stream {
    Fd fd;
    bool connected = false;
    size_t sent = 0;
    Clock::time_point retry_at{};
    Hello hello{};
  };

  // A refused or reset attempt is retried (the listener may be slow to come up) until the deadline.
  bool retry_later(Stream& st, int err) {
    st.fd.reset();
    st.connected = false;
    if (err != ECONNREFUSED && err != ECONNRESET && err != ETIMEDOUT && err != EHOSTUNREACH &&
        err != ENETUNREACH)
      return false;
    st.retry_at = Clock::now() + std::chrono::milliseconds(20);
    return true;
  }

  abi::Result error(const std::string& why) {
    log(abi::kLogWarn, "NET/rumor: connect to " + target_ + ": " + why);
    return abi::kSystemError;
  }

  Deadline deadline_;
  std::vector<Stream> streams_;
  sockaddr_storage to_;
  socklen_t to_len_ = 0;
  std::string target_;
};

class ListenComm {
 public:
  ListenComm(Fd fd, uint64_t id) : fd_(std::move(fd)), id_(id) { net::set_nonblocking(fd_.get(), true); }

  abi::Result accept(void** recv_comm) {
    *recv_comm = nullptr;
    if (!deadline_) deadline_ = Deadline::after(config().timeout_s);
    while (true) {
      int c = ::accept4(fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (c < 0) break;
      incoming_.push_back({Fd(c), {}, 0});
    }
    for (auto it = incoming_.begin(); it != incoming_.end();) {
      auto* dst = reinterpret_cast<char*>(&it->hello) + it->got;
      ssize_t n = ::recv(it->fd.get(), dst, sizeof(Hello) - it->got, MSG_DONTWAIT);
      if (n > 0) it->got += static_cast<size_t>(n);
      bool closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
      if (it->got < sizeof(Hello) && !closed) {
        ++it;
        continue;
      }
      const Hello& h = it->hello;
      bool valid = !closed && h.magic == kHelloMagic && h.version == kProtocolVersion && h.listen_id == id_ &&
                   h.nstreams >= 1 && h.nstreams <= 64 && h.stream < h.nstreams;
      if (!valid) {
        log(abi::kLogWarn, "NET/rumor: dropped a connection from " + peer_name(it->fd.get()) +
                               " that did not greet as a rumor net plugin stream of this listener");
      } else {
        Group& g = groups_[h.conn_id];
        if (g.fds.empty()) g.fds.resize(h.nstreams);
        if (g.fds.size() == h.nstreams && !g.fds[h.stream].valid()) {
          g.fds[h.stream] = std::move(it->fd);
          if (++g.have == static_cast<int>(g.fds.size())) {
            auto comm = std::make_unique<RecvComm>(std::move(g.fds));
            trace([&] {
              return "accepted recv comm " + ptr_str(comm.get()) + " on listener " + ptr_str(this);
            });
            groups_.erase(h.conn_id);
            incoming_.erase(it);
            deadline_.reset();
            *recv_comm = comm.release();  // owned by NCCL until closeRecv
            return abi::kSuccess;
          }
        }
      }
      it = incoming_.erase(it);
    }
    if (deadline_->expired()) {
      log(abi::kLogWarn, "NET/rumor: accept: no complete connection within RUMOR_NET_PLUGIN_TIMEOUT=" +
                             std::to_string(static_cast<int>(config().timeout_s)) + " s");
      deadline_.reset();
      return abi::kSystemError;
    }
    return abi::kSuccess;
  }

 private:
  struct Incoming {
    Fd fd;
    Hello hello;
    size_t got;
  };
  struct Group {
    std::vector<Fd> fds;
    int have = 0;
  };
  Fd fd_;
  uint64_t id_;
  std::optional<Deadline> deadline_;  // from the first accept() call that found nothing complete
  std::deque<Incoming> incoming_;
  std::map<uint64_t, Group> groups_;
};

struct Ctx {
  uint64_t comm_id;
  int traffic_class;
};

}  // namespace

abi::Result ctx_create(void** ctx, uint64_t comm_id, const abi::CommConfig* cfg) {
  auto c = std::make_unique<Ctx>(Ctx{comm_id, cfg != nullptr ? cfg->traffic_class : -1});
  *ctx = c.release();  // NCCL hands it back to finalize()
  return abi::kSuccess;
}

abi::Result ctx_destroy(void* ctx) {
  std::unique_ptr<Ctx> owned(static_cast<Ctx*>(ctx));
  return abi::kSuccess;
}

abi::Result listen(int dev, void* handle, void** listen_comm) {
  if (dev < 0 || dev >= device_count() || handle == nullptr || listen_comm == nullptr)
    return abi::kInvalidArgument;
  const DeviceInfo& d = device(dev);
  Handle h{};
  h.magic = kHandleMagic;
  h.family = d.ip.find(':') != std::string::npos ? AF_INET6 : AF_INET;
  if (::inet_pton(h.family, d.ip.c_str(), h.addr) != 1) return abi::kInternalError;
  try {
    auto [fd, port] = net::listen_tcp(0);
    h.port = static_cast<uint16_t>(port);
    h.listen_id = random_id();
    auto comm = std::make_unique<ListenComm>(std::move(fd), h.listen_id);
    trace([&] { return "listener " + ptr_str(comm.get()) + " on " + d.ip + ":" + std::to_string(h.port); });
    std::memset(handle, 0, abi::kHandleMaxSize);
    std::memcpy(handle, &h, sizeof(h));
    *listen_comm = comm.release();  // owned by NCCL until closeListen
    return abi::kSuccess;
  } catch (const Error& e) {
    log(abi::kLogWarn, std::string("NET/rumor: listen: ") + e.what());
    return abi::kSystemError;
  }
}

abi::Result connect(int dev, void* handle, void** send_comm) {
  if (handle == nullptr || send_comm == nullptr) return abi::kInvalidArgument;
  *send_comm = nullptr;
  (void)dev;  // the route to the peer's address picks the interface
  auto* h = static_cast<Handle*>(handle);
  if (h->magic != kHandleMagic || (h->family != AF_INET && h->family != AF_INET6)) {
    log(abi::kLogWarn, "NET/rumor: connect: the handle was not made by this plugin's listen()");
    return abi::kInvalidArgument;
  }
  // The state lives in the handle between calls: adopt it here, hand it back if not done.
  std::unique_ptr<ConnectState> st(h->pending);
  h->pending = nullptr;
  if (!st) st = std::make_unique<ConnectState>(*h, config().streams, config().timeout_s);
  bool ready = false;
  abi::Result rc = st->progress(&ready);
  if (rc != abi::kSuccess) return rc;
  if (!ready) {
    h->pending = st.release();
    return abi::kSuccess;
  }
  auto comm = std::make_unique<SendComm>(st->take_fds());
  trace([&] { return "connected send comm " + ptr_str(comm.get()); });
  *send_comm = comm.release();  // owned by NCCL until closeSend
  return abi::kSuccess;
}

abi::Result accept(void* listen_comm, void** recv_comm) {
  if (listen_comm == nullptr || recv_comm == nullptr) return abi::kInvalidArgument;
  return static_cast<ListenComm*>(listen_comm)->accept(recv_comm);
}

abi::Result reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  (void)data;
  (void)size;
  if (type != abi::kPtrHost) {
    log(abi::kLogWarn,
        "NET/rumor: regMr: only host memory is supported (pointer type " + std::to_string(type) + ")");
    return abi::kInternalError;
  }
  // Plain sockets need no registration; a non-null handle keeps callers that check it happy.
  if (mhandle != nullptr) *mhandle = comm;
  return abi::kSuccess;
}

abi::Result dereg_mr(void*, void*) { return abi::kSuccess; }

abi::Result isend(void* send_comm, const void* data, size_t size, int tag, void** request) {
  if (send_comm == nullptr || request == nullptr || (data == nullptr && size > 0))
    return abi::kInvalidArgument;
  *request = static_cast<SendComm*>(send_comm)->isend(static_cast<const char*>(data), size, tag);
  return abi::kSuccess;
}

abi::Result irecv(void* recv_comm, int n, void* const* data, const size_t* sizes, const int* tags,
                  void** request) {
  if (recv_comm == nullptr || request == nullptr || n < 1 || n > kMaxRecvs || data == nullptr ||
      sizes == nullptr)
    return abi::kInvalidArgument;
  *request = static_cast<RecvComm*>(recv_comm)->irecv(n, data, sizes, tags);
  return abi::kSuccess;
}

abi::Result iflush(void* recv_comm, void** request) {
  if (recv_comm == nullptr || request == nullptr) return abi::kInvalidArgument;
  // Host memory is coherent once recv() returned: nothing to flush.
  *request = static_cast<RecvComm*>(recv_comm)->add_flush_request();
  return abi::kSuccess;
}

abi::Result test(void* request, int* done, int* sizes) {
  if (request == nullptr || done == nullptr) return abi::kInvalidArgument;
  auto* r = static_cast<Request*>(request);
  return r->comm->test(r, done, sizes);
}

abi::Result close_send(void* send_comm) {
  std::unique_ptr<SendComm> owned(static_cast<SendComm*>(send_comm));
  return abi::kSuccess;
}

abi::Result close_recv(void* recv_comm) {
  std::unique_ptr<RecvComm> owned(static_cast<RecvComm*>(recv_comm));
  return abi::kSuccess;
}

abi::Result close_listen(void* listen_comm) {
  std::unique_ptr<ListenComm> owned(static_cast<ListenComm*>(listen_comm));
  return abi::kSuccess;
}

}  // namespace rumor::netplugin
