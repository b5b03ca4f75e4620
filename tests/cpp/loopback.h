// Test support: one loopback TCP connection, both ends in this process.
#pragma once

#include <sys/socket.h>

#include <stdexcept>

#include "net/socket.h"

namespace rumor::testing {

struct LoopbackPair {
  net::Fd ours, theirs;
};

inline LoopbackPair loopback_pair() {
  auto [lfd, port] = net::listen_tcp(0, "127.0.0.1");
  net::Fd theirs = net::connect_tcp(net::HostPort{"127.0.0.1", port}, Deadline::after(10), "test connect");
  net::Fd ours(::accept(lfd.get(), nullptr, nullptr));
  if (!ours.valid()) throw std::runtime_error("accept failed");
  return {std::move(ours), std::move(theirs)};
}

}  // namespace rumor::testing
