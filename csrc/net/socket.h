// RAII file descriptors and the few blocking socket helpers used during connection setup.
// The data path uses non-blocking sockets driven by comm/exchange.cpp instead.
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "core/types.h"

namespace rumor::net {

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset();

 private:
  int fd_ = -1;
};

struct HostPort {
  std::string host;
  int port = 0;
  static HostPort parse(const std::string& s);  // "host:port" or "[v6]:port"
  std::string str() const;
};

// Listens on `host` (an address or a name; "" = every interface, IPv4 and IPv6); port 0 picks a
// free one. Returns the fd and the bound port.
std::pair<Fd, int> listen_tcp(int port, const std::string& host = "");

// "a.b.c.d:port" or "[v6]:port" of a peer (IPv4-mapped IPv6 addresses written as IPv4).
std::string format_address(const sockaddr_storage& ss);

// Connects (retrying refused connections until the deadline) and returns a blocking socket.
Fd connect_tcp(const HostPort& to, const Deadline& deadline, const std::string& what);

void set_nonblocking(int fd, bool on);
void tune_stream_socket(int fd);

// Blocking full read/write bounded by a deadline. Throw Error naming `what` on failure.
void write_all(int fd, const void* data, size_t len, const Deadline& deadline, const std::string& what);
void read_all(int fd, void* data, size_t len, const Deadline& deadline, const std::string& what);

std::string errno_string(int err);

}  // namespace rumor::net
