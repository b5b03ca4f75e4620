#include "net/listener.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "core/log.h"

namespace rumor::net {

namespace {

// New connections taken per poll round: between rounds the connections already pending are
// served, so a flood of new ones cannot starve a peer that is half way through its handshake.
constexpr int kAcceptBatch = 64;

// At most `per_s` refusal lines a second; the rest are counted and summarized in one line, so a
// scan or a flood cannot fill the log (or slow the thread down writing it).
class LogLimiter {
 public:
  explicit LogLimiter(int per_s) : per_s_(std::max(1, per_s)) {}
  bool allow(Clock::time_point now) {
    roll(now);
    if (lines_ < per_s_) {
      ++lines_;
      return true;
    }
    ++suppressed_;
    return false;
  }
  void roll(Clock::time_point now) {
    if (now - window_ < std::chrono::seconds(1)) return;
    // Plain strings: this may run at the fd limit too (see the EMFILE line in run()).
    if (suppressed_ > 0 && log_enabled(LogLevel::kWarn))
      log_line(LogLevel::kWarn, "listener: " + std::to_string(suppressed_) +
                                    " more refused connections in the last second not logged");
    window_ = now;
    lines_ = 0;
    suppressed_ = 0;
  }
  // When roll() has a summary to write, or never.
  Clock::time_point due() const {
    return suppressed_ > 0 ? window_ + std::chrono::seconds(1) : Clock::time_point::max();
  }

 private:
  int per_s_;
  Clock::time_point window_{};
  int lines_ = 0;
  uint64_t suppressed_ = 0;
};

bool fd_limit_error(int err) { return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM; }

}  // namespace

struct Listener::Pending {
  Fd fd;
  std::string peer;  // "host:port", for the logs
  Clock::time_point since;
  ServerHandshake hs;
};

Listener::Listener(const Key& key, uint32_t rank, uint32_t world_size, int port, const std::string& bind_host,
                   ListenerLimits limits)
    : key_(key), rank_(rank), world_size_(world_size), limits_(limits) {
  auto [fd, bound] = listen_tcp(port, bind_host);
  listen_fd_ = std::move(fd);
  port_ = bound;
  set_nonblocking(listen_fd_.get(), true);
  wake_fd_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_.valid()) throw Error(ErrorKind::kSystem, "eventfd(): " + errno_string(errno));
  thread_ = std::thread([this] { run(); });
}

Listener::~Listener() {
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_.get(), &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
}

double Listener::thread_cpu_seconds() const {
  clockid_t cid{};
  timespec ts{};
  if (::pthread_getcpuclockid(const_cast<std::thread&>(thread_).native_handle(), &cid) != 0 ||
      ::clock_gettime(cid, &ts) != 0)
    return -1.0;
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

Fd Listener::take(uint64_t comm_id, uint32_t from_rank, uint32_t stream, const Deadline& deadline) {
  std::unique_lock lk(mu_);
  StreamKey key{comm_id, from_rank, stream};
  while (true) {
    auto it = ready_.find(key);
    if (it != ready_.end()) {
      Fd fd = std::move(it->second);
      ready_.erase(it);
      return fd;
    }
    cv_.wait_until(lk, deadline.wake_by());
    if (ready_.count(key)) continue;
    if (deadline.cancelled())
      throw Error(ErrorKind::kAborted, "connection setup: waiting for rank " + std::to_string(from_rank) +
                                           " to connect (comm " + std::to_string(comm_id) + ", stream " +
                                           std::to_string(stream) + "): the operation was aborted");
    if (deadline.expired())
      throw Error(ErrorKind::kTimeout, "connection setup: rank " + std::to_string(from_rank) +
                                           " did not connect (comm " + std::to_string(comm_id) + ", stream " +
                                           std::to_string(stream) + ") before the deadline");
  }
}

Listener::Step Listener::progress(Pending& p, std::string* why) {
  try {
    while (true) {
      while (!p.hs.output().empty()) {
        auto out = p.hs.output();
        ssize_t n = ::send(p.fd.get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
          p.hs.sent(static_cast<size_t>(n));
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
          return Step::kKeep;
        } else if (n < 0 && errno == EINTR) {
          continue;
        } else {
          *why = "send failed during the handshake: " + errno_string(errno);
          return Step::kDrop;
        }
      }
      switch (p.hs.state()) {
        case ServerHandshake::State::kFailed:
          *why = p.hs.error();
          return Step::kDrop;
        case ServerHandshake::State::kAccepted:
          return Step::kDone;
        case ServerHandshake::State::kAuthenticated: {
          const Hello& h = p.hs.hello();
          StreamKey key{h.comm_id, h.rank, h.stream};
          auto it = claimed_.find(key);
          if (it != claimed_.end()) {
            p.hs.fail("proved the key but claims comm " + std::to_string(h.comm_id) + " rank " +
                      std::to_string(h.rank) + " stream " + std::to_string(h.stream) + ", which " +
                      it->second + " already holds (the first stream stays)");
          } else {
            claimed_.emplace(key, p.peer);
            p.hs.accept();
          }
          continue;
        }
        default:
          break;
      }
      uint8_t buf[kHelloBytes];
      const size_t want = std::min(sizeof(buf), p.hs.wanted());
      ssize_t n = ::recv(p.fd.get(), buf, want, MSG_DONTWAIT);
      if (n > 0) {
        p.hs.feed({buf, static_cast<size_t>(n)});
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Step::kKeep;
      if (n < 0 && errno == EINTR) continue;
      *why = n == 0 ? (p.hs.state() == ServerHandshake::State::kHello
                           ? "closed before completing its hello"
                           : "closed after its hello, without a proof")
                    : "recv failed during the handshake: " + errno_string(errno);
      return Step::kDrop;
    }
  } catch (const Error& e) {
    *why = e.what();
    return Step::kDrop;
  }
}

void Listener::run() {
  // Named so that an operator (top -H) or a test can tell the listener from the ranks' threads.
  ::pthread_setname_np(::pthread_self(), "rumor-listen");
  std::vector<Pending> pending;
  LogLimiter log(limits_.log_lines_per_s);
  Clock::time_point backoff_until{};

  auto refuse = [&](Pending& p, const std::string& why, Clock::time_point now) {
    // A claim that proved the key and then failed (its Accept could not be sent) was never a stream.
    if (p.hs.state() == ServerHandshake::State::kAccepted) {
      const Hello& h = p.hs.hello();
      claimed_.erase(StreamKey{h.comm_id, h.rank, h.stream});
    }
    rejected_.fetch_add(1);  // before the close: tests wait for the close, then read the count
    if (log.allow(now))
      RUMOR_LOG(kWarn,
                "listener of rank " << rank_ << ": refused a connection from " << p.peer << ": " << why);
  };

  while (true) {
    auto now = Clock::now();
    const bool backing_off = now < backoff_until;
    std::vector<pollfd> fds;
    fds.reserve(pending.size() + 2);
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    fds.push_back({backing_off ? -1 : listen_fd_.get(), POLLIN, 0});  // poll() skips a negative fd
    for (auto& p : pending) {
      short ev = 0;
      if (p.hs.wanted() > 0) ev |= POLLIN;
      if (!p.hs.output().empty()) ev |= POLLOUT;
      fds.push_back({p.fd.get(), ev, 0});
    }
    auto wake_at = now + std::chrono::milliseconds(500);
    if (!pending.empty()) wake_at = std::min(wake_at, pending.front().since + limits_.handshake_timeout);
    if (backing_off) wake_at = std::min(wake_at, backoff_until);
    wake_at = std::min(wake_at, log.due());
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(wake_at - now).count();
    int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::clamp<int64_t>(ms, 0, 500)));
    if (rc < 0 && errno != EINTR) {
      RUMOR_LOG(kError, "listener: poll failed: " << errno_string(errno));
      return;
    }
    if (rc > 0 && fds[0].revents != 0) return;
    now = Clock::now();

    // Connections already pending first, with what poll saw for each.
    std::vector<Pending> keep;
    keep.reserve(pending.size() + kAcceptBatch);
    auto settle = [&](Pending& p) {
      std::string why;
      Step s = progress(p, &why);
      if (s == Step::kKeep && now - p.since > limits_.handshake_timeout) {
        s = Step::kDrop;
        why = "handshake not completed within " + std::to_string(limits_.handshake_timeout.count()) + " ms";
      }
      if (s == Step::kDrop) {
        refuse(p, why, now);
        return;  // the Fd closes here
      }
      if (s == Step::kDone) {
        const Hello& h = p.hs.hello();
        set_nonblocking(p.fd.get(), false);
        tune_stream_socket(p.fd.get());
        std::lock_guard lk(mu_);
        ready_[StreamKey{h.comm_id, h.rank, h.stream}] = std::move(p.fd);
        cv_.notify_all();
        return;
      }
      keep.push_back(std::move(p));
    };
    for (size_t i = 0; i < pending.size(); ++i) {
      if (rc > 0 && fds[i + 2].revents == 0 && now - pending[i].since <= limits_.handshake_timeout) {
        keep.push_back(std::move(pending[i]));
        continue;
      }
      settle(pending[i]);
    }
    pending = std::move(keep);
    keep.clear();

    if (!backing_off && rc > 0 && (fds[1].revents & POLLIN)) {
      for (int i = 0; i < kAcceptBatch; ++i) {
        sockaddr_storage ss{};
        socklen_t len = sizeof(ss);
        int c =
            ::accept4(listen_fd_.get(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0) {
          const int err = errno;
          if (err == EAGAIN || err == EWOULDBLOCK) break;
          if (fd_limit_error(err)) {
            // The connection stays in the backlog; polling the listening socket again at once
            // would only spin until an fd is free.
            backoff_until = now + limits_.accept_backoff;
            backoffs_.fetch_add(1);
            // Plain strings, not RUMOR_LOG's ostringstream: with no descriptor left, UBSan's vptr
            // check of the stream cannot load what it needs and reports a false error.
            if (log.allow(now) && log_enabled(LogLevel::kWarn))
              log_line(LogLevel::kWarn, "listener of rank " + std::to_string(rank_) +
                                            ": cannot accept connections: " + errno_string(err) +
                                            "; pausing accepts for " +
                                            std::to_string(limits_.accept_backoff.count()) + " ms");
            break;
          }
          continue;  // ECONNABORTED, EPROTO, EPERM, EINTR...: that connection alone is gone
        }
        Fd fd(c);
        const std::string peer = format_address(ss);
        Nonce nonce{};
        try {
          nonce = random_nonce();
        } catch (const Error& e) {
          rejected_.fetch_add(1);
          if (log.allow(now))
            RUMOR_LOG(kWarn, "listener of rank " << rank_ << ": refused " << peer << ": " << e.what());
          continue;
        }
        if (pending.size() >= limits_.max_pending) {
          Pending& old = pending.front();
          // Best effort: a real peer that sees it dials again; a stranger learns nothing new.
          [[maybe_unused]] ssize_t n =
              ::send(old.fd.get(), kBusy, sizeof(kBusy), MSG_NOSIGNAL | MSG_DONTWAIT);
          refuse(old,
                 "dropped: " + std::to_string(limits_.max_pending) +
                     " connections were still in their handshake (the oldest goes)",
                 now);
          pending.erase(pending.begin());
        }
        Pending p{std::move(fd), peer, now, ServerHandshake(key_, rank_, world_size_, nonce)};
        settle(p);  // its hello is usually there already
        for (auto& k : keep) pending.push_back(std::move(k));
        keep.clear();
      }
    }
    pending_count_.store(pending.size());
    log.roll(Clock::now());
  }
}

}  // namespace rumor::net
