// Connections of the NCCL net plugin: listen / connect / accept, the send and receive comms with
// their stream threads, requests and test().
//
// Threads: each stream of a comm has one thread doing blocking I/O on its socket (a sender thread
// sleeps on the comm's condition variable until a chunk is queued; a receiver thread sleeps in
// recv()), and each send comm has one watcher thread blocked in poll() that notices the peer
// closing. Nothing spins while idle; every lock is the comm's own.
//
// TLS (RUMOR_NET_PLUGIN_TLS=1): each stream runs a TlsSession (the connector is the client), its
// handshake done by the stream's own thread before its first chunk, with blocking I/O like the
// rest of that thread; chunks are sealed and opened through it. connect() and accept() are
// unchanged: the HMAC proof comes first, as for rumor's channels.
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
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/types.h"
#include "net/socket.h"
#include "net/tls.h"
#include "netplugin/plugin.h"
#include "netplugin/wire.h"

namespace rumor::netplugin {
namespace {

using net::Fd;

using wire::ChunkHeader;
using wire::Hello;
using wire::kChunkMagic;

class ConnectState;

// What listen() writes into NCCL's 128-byte handle. `pending` is only ever set in the connecting
// process's copy: NCCL passes the same handle memory to every connect() retry.
struct Handle {
  uint32_t magic;
  uint16_t family;  // AF_INET or AF_INET6
  uint16_t port;    // host order
  uint8_t addr[16];
  wire::Id listen_id;  // 128 random bits: a stray connection to a reused port is refused
  ConnectState* pending;
};
static_assert(sizeof(Handle) <= abi::kHandleMaxSize);

// Accepted sockets still in their handshake, per listener: the oldest is dropped beyond this.
constexpr size_t kMaxPendingConnections = 128;
// Connections with some but not all streams in, per listener.
constexpr size_t kMaxPendingGroups = 128;

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

// Ids and nonces come from the kernel's CSPRNG: a listen id must not be guessable from others.
template <typename T>
T random_value() {
  T v{};
  if (!wire::random_bytes(&v, sizeof(v)))
    throw Error(ErrorKind::kSystem, "getrandom: " + net::errno_string(errno));
  return v;
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
  CommBase(std::vector<Fd> fds, std::string what, net::TlsRole role)
      : fds_(std::move(fds)), what_(std::move(what)) {
    for (auto& fd : fds_) {
      net::set_nonblocking(fd.get(), false);
      net::tune_stream_socket(fd.get());
    }
    peer_ = peer_name(fds_.at(0).get());
    if (auto ctx = tls_context()) {
      streams_tls_.resize(fds_.size());
      for (size_t s = 0; s < fds_.size(); ++s) {
        streams_tls_[s].session =
            std::make_unique<net::TlsSession>(ctx, role, peer_ + " stream " + std::to_string(s));
      }
    }
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
  // `news`: a warning even with no work lost (a TLS refusal or integrity failure).
  void fail(abi::Result code, const std::string& why, bool news = false) {
    if (failed_ || stop_) return;
    failed_ = true;
    error_code_ = code;
    for (auto& fd : fds_) ::shutdown(fd.get(), SHUT_RDWR);
    cv_.notify_all();
    on_fail();
    bool pending = false;
    for (auto& [p, r] : requests_) pending |= !r->done;
    // A peer closing an idle connection is how NCCL tears down; only lost work is a warning.
    log(pending || news ? abi::kLogWarn : abi::kLogInfo,
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

  // ---- stream I/O, over TLS when it is on; called by stream s's thread only ----
  // False on EOF or error, errno kept (0 for EOF, EPROTO for a TLS failure: see io_why).

  // Stream s's TLS handshake, before its first chunk (true at once when TLS is off).
  bool start_stream(size_t s) {
    if (streams_tls_.empty()) return true;
    try {
      net::tls_handshake(fds_[s].get(), *streams_tls_[s].session, Deadline::after(config().timeout_s));
      streams_shaken_.fetch_add(1);
      return true;
    } catch (const Error& e) {
      return tls_failed(s, e);
    }
  }

  bool read_full(size_t s, void* data, size_t len, size_t* got = nullptr) {
    if (streams_tls_.empty()) return recv_full(fds_[s].get(), data, len, got);
    StreamTls& t = streams_tls_[s];
    char* p = static_cast<char*>(data);
    if (got != nullptr) *got = 0;
    if (t.rx.empty()) t.rx.resize(kTlsReadBytes);
    while (len > 0) {
      size_t n = 0;
      try {
        n = t.session->read({reinterpret_cast<uint8_t*>(p), len});
      } catch (const Error& e) {
        return tls_failed(s, e);
      }
      if (n > 0) {
        p += n;
        len -= n;
        if (got != nullptr) *got += n;
        continue;
      }
      if (t.session->peer_closed()) {
        errno = 0;
        return false;
      }
      const ssize_t r = ::recv(fds_[s].get(), t.rx.data(), t.rx.size(), 0);
      if (r == 0) errno = 0;
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      t.session->feed({t.rx.data(), static_cast<size_t>(r)});
    }
    return true;
  }

  bool write_chunk(size_t s, const ChunkHeader& h, const char* payload) {
    if (streams_tls_.empty()) return send_chunk(fds_[s].get(), h, payload);
    net::TlsSession& t = *streams_tls_[s].session;
    try {
      // Sealed a piece at a time: a 16 MiB chunk never sits whole in the session as ciphertext.
      t.write({reinterpret_cast<const uint8_t*>(&h), sizeof(h)});
      size_t off = 0;
      do {
        const size_t n = std::min<size_t>(kTlsSealBytes, h.len - off);
        if (n > 0) t.write({reinterpret_cast<const uint8_t*>(payload) + off, n});
        off += n;
        while (t.pending_out() > 0) {
          auto out = t.peek_out();
          const ssize_t sent = ::send(fds_[s].get(), out.data(), out.size(), MSG_NOSIGNAL);
          if (sent < 0 && errno == EINTR) continue;
          if (sent < 0) return false;
          t.consume_out(static_cast<size_t>(sent));
        }
      } while (off < h.len);
    } catch (const Error& e) {
      return tls_failed(s, e);
    }
    return true;
  }

  // What failed on stream s, for an error: the TLS failure if that was it, else errno's words.
  std::string io_why(size_t s, int err) const {
    if (err == EPROTO && !streams_tls_.empty() && !streams_tls_[s].failure.empty())
      return streams_tls_[s].failure;
    return describe_errno(err);
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

 private:
  static constexpr size_t kTlsReadBytes = 256 * 1024;
  static constexpr size_t kTlsSealBytes = 256 * 1024;
  struct StreamTls {
    std::unique_ptr<net::TlsSession> session;
    std::vector<uint8_t> rx;  // ciphertext read, before the session takes it
    std::string failure;      // the TLS error that failed the stream
  };

  bool tls_failed(size_t s, const Error& e) {
    StreamTls& t = streams_tls_[s];
    // A failed session may hold an alert that tells the peer why; it goes if the socket takes it now.
    if (t.session->pending_out() > 0) {
      auto out = t.session->peek_out();
      [[maybe_unused]] ssize_t n = ::send(fds_[s].get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    t.failure = e.what();
    errno = EPROTO;
    return false;
  }

  std::vector<StreamTls> streams_tls_;  // one per stream with TLS on; empty when off

 protected:
  // Streams whose TLS handshake completed (the watcher reads it: a close before that is news).
  std::atomic<size_t> streams_shaken_{0};
};

class SendComm : public CommBase {
 public:
  explicit SendComm(std::vector<Fd> fds)
      : CommBase(std::move(fds), "send connection", net::TlsRole::kClient), chunk_(config().chunk) {
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
    if (!start_stream(s)) {
      const int err = errno;
      {
        std::lock_guard<std::mutex> lk(mu_);
        fail(abi::kRemoteError, "TLS on stream " + std::to_string(s) + ": " + io_why(s, err), true);
      }
      thread_exit();
      return;
    }
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
      bool ok = write_chunk(s, h, payload);
      int err = errno;
      std::lock_guard<std::mutex> lk(mu_);
      if (!ok) {
        fail(err == EPIPE || err == ECONNRESET || err == EPROTO ? abi::kRemoteError : abi::kSystemError,
             "send on stream " + std::to_string(s) + ": " + io_why(s, err), err == EPROTO);
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
          const bool in_handshake = tls_context() && streams_shaken_.load() < fds_.size();
          fail(abi::kRemoteError,
               "peer closed stream " + std::to_string(i) +
                   (in_handshake
                        ? " during the TLS handshakes: it refused this end's certificate, or it has TLS off "
                          "(RUMOR_NET_PLUGIN_TLS must be set on both sides)"
                        : " (process exited?)"),
               in_handshake);
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
  explicit RecvComm(std::vector<Fd> fds)
      : CommBase(std::move(fds), "receive connection", net::TlsRole::kServer) {
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
    wire::MessageBook book;
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
        inflight_.emplace(h.seq, InFlight{r, i, wire::MessageBook{h.total, h.tag, 0, 0}, discard});
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
    std::vector<char> scratch;  // drain buffer for truncated messages
    auto io_error = [&](const std::string& what, int err) {
      std::lock_guard<std::mutex> lk(mu_);
      fail(err == 0 || err == ECONNRESET || err == EPROTO ? abi::kRemoteError : abi::kSystemError,
           what + " on stream " + std::to_string(s) + ": " + io_why(s, err), err == EPROTO);
    };
    if (!start_stream(s)) {
      io_error("TLS", errno);
      thread_exit();
      return;
    }
    while (true) {
      ChunkHeader h{};
      size_t got = 0;
      if (!read_full(s, &h, sizeof(h), &got)) {
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
      // Every number in the header comes from the peer: checked before any is used.
      if (std::string bad = wire::check_chunk(h); !bad.empty()) {
        std::lock_guard<std::mutex> lk(mu_);
        fail(abi::kSystemError, "corrupt chunk header on stream " + std::to_string(s) + ": " + bad);
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
        if (it == inflight_.end()) {
          fail(abi::kSystemError, "chunk of message " + std::to_string(h.seq) +
                                      ", which is not in flight (completed or never matched), on stream " +
                                      std::to_string(s));
          break;
        }
        // Reserves the chunk's bytes now, before its payload is read: a duplicate of a chunk
        // still arriving on another stream is refused here instead of completing the message twice.
        if (std::string bad = wire::admit_chunk(it->second.book, h); !bad.empty()) {
          fail(abi::kSystemError, bad + " on stream " + std::to_string(s));
          break;
        }
        if (!it->second.discard) dest = it->second.req->bufs[it->second.slot] + h.offset;
      }
      bool ok = true;
      if (dest != nullptr) {
        ok = read_full(s, dest, h.len);
      } else {
        scratch.resize(std::min<size_t>(h.len, 1 << 16));
        for (uint64_t left = h.len; ok && left > 0;) {
          size_t n = std::min<uint64_t>(left, scratch.size());
          ok = read_full(s, scratch.data(), n);
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
      if (it == inflight_.end()) {
        // Cannot happen while admit_chunk() holds the message open for this chunk's reserved
        // bytes; kept as an error, never a dereference of end().
        fail(abi::kSystemError, "message " + std::to_string(h.seq) + " vanished while stream " +
                                    std::to_string(s) + " received a chunk of it");
        break;
      }
      InFlight& m = it->second;
      m.book.received += h.len;
      if (m.book.received == m.book.total) {
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

// Non-blocking partial transfers of a handshake message: move what the socket takes now.
// False on an error or EOF (*err = errno, 0 for EOF); *done counts the bytes moved so far.
bool send_some(int fd, const void* msg, size_t size, size_t* done, int* err) {
  while (*done < size) {
    ssize_t n = ::send(fd, static_cast<const char*>(msg) + *done, size - *done, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      *done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    *err = n < 0 ? errno : 0;
    return false;
  }
  return true;
}

bool recv_some(int fd, void* msg, size_t size, size_t* done, int* err) {
  while (*done < size) {
    ssize_t n = ::recv(fd, static_cast<char*>(msg) + *done, size - *done, MSG_DONTWAIT);
    if (n > 0) {
      *done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    *err = n < 0 ? errno : 0;
    return false;
  }
  return true;
}

const wire::Mac kNoMac{};

// A connect() in progress: the streams' sockets and where each stream's handshake stands.
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
    const auto conn_id = random_value<uint64_t>();
    for (size_t i = 0; i < streams_.size(); ++i) {
      Hello& hello = streams_[i].hello;
      hello.magic = wire::kHelloMagic;
      hello.version = wire::kProtocolVersion;
      hello.stream = static_cast<uint16_t>(i);
      hello.nstreams = static_cast<uint16_t>(nstreams);
      hello.flags = auth_key() != nullptr ? wire::kFlagAuth : 0;
      hello.conn_id = conn_id;
      hello.listen_id = h.listen_id;
      hello.nonce = random_value<wire::Nonce>();
    }
  }

  // One non-blocking pass. kSuccess with *ready = true: every stream connected and authenticated.
  abi::Result progress(bool* ready) {
    *ready = true;
    for (auto& st : streams_) {
      if (st.proof_sent == sizeof(wire::Proof)) continue;
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
      int err = 0;
      if (!send_some(st.fd.get(), &st.hello, sizeof(Hello), &st.hello_sent, &err))
        return error("sending hello: " + describe_errno(err));
      if (st.hello_sent < sizeof(Hello)) continue;
      if (!recv_some(st.fd.get(), &st.challenge, sizeof(wire::Challenge), &st.challenge_got, &err))
        return error("waiting for the listener's challenge: " + describe_errno(err) +
                     (err == 0 ? " (the listener refused this connection: is RUMOR_JOB_SECRET the same "
                                 "on both sides, and set on both or neither?)"
                               : ""));
      if (st.challenge_got < sizeof(wire::Challenge)) continue;
      if (!st.proof_ready) {
        if (abi::Result rc = answer(st); rc != abi::kSuccess) return rc;
      }
      if (!send_some(st.fd.get(), &st.proof, sizeof(wire::Proof), &st.proof_sent, &err))
        return error("sending proof: " + describe_errno(err));
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
    Clock::time_point retry_at{};
    Hello hello{};
    size_t hello_sent = 0;
    wire::Challenge challenge{};
    size_t challenge_got = 0;
    bool proof_ready = false;
    wire::Proof proof{};
    size_t proof_sent = 0;
  };

  // The listener's challenge arrived: check that it proved the key (before anything of ours goes
  // to a listener that could not), then prepare our proof.
  abi::Result answer(Stream& st) {
    const wire::Key* key = auth_key();
    const wire::Challenge& c = st.challenge;
    if (c.magic != wire::kChallengeMagic) return error("the listener's challenge is malformed");
    const bool peer_auth = (c.flags & wire::kFlagAuth) != 0;
    if (key != nullptr && !peer_auth)
      return error(
          "the listener runs without a job secret while this process has one (RUMOR_JOB_SECRET "
          "must be set on both sides or neither)");
    if (key == nullptr && peer_auth)
      return error(
          "the listener requires a job secret (RUMOR_JOB_SECRET or RUMOR_JOB_SECRET_FILE) that this "
          "process does not have");
    st.proof.magic = wire::kProofMagic;
    st.proof.mac = kNoMac;
    if (key != nullptr) {
      if (!wire::mac_equal(c.mac, wire::hello_mac(*key, 'A', st.hello, c.nonce)))
        return error(
            "the listener did not prove the job key (RUMOR_JOB_SECRET differs between the two sides?)");
      st.proof.mac = wire::hello_mac(*key, 'C', st.hello, c.nonce);
    }
    st.proof_ready = true;
    return abi::kSuccess;
  }

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
  ListenComm(Fd fd, const wire::Id& id) : fd_(std::move(fd)), id_(id) {
    net::set_nonblocking(fd_.get(), true);
  }

  abi::Result accept(void** recv_comm) {
    *recv_comm = nullptr;
    if (!deadline_) deadline_ = Deadline::after(config().timeout_s);
    const auto now = Clock::now();
    const auto hello_limit =
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(config().hello_timeout_s));
    size_t evicted = 0;
    while (true) {
      int c = ::accept4(fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (c < 0) break;
      Incoming in;
      in.fd = Fd(c);
      in.peer = peer_name(c);
      in.expires = now + hello_limit;
      incoming_.push_back(std::move(in));
      // A flood of connections that never greet must not grow this without bound.
      if (incoming_.size() > kMaxPendingConnections) {
        incoming_.pop_front();
        ++evicted;
      }
    }
    if (evicted > 0)
      log(abi::kLogWarn, "NET/rumor: listener " + ptr_str(this) + " dropped " + std::to_string(evicted) +
                             " connection(s) still in their handshake: more than " +
                             std::to_string(kMaxPendingConnections) + " were pending");
    for (auto it = incoming_.begin(); it != incoming_.end();) {
      std::string why;
      Step step = advance(*it, &why);
      if (step == Step::kWaiting && now >= it->expires) {
        step = Step::kDrop;
        why = "did not complete its handshake within " +
              std::to_string(static_cast<int>(config().hello_timeout_s)) +
              " s (RUMOR_NET_PLUGIN_HELLO_TIMEOUT)";
      }
      if (step == Step::kWaiting) {
        ++it;
        continue;
      }
      if (step == Step::kDrop) {
        log(abi::kLogWarn, "NET/rumor: dropped a connection from " + it->peer + ": " + why);
        it = incoming_.erase(it);
        continue;
      }
      const Hello h = it->hello;
      Group& g = groups_[h.conn_id];
      if (g.fds.empty()) {
        g.fds.resize(h.nstreams);
        g.expires = now + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(config().timeout_s));
      }
      if (g.fds.size() == h.nstreams && !g.fds[h.stream].valid()) {
        g.fds[h.stream] = std::move(it->fd);
        if (++g.have == static_cast<int>(g.fds.size())) {
          auto comm = std::make_unique<RecvComm>(std::move(g.fds));
          trace(
              [&] { return "accepted recv comm " + ptr_str(comm.get()) + " on listener " + ptr_str(this); });
          groups_.erase(h.conn_id);
          incoming_.erase(it);
          deadline_.reset();
          *recv_comm = comm.release();  // owned by NCCL until closeRecv
          return abi::kSuccess;
        }
      } else {
        log(abi::kLogWarn, "NET/rumor: dropped a connection from " + it->peer + ": stream " +
                               std::to_string(h.stream) + " of " + std::to_string(h.nstreams) +
                               " does not fit its connection's other streams");
      }
      it = incoming_.erase(it);
    }
    expire_groups(now);
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
    std::string peer;
    Clock::time_point expires;  // the whole handshake must be done by then
    Hello hello{};
    size_t hello_got = 0;
    bool challenged = false;
    wire::Challenge challenge{};
    size_t challenge_sent = 0;
    wire::Proof proof{};
    size_t proof_got = 0;
  };
  struct Group {
    std::vector<Fd> fds;
    int have = 0;
    Clock::time_point expires;
  };
  enum class Step { kWaiting, kDone, kDrop };

  // Moves one accepted socket's handshake on as far as its peer has gone, without blocking.
  Step advance(Incoming& in, std::string* why) {
    const wire::Key* key = auth_key();
    int err = 0;
    if (!recv_some(in.fd.get(), &in.hello, sizeof(Hello), &in.hello_got, &err)) {
      *why = "closed before it greeted as a rumor net plugin stream (" + describe_errno(err) + ")";
      return Step::kDrop;
    }
    if (in.hello_got < sizeof(Hello)) return Step::kWaiting;
    if (!in.challenged) {
      if (std::string bad = wire::check_hello(in.hello, id_); !bad.empty()) {
        *why = "it did not greet as a rumor net plugin stream of this listener: " + bad;
        return Step::kDrop;
      }
      const bool peer_auth = (in.hello.flags & wire::kFlagAuth) != 0;
      if (key != nullptr && !peer_auth) {
        *why = "it does not authenticate, and this listener requires the job secret (RUMOR_JOB_SECRET)";
        return Step::kDrop;
      }
      // The connector refuses a listener without a secret itself (it reads the flags), with a
      // clearer message than a closed socket would give it.
      in.challenge.magic = wire::kChallengeMagic;
      in.challenge.flags = key != nullptr ? wire::kFlagAuth : 0;
      in.challenge.nonce = random_value<wire::Nonce>();
      in.challenge.mac = key != nullptr ? wire::hello_mac(*key, 'A', in.hello, in.challenge.nonce) : kNoMac;
      in.challenged = true;
    }
    if (!send_some(in.fd.get(), &in.challenge, sizeof(wire::Challenge), &in.challenge_sent, &err)) {
      *why = "sending the challenge: " + describe_errno(err);
      return Step::kDrop;
    }
    if (in.challenge_sent < sizeof(wire::Challenge)) return Step::kWaiting;
    if (!recv_some(in.fd.get(), &in.proof, sizeof(wire::Proof), &in.proof_got, &err)) {
      *why = "closed during the handshake (" + describe_errno(err) +
             "): it did not accept this listener's proof (RUMOR_JOB_SECRET differs?)";
      return Step::kDrop;
    }
    if (in.proof_got < sizeof(wire::Proof)) return Step::kWaiting;
    if (in.proof.magic != wire::kProofMagic) {
      *why = "its proof is malformed";
      return Step::kDrop;
    }
    if (key != nullptr &&
        !wire::mac_equal(in.proof.mac, wire::hello_mac(*key, 'C', in.hello, in.challenge.nonce))) {
      *why = "it did not prove the job key (RUMOR_JOB_SECRET differs between the two sides?)";
      return Step::kDrop;
    }
    return Step::kDone;
  }

  // Connections whose other streams never came (or a flood of partial ones) are dropped too.
  void expire_groups(Clock::time_point now) {
    for (auto it = groups_.begin(); it != groups_.end();) {
      if (now >= it->second.expires) {
        log(abi::kLogWarn, "NET/rumor: dropped a connection with " + std::to_string(it->second.have) +
                               " of " + std::to_string(it->second.fds.size()) +
                               " streams: the others did not arrive within RUMOR_NET_PLUGIN_TIMEOUT");
        it = groups_.erase(it);
      } else {
        ++it;
      }
    }
    while (groups_.size() > kMaxPendingGroups) {
      auto oldest = groups_.begin();
      for (auto it = groups_.begin(); it != groups_.end(); ++it)
        if (it->second.expires < oldest->second.expires) oldest = it;
      log(abi::kLogWarn, "NET/rumor: dropped a partly connected connection: more than " +
                             std::to_string(kMaxPendingGroups) + " were pending");
      groups_.erase(oldest);
    }
  }

  Fd fd_;
  wire::Id id_;
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
  h.magic = wire::kHandleMagic;
  h.family = d.ip.find(':') != std::string::npos ? AF_INET6 : AF_INET;
  if (::inet_pton(h.family, d.ip.c_str(), h.addr) != 1) return abi::kInternalError;
  try {
    auto [fd, port] = net::listen_tcp(0);
    h.port = static_cast<uint16_t>(port);
    h.listen_id = random_value<wire::Id>();
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
  if (h->magic != wire::kHandleMagic || (h->family != AF_INET && h->family != AF_INET6)) {
    log(abi::kLogWarn, "NET/rumor: connect: the handle was not made by this plugin's listen()");
    return abi::kInvalidArgument;
  }
  // The state lives in the handle between calls: adopt it here, hand it back if not done.
  std::unique_ptr<ConnectState> st(h->pending);
  h->pending = nullptr;
  bool ready = false;
  abi::Result rc = abi::kSuccess;
  try {  // nothing may throw into NCCL
    if (!st) st = std::make_unique<ConnectState>(*h, config().streams, config().timeout_s);
    rc = st->progress(&ready);
  } catch (const Error& e) {
    log(abi::kLogWarn, std::string("NET/rumor: connect: ") + e.what());
    return abi::kSystemError;
  }
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
  try {  // nothing may throw into NCCL
    return static_cast<ListenComm*>(listen_comm)->accept(recv_comm);
  } catch (const Error& e) {
    log(abi::kLogWarn, std::string("NET/rumor: accept: ") + e.what());
    return abi::kSystemError;
  }
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
