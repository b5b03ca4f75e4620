#include "net/tls_stream.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "net/socket.h"

namespace rumor::net {

namespace {

constexpr size_t kReadBytes = 256 * 1024;

bool would_block(int err) { return err == EAGAIN || err == EWOULDBLOCK; }

}  // namespace

TlsStream::TlsStream(int fd, std::unique_ptr<TlsSession> session) : fd_(fd), session_(std::move(session)) {
  if (!session_) throw Error(ErrorKind::kInvalidArgument, "TlsStream: no session");
}

template <typename F>
auto TlsStream::guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    // A failed session may hold an alert that tells the peer why; it goes if the socket takes it now.
    if (e.kind() == ErrorKind::kProtocol && session_->pending_out() > 0) {
      auto out = session_->peek_out();
      [[maybe_unused]] ssize_t n = ::send(fd_, out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    throw;
  }
}

bool TlsStream::flush() {
  while (session_->pending_out() > 0) {
    auto out = session_->peek_out();
    const ssize_t n = ::send(fd_, out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (would_block(errno)) return false;
      if (errno == EINTR) continue;
      const int err = errno;
      // A peer that refused this end sent its alert before closing: that says why, a broken pipe
      // does not.
      if (err == EPIPE || err == ECONNRESET) surface_alert();
      throw Error(
          ErrorKind::kPeerGone,
          "tls write with " + session_->peer() + ": send(): " + errno_string(err) +
              (session_->handshake_done() ? std::string() : "; " + closed_during_handshake(*session_)));
    }
    session_->consume_out(static_cast<size_t>(n));
  }
  return true;
}

void TlsStream::surface_alert() {
  try {
    while (fill()) {
    }
  } catch (const Error&) {  // the close itself: the caller's error says that
  }
  // The stream is failing: plaintext still unread is dropped with it.
  std::vector<uint8_t> sink(16 * 1024);
  if (!session_->handshake_done()) session_->handshake_step();
  while (session_->handshake_done() && session_->read(sink) > 0) {
  }
}

bool TlsStream::fill() {
  if (rx_.empty()) rx_.resize(kReadBytes);
  while (true) {
    const ssize_t n = ::recv(fd_, rx_.data(), rx_.size(), MSG_DONTWAIT);
    if (n > 0) {
      session_->feed(std::span<const uint8_t>(rx_.data(), static_cast<size_t>(n)));
      return true;
    }
    if (n == 0) {
      if (!session_->handshake_done())
        throw Error(ErrorKind::kPeerGone,
                    "tls handshake with " + session_->peer() + ": " + closed_during_handshake(*session_));
      throw Error(ErrorKind::kPeerGone, "connection closed by the peer");
    }
    if (would_block(errno)) return false;
    if (errno == EINTR) continue;
    const int err = errno;
    throw Error(ErrorKind::kPeerGone, "tls read with " + session_->peer() + ": recv(): " + errno_string(err));
  }
}

bool TlsStream::pump() {
  return guarded([&] {
    while (true) {
      if (!session_->handshake_done()) session_->handshake_step();
      // A failed flush leaves the rest for the next POLLOUT; the handshake may still go on reading.
      const bool flushed = flush();
      if (session_->handshake_done()) return true;
      if (!fill()) return false;
      (void)flushed;
    }
  });
}

size_t TlsStream::recv(std::span<std::byte> out) {
  if (!pump()) return 0;
  return guarded([&]() -> size_t {
    while (true) {
      const size_t n = session_->read({reinterpret_cast<uint8_t*>(out.data()), out.size()});
      // Reading may have produced an answer of the session's own (a key update).
      flush();
      if (n > 0) return n;
      if (session_->peer_closed())
        throw Error(ErrorKind::kPeerGone, "connection closed by the peer (TLS close_notify)");
      if (!fill()) return 0;
    }
  });
}

size_t TlsStream::send(std::span<const std::span<const std::byte>> parts) {
  if (!pump()) return 0;
  return guarded([&]() -> size_t {
    if (!flush()) return 0;
    size_t taken = 0;
    for (auto part : parts) {
      const size_t n = std::min(part.size(), kSealBytes - taken);
      if (n == 0) continue;
      session_->write({reinterpret_cast<const uint8_t*>(part.data()), n});
      taken += n;
      if (taken == kSealBytes) break;
    }
    flush();
    return taken;
  });
}

}  // namespace rumor::net
