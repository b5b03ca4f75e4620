// A TlsSession (net/tls.h) bound to one connected nonblocking socket, for an event loop that owns
// the socket and must never block on it: the window hub's progress thread (comm/window_progress.h)
// serves every remote peer from one poll() loop, so a handshake or a record that is not complete
// yet must return to that loop instead of waiting. Every call moves what the socket allows now.
//
// The handshake runs inside pump()/recv()/send() as bytes arrive, not up front: the progress
// thread is the only reader of the socket, and a blocking handshake where links are dialed would
// make the dialer wait for the acceptor's thread (see TcpChannel for the same reason).
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "net/tls.h"

namespace rumor::net {

class TlsStream {
 public:
  // `fd` stays owned by the caller and must outlive this object.
  TlsStream(int fd, std::unique_ptr<TlsSession> session);

  // Advances the handshake and sends ciphertext waiting for the socket, as far as the socket
  // allows; true once the handshake is done. Throws as recv() does.
  bool pump();
  // Plaintext into `out`: the bytes read, 0 when nothing more can be read now (the handshake or a
  // record is not complete and the socket is empty). No byte of a record that fails its integrity
  // check is returned. Throws Error: kProtocol for a TLS failure (refused certificate, altered
  // record, a peer that does not speak TLS), after sending this end's alert if the socket takes
  // it; kPeerGone when the peer closed the connection or TLS.
  size_t recv(std::span<std::byte> out);
  // Seals up to kSealBytes of the concatenation of `parts` and sends what the socket takes; the
  // plaintext bytes taken, which the caller's buffers no longer need. 0 while the handshake is
  // not done or earlier ciphertext still waits for the socket. Throws as recv() does.
  size_t send(std::span<const std::span<const std::byte>> parts);
  // True while ciphertext waits for the socket: the loop should poll for POLLOUT.
  bool wants_write() const { return session_->pending_out() > 0; }
  bool handshake_done() const { return session_->handshake_done(); }
  const TlsSession& session() const { return *session_; }

  // Plaintext sealed per send(): bounds the ciphertext a stream holds for a slow socket.
  static constexpr size_t kSealBytes = 256 * 1024;

 private:
  // One recv() into the session; false when the socket has nothing now.
  bool fill();
  // Sends what the socket takes of the pending ciphertext; true once none is left.
  bool flush();
  // The socket broke while sending: reads what the peer sent before it closed, so that its alert
  // (a refusal, an integrity failure) is thrown as such.
  void surface_alert();
  // Runs f, and on a TLS failure sends the session's alert (best effort) before rethrowing.
  template <typename F>
  auto guarded(F&& f) -> decltype(f());

  int fd_;
  std::unique_ptr<TlsSession> session_;
  std::vector<uint8_t> rx_;
};

}  // namespace rumor::net
