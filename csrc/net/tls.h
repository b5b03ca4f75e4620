// TLS 1.3 with mutual certificates (issue 46), as a layer of its own: nothing here owns a socket.
// A TlsSession runs OpenSSL over an in-memory BIO (two byte queues): the caller feeds it the
// ciphertext its socket read and sends the ciphertext the session produced, and gets plaintext in
// between. So the poll loops that own the sockets today (the listener's, the channels') keep
// owning IO and deadlines, and one session never blocks a thread. Not yet used by the channels:
// see docs/architecture.md.
//
// Policy, fixed: TLS 1.3 only; AEAD suites only; both ends present a certificate and verify the
// peer's against the job's CA (and optionally an expected name); no session tickets, resumption,
// renegotiation or compression. Every OpenSSL failure throws rumor::Error whose text names the
// operation, the peer (the description the session was given) and OpenSSL's reason.
//
// A TLS 1.3 detail callers must know: the client finishes its handshake before the server has
// checked the client's certificate (the client's Finished travels with it). A server's refusal
// reaches the client as an alert on its first read, not from the handshake.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/types.h"

// OpenSSL's types, declared rather than included: users of this header need no OpenSSL headers.
struct ssl_st;
struct ssl_ctx_st;
struct x509_store_ctx_st;
struct bio_method_st;

namespace rumor::net {

// The suites allowed (all AEAD). The first is preferred: AES-128-GCM is the fastest with AES-NI.
inline constexpr const char* kTlsSuites =
    "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256";

struct TlsConfig {
  std::string cert_pem;  // this end's certificate, then any intermediates (PEM)
  std::string key_pem;   // its private key (PEM, unencrypted)
  std::string ca_pem;    // the certificate(s) of the CA(s) to trust (PEM)
  // If set, the peer's certificate must name it (a DNS or IP subjectAltName, or the CN where the
  // certificate has no DNS name): a certificate the same CA issued for another job is refused.
  std::string expected_peer_name;
  // A ':'-separated subset of kTlsSuites, in order of preference.
  std::string suites = kTlsSuites;

  // Reads the three PEM files; throws Error(kInvalidArgument) naming the file that cannot be read.
  static TlsConfig from_files(const std::string& cert_path, const std::string& key_path,
                              const std::string& ca_path, std::string expected_peer_name = "");
};

// One SSL_CTX with the policy above; immutable once built, shared by the sessions of a process.
class TlsContext {
 public:
  // Throws Error(kInvalidArgument) naming what did not load (certificate, key, CA, suites).
  explicit TlsContext(const TlsConfig& config);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  ssl_ctx_st* native() const { return ctx_.get(); }
  bio_method_st* buffer_bio() const { return bio_method_.get(); }
  const std::string& expected_peer_name() const { return expected_peer_name_; }

 private:
  struct Free {
    void operator()(ssl_ctx_st* p) const;
  };
  std::unique_ptr<ssl_ctx_st, Free> ctx_;
  struct MethodFree {
    void operator()(bio_method_st* p) const;
  };
  std::unique_ptr<bio_method_st, MethodFree> bio_method_;
  std::string expected_peer_name_;
};

enum class TlsRole : uint8_t { kClient, kServer };

class TlsSession {
 public:
  // `peer` describes the other end in errors ("10.0.0.2:41234 (rank 3)"). `expected_peer_name`
  // overrides the context's (e.g. one name per rank); empty keeps the context's.
  TlsSession(std::shared_ptr<const TlsContext> ctx, TlsRole role, std::string peer,
             std::string expected_peer_name = "");
  ~TlsSession();
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  // Advances the handshake with what was fed so far; true once it is complete. Throws on any
  // failure (the peer refused, its certificate was refused, it did not speak TLS). After a throw
  // the session is dead, though pending_out() may hold an alert worth sending to tell the peer.
  bool handshake_step();
  bool handshake_done() const { return done_; }

  // Ciphertext read from the socket.
  void feed(std::span<const uint8_t> ciphertext);
  // Plaintext, up to out.size() bytes; 0 when a whole record has not arrived yet, or once the
  // peer closed (see peer_closed()). Throws if a record fails its integrity check: no byte of a
  // record is returned unless the whole record authenticated.
  size_t read(std::span<uint8_t> out);
  // Plaintext to send: sealed into records now and queued in pending_out().
  void write(std::span<const uint8_t> plaintext);
  // Sends close_notify; the peer's read() then returns 0 with peer_closed() true.
  void close();
  bool peer_closed() const { return peer_closed_; }

  // Ciphertext waiting to be sent, in bytes.
  size_t pending_out() const;
  // All of it, to hand to send(); valid until the next call on the session. A socket that takes
  // part of it: consume_out(the bytes sent), and the rest stays first in line.
  std::span<const uint8_t> peek_out();
  void consume_out(size_t n);
  // Moves all of it out.
  std::vector<uint8_t> take_out();

  const std::string& peer() const { return peer_; }
  TlsRole role() const { return role_; }
  // Negotiated suite ("TLS_AES_128_GCM_SHA256"); empty before the handshake is done.
  std::string suite() const;
  // The subject of the peer's verified certificate (one line); empty before the handshake.
  std::string peer_subject() const;
  // What the handshake waits for now, in words (for a timeout's message).
  std::string waiting_for() const;

 private:
  [[noreturn]] void fail(const std::string& op, unsigned long err = 0);
  void check_alive(const char* op) const;
  void check_speaks_tls();

  // OpenSSL's verify callback: keeps the subject of a refused certificate for the error (the
  // server does not keep a client certificate that failed).
  static int on_verify(int ok, x509_store_ctx_st* store);
  friend struct TlsBuffers;  // the BIO callbacks over in_ and out_

  struct Free {
    void operator()(ssl_st* p) const;
  };
  std::shared_ptr<const TlsContext> ctx_;
  std::unique_ptr<ssl_st, Free> ssl_;
  TlsRole role_;
  std::string peer_;
  std::string expected_name_;
  bool done_ = false;
  bool failed_ = false;
  bool peer_closed_ = false;
  // The first bytes the peer sent: a peer that does not speak TLS is named as such.
  std::vector<uint8_t> first_bytes_;
  std::string failure_;
  std::string refused_subject_;
  // The session's BIO: ciphertext fed and not yet read by OpenSSL (from in_read_), and
  // ciphertext OpenSSL wrote and the caller did not send yet (from out_sent_).
  std::vector<uint8_t> in_;
  size_t in_read_ = 0;
  std::vector<uint8_t> out_;
  size_t out_sent_ = 0;
};

// Drives the handshake on a connected NONBLOCKING socket with poll() until it completes (all of
// this end's handshake bytes sent) or `deadline` passes. Throws Error: kTimeout naming what the
// handshake waited for, kPeerGone if the peer closed, kProtocol if it was refused, kSystem for
// socket errors. A failed handshake's alert is sent when the socket takes it at once.
void tls_handshake(int fd, TlsSession& session, const Deadline& deadline);

// Why a connection that closed while `session`'s handshake waited probably closed, in words, for
// the error of whoever saw the close.
std::string closed_during_handshake(const TlsSession& session);

// Sends what a nonblocking socket takes now of session.pending_out(); true once all of it is sent.
bool tls_send_some(int fd, TlsSession& session);

// Sends all of session.pending_out() on a nonblocking socket before `deadline`.
void tls_flush(int fd, TlsSession& session, const Deadline& deadline);

// ---- A small PKI, with the OpenSSL C API: EC P-256 keys, X.509 v3, SHA-256 signatures. ----------
struct PemCredentials {
  std::string cert_pem;
  std::string key_pem;
};
using CertTime = std::chrono::system_clock::time_point;

// A self-signed CA (basicConstraints CA:TRUE, keyUsage keyCertSign+cRLSign).
PemCredentials make_ca(const std::string& common_name, CertTime not_before, CertTime not_after);
// The same with its key given, not made: `private_scalar` is the P-256 private key as 32 big-endian
// bytes in [1, n-1] (else Error kInvalidArgument). Hosts that derive one scalar from the job's secret
// make CA certificates with the same subject and public key, so each trusts the leaves every other
// one issues with no file copied between them (rumor-run --tls auto).
PemCredentials make_ca(const std::string& common_name, CertTime not_before, CertTime not_after,
                       std::span<const uint8_t> private_scalar);
// A leaf signed by `ca`: CA:FALSE, keyUsage digitalSignature, extendedKeyUsage serverAuth and
// clientAuth (every end is both), a subjectAltName per entry of `sans` (an IP address where one
// parses, a DNS name otherwise). The serial number is 127 random bits.
PemCredentials issue_certificate(const PemCredentials& ca, const std::string& common_name,
                                 const std::vector<std::string>& sans, CertTime not_before,
                                 CertTime not_after);

}  // namespace rumor::net
