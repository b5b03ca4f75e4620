#include "net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

namespace rumor::net {

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string errno_string(int err) { return std::string(std::strerror(err)); }

HostPort HostPort::parse(const std::string& s) {
  HostPort hp;
  auto colon = s.rfind(':');
  if (colon == std::string::npos || colon + 1 >= s.size())
    throw Error(ErrorKind::kInvalidArgument, "bad address '" + s + "': expected host:port");
  hp.host = s.substr(0, colon);
  if (hp.host.size() >= 2 && hp.host.front() == '[' && hp.host.back() == ']')
    hp.host = hp.host.substr(1, hp.host.size() - 2);
  try {
    hp.port = std::stoi(s.substr(colon + 1));
  } catch (const std::exception&) {
    throw Error(ErrorKind::kInvalidArgument, "bad port in address '" + s + "'");
  }
  return hp;
}

std::string HostPort::str() const {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

namespace {
int bound_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  return ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                  : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

// Only the named address: a host with a public and a private interface can keep the job's
// listener off the public one.
std::pair<Fd, int> listen_on_host(int port, const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string ps = std::to_string(port);
  int gai = ::getaddrinfo(host.c_str(), ps.c_str(), &hints, &res);
  if (gai != 0)
    throw Error(ErrorKind::kInvalidArgument, "listen address '" + host + "': " + ::gai_strerror(gai));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, &::freeaddrinfo);
  std::string errors;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd.valid()) continue;
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      errors += (errors.empty() ? "" : "; ") + errno_string(errno);
      continue;
    }
    if (::listen(fd.get(), 1024) != 0) throw Error(ErrorKind::kSystem, "listen(): " + errno_string(errno));
    const int bound = bound_port(fd.get());
    return {std::move(fd), bound};
  }
  throw Error(ErrorKind::kSystem,
              "bind(" + HostPort{host, port}.str() + "): " + (errors.empty() ? "no usable address" : errors));
}
}  // namespace

std::string format_address(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
    return std::string(buf) + ":" + std::to_string(ntohs(a->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    const int port = ntohs(a->sin6_port);
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) {
      ::inet_ntop(AF_INET, &a->sin6_addr.s6_addr[12], buf, sizeof(buf));
      return std::string(buf) + ":" + std::to_string(port);
    }
    ::inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf));
    // append, not operator+(const char*, string&&): GCC 12 at -O3 reports a false -Wrestrict there.
    return std::string("[").append(buf).append("]:").append(std::to_string(port));
  }
  return "<unknown address>";
}

std::pair<Fd, int> listen_tcp(int port, const std::string& host) {
  if (!host.empty()) return listen_on_host(port, host);
  Fd fd(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
  bool v6 = fd.valid();
  if (v6) {
    int off = 0;  // dual stack: accept IPv4 peers on the same socket
    ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));
  } else {
    fd = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) throw Error(ErrorKind::kSystem, "socket(): " + errno_string(errno));
  }
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc;
  if (v6) {
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a));
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a));
  }
  if (rc != 0)
    throw Error(ErrorKind::kSystem, "bind(port " + std::to_string(port) + "): " + errno_string(errno));
  if (::listen(fd.get(), 1024) != 0) throw Error(ErrorKind::kSystem, "listen(): " + errno_string(errno));
  const int bound = bound_port(fd.get());
  return {std::move(fd), bound};
}

void set_nonblocking(int fd, bool on) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  flags = on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  ::fcntl(fd, F_SETFL, flags);
}

void tune_stream_socket(int fd) {
  int one = 1;
  // Collectives send latency-sensitive small frames; Nagle would hold them back.
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

Fd connect_tcp(const HostPort& to, const Deadline& deadline, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string port = std::to_string(to.port);
  int gai = ::getaddrinfo(to.host.c_str(), port.c_str(), &hints, &res);
  if (gai != 0)
    throw Error(ErrorKind::kInvalidArgument,
                what + ": cannot resolve " + to.str() + ": " + ::gai_strerror(gai));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, &::freeaddrinfo);
  int last_err = 0;
  while (true) {
    for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
      Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
      if (!fd.valid()) continue;
      set_nonblocking(fd.get(), true);
      int rc = ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd p{fd.get(), POLLOUT, 0};
        rc = ::poll(&p, 1, deadline.ms_left(1000));
        if (rc == 1) {
          int err = 0;
          socklen_t len = sizeof(err);
          ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
          rc = err == 0 ? 0 : -1;
          errno = err;
        } else {
          rc = -1;
          errno = ETIMEDOUT;
        }
      }
      if (rc == 0) {
        set_nonblocking(fd.get(), false);
        tune_stream_socket(fd.get());
        return fd;
      }
      last_err = errno;
    }
    if (deadline.expired())
      throw Error(ErrorKind::kTimeout, what + ": could not connect to " + to.str() +
                                           " before the deadline (" + errno_string(last_err) + ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void write_all(int fd, const void* data, size_t len, const Deadline& deadline, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    pollfd pf{fd, POLLOUT, 0};
    int rc = ::poll(&pf, 1, deadline.ms_left(100));
    if (rc == 0) {
      if (deadline.expired()) throw Error(ErrorKind::kTimeout, what + ": timed out sending");
      continue;
    }
    ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      throw Error(ErrorKind::kPeerGone, what + ": send failed: " + errno_string(errno));
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
}

void read_all(int fd, void* data, size_t len, const Deadline& deadline, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (len > 0) {
    pollfd pf{fd, POLLIN, 0};
    int rc = ::poll(&pf, 1, deadline.ms_left(100));
    if (rc == 0) {
      if (deadline.expired()) throw Error(ErrorKind::kTimeout, what + ": timed out receiving");
      continue;
    }
    ssize_t n = ::recv(fd, p, len, MSG_DONTWAIT);
    if (n == 0) throw Error(ErrorKind::kPeerGone, what + ": connection closed by peer");
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      throw Error(ErrorKind::kPeerGone, what + ": recv failed: " + errno_string(errno));
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
}

}  // namespace rumor::net
