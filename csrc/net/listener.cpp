#include "net/listener.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "core/log.h"

namespace rumor::net {

namespace {
// A client that has not completed its Hello by then is dropped, so a stalled or hostile
// connection cannot hold a slot forever.
constexpr auto kHelloTimeout = std::chrono::seconds(10);

struct Pending {
  Fd fd;
  Hello hello{};
  size_t got = 0;
  Clock::time_point since;
};
}  // namespace

Listener::Listener(const Token& token, uint32_t world_size, int port)
    : token_(token), world_size_(world_size) {
  auto [fd, bound] = listen_tcp(port);
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

Fd Listener::take(uint64_t comm_id, uint32_t from_rank, uint32_t stream, const Deadline& deadline) {
  std::unique_lock lk(mu_);
  Key key{comm_id, from_rank, stream};
  while (true) {
    auto it = ready_.find(key);
    if (it != ready_.end()) {
      Fd fd = std::move(it->second);
      ready_.erase(it);
      return fd;
    }
    if (cv_.wait_until(lk, deadline.at()) == std::cv_status::timeout && !ready_.count(key))
      throw Error(ErrorKind::kTimeout, "connection setup: rank " + std::to_string(from_rank) +
                                           " did not connect (comm " + std::to_string(comm_id) + ", stream " +
                                           std::to_string(stream) + ") before the deadline");
  }
}

void Listener::run() {
  std::vector<Pending> pending;
  while (true) {
    std::vector<pollfd> fds;
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    fds.push_back({listen_fd_.get(), POLLIN, 0});
    for (auto& p : pending) fds.push_back({p.fd.get(), POLLIN, 0});
    int rc = ::poll(fds.data(), fds.size(), 500);
    if (rc < 0 && errno != EINTR) {
      RUMOR_LOG(kError, "listener: poll failed: " << errno_string(errno));
      return;
    }
    if (fds[0].revents != 0) return;
    const size_t polled = pending.size();  // connections accepted below were not polled yet
    if (fds[1].revents & POLLIN) {
      while (true) {
        int c = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0) break;
        pending.push_back(Pending{Fd(c), {}, 0, Clock::now()});
      }
    }
    auto now = Clock::now();
    std::vector<Pending> keep;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      short rev = i < polled ? fds[i + 2].revents : POLLIN;
      bool drop = false;
      std::string why;
      if (rev != 0) {
        ssize_t n = ::recv(p.fd.get(), reinterpret_cast<char*>(&p.hello) + p.got, sizeof(Hello) - p.got,
                           MSG_DONTWAIT);
        if (n > 0) {
          p.got += static_cast<size_t>(n);
          // Reject garbage as soon as the magic is visible, before waiting for the rest.
          size_t check = std::min<size_t>(p.got, 8);
          if (std::memcmp(p.hello.magic, kHelloMagic, check) != 0) {
            drop = true;
            why = "bad magic (not a rumor peer)";
          }
        } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
          drop = true;
          why = "closed before completing the handshake";
        }
      }
      if (!drop && p.got == sizeof(Hello)) {
        const Hello& h = p.hello;
        if (h.version != kProtocolVersion) {
          why = "protocol version " + std::to_string(h.version) + ", expected " +
                std::to_string(kProtocolVersion);
        } else if (std::memcmp(h.token, token_.data(), kTokenBytes) != 0) {
          why = "wrong job token";
        } else if (h.rank >= world_size_) {
          why = "rank " + std::to_string(h.rank) + " out of range";
        }
        if (why.empty()) {
          set_nonblocking(p.fd.get(), false);
          try {
            write_all(p.fd.get(), kAccept, sizeof(kAccept), Deadline::after(5.0), "handshake ack");
          } catch (const Error& e) {
            why = e.what();
          }
        }
        if (why.empty()) {
          tune_stream_socket(p.fd.get());
          std::lock_guard lk(mu_);
          ready_[Key{h.comm_id, h.rank, h.stream}] = std::move(p.fd);
          cv_.notify_all();
          continue;
        }
        drop = true;
      }
      if (!drop && now - p.since > kHelloTimeout) {
        drop = true;
        why = "handshake not completed within 10 s";
      }
      if (drop) {
        rejected_.fetch_add(1);
        RUMOR_LOG(kWarn, "listener: rejected a connection: " << why);
        continue;  // Fd closes here
      }
      keep.push_back(std::move(p));
    }
    pending = std::move(keep);
  }
}

}  // namespace rumor::net
