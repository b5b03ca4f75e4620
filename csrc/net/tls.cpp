#include "net/tls.h"

#include <arpa/inet.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/core_names.h>
#include <openssl/ec.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/param_build.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "net/socket.h"

namespace rumor::net {

namespace {

struct BioFree {
  void operator()(BIO* p) const { BIO_free_all(p); }
};
struct X509Free {
  void operator()(X509* p) const { X509_free(p); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
};
struct BnFree {
  void operator()(BIGNUM* p) const { BN_free(p); }
};
struct ExtFree {
  void operator()(X509_EXTENSION* p) const { X509_EXTENSION_free(p); }
};
struct GroupFree {
  void operator()(EC_GROUP* p) const { EC_GROUP_free(p); }
};
struct PointFree {
  void operator()(EC_POINT* p) const { EC_POINT_free(p); }
};
struct SecretBnFree {
  void operator()(BIGNUM* p) const { BN_clear_free(p); }
};
struct ParamBldFree {
  void operator()(OSSL_PARAM_BLD* p) const { OSSL_PARAM_BLD_free(p); }
};
struct ParamFree {
  void operator()(OSSL_PARAM* p) const { OSSL_PARAM_free(p); }
};
struct PkeyCtxFree {
  void operator()(EVP_PKEY_CTX* p) const { EVP_PKEY_CTX_free(p); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

// OpenSSL's reason for the oldest error queued on this thread (the root cause; later entries
// are the callers' "this failed too"), and the queue emptied so nothing leaks into the next op.
std::string openssl_reason(unsigned long err = 0) {
  if (err == 0) err = ERR_peek_error();
  ERR_clear_error();
  if (err == 0) return "no reason given by OpenSSL";
  const char* r = ERR_reason_error_string(err);
  if (r != nullptr) return r;
  char buf[256];
  ERR_error_string_n(err, buf, sizeof(buf));
  return buf;
}

[[noreturn]] void pki_fail(const std::string& what) {
  throw Error(ErrorKind::kInvalidArgument, "tls: " + what + ": " + openssl_reason());
}

BioPtr mem_bio(const std::string& s) {
  BioPtr b(BIO_new_mem_buf(s.data(), static_cast<int>(s.size())));
  if (!b) pki_fail("BIO_new_mem_buf");
  return b;
}

std::vector<X509Ptr> read_certs(const std::string& pem, const std::string& what) {
  if (pem.size() > INT_MAX) throw Error(ErrorKind::kInvalidArgument, "tls: " + what + " is too large");
  BioPtr b = mem_bio(pem);
  std::vector<X509Ptr> certs;
  while (X509* x = PEM_read_bio_X509(b.get(), nullptr, nullptr, nullptr)) certs.emplace_back(x);
  // Reading stops with "no start line" at the end of the text: expected, not an error.
  const unsigned long last = ERR_peek_last_error();
  if (!certs.empty() && ERR_GET_LIB(last) == ERR_LIB_PEM && ERR_GET_REASON(last) == PEM_R_NO_START_LINE)
    ERR_clear_error();
  if (certs.empty()) pki_fail("no PEM certificate in " + what);
  if (ERR_peek_error() != 0) pki_fail("bad PEM certificate in " + what);
  return certs;
}

PkeyPtr read_key(const std::string& pem, const std::string& what) {
  if (pem.size() > INT_MAX) throw Error(ErrorKind::kInvalidArgument, "tls: " + what + " is too large");
  BioPtr b = mem_bio(pem);
  PkeyPtr k(PEM_read_bio_PrivateKey(b.get(), nullptr, nullptr, nullptr));
  if (!k) pki_fail("no usable PEM private key in " + what);
  return k;
}

std::string read_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw Error(ErrorKind::kInvalidArgument,
                std::string("tls: cannot read the ") + what + " file '" + path + "'");
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

bool is_ip_address(const std::string& s) {
  unsigned char buf[sizeof(in6_addr)];
  return inet_pton(AF_INET, s.c_str(), buf) == 1 || inet_pton(AF_INET6, s.c_str(), buf) == 1;
}

// printable, then hex: what a peer that did not speak TLS sent, for the error.
std::string describe_bytes(const std::vector<uint8_t>& b) {
  std::string text, hex;
  static constexpr char kHex[] = "0123456789abcdef";
  for (uint8_t c : b) {
    text += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '.';
    hex += kHex[c >> 4];
    hex += kHex[c & 15];
  }
  return "\"" + text + "\" (" + hex + ")";
}

}  // namespace

// The BIO under every session: two byte queues in the session itself. Not BIO_s_mem(): its
// buffer zeroes every byte it is about to be written (BUF_MEM_grow_clean), a pass over the
// ciphertext on top of the copy, on both sides; here a write is one copy and a read another.
struct TlsBuffers {
  static TlsSession* of(BIO* b) { return static_cast<TlsSession*>(BIO_get_data(b)); }
  static int write(BIO* b, const char* data, int len) {
    BIO_clear_retry_flags(b);
    if (len <= 0) return 0;
    std::vector<uint8_t>& out = of(b)->out_;
    out.insert(out.end(), reinterpret_cast<const uint8_t*>(data),
               reinterpret_cast<const uint8_t*>(data) + len);
    return len;
  }
  static int read(BIO* b, char* dst, int len) {
    BIO_clear_retry_flags(b);
    TlsSession* s = of(b);
    const size_t avail = s->in_.size() - s->in_read_;
    if (avail == 0) {
      BIO_set_retry_read(b);  // nothing yet: OpenSSL reports SSL_ERROR_WANT_READ
      return -1;
    }
    const size_t n = std::min(avail, static_cast<size_t>(std::max(len, 0)));
    std::memcpy(dst, s->in_.data() + s->in_read_, n);
    s->in_read_ += n;
    if (s->in_read_ == s->in_.size()) {
      s->in_.clear();
      s->in_read_ = 0;
    }
    return static_cast<int>(n);
  }
  static long ctrl(BIO* b, int cmd, long, void*) {
    const TlsSession* s = of(b);
    switch (cmd) {
      case BIO_CTRL_FLUSH:
        return 1;
      case BIO_CTRL_PENDING:
        return static_cast<long>(s->in_.size() - s->in_read_);
      case BIO_CTRL_WPENDING:
        return static_cast<long>(s->out_.size() - s->out_sent_);
      default:
        return 0;
    }
  }
  static int create(BIO* b) {
    BIO_set_init(b, 1);
    return 1;
  }
  static BIO_METHOD* method() {
    BIO_METHOD* m = BIO_meth_new(BIO_TYPE_SOURCE_SINK, "rumor tls buffers");
    if (m == nullptr || BIO_meth_set_write(m, write) != 1 || BIO_meth_set_read(m, read) != 1 ||
        BIO_meth_set_ctrl(m, ctrl) != 1 || BIO_meth_set_create(m, create) != 1) {
      BIO_meth_free(m);
      return nullptr;
    }
    return m;
  }
};

// ---- configuration and context --------------------------------------------------------------------------

TlsConfig TlsConfig::from_files(const std::string& cert_path, const std::string& key_path,
                                const std::string& ca_path, std::string expected_peer_name) {
  TlsConfig c;
  c.cert_pem = read_file(cert_path, "certificate");
  c.key_pem = read_file(key_path, "private key");
  c.ca_pem = read_file(ca_path, "CA certificate");
  c.expected_peer_name = std::move(expected_peer_name);
  return c;
}

void TlsContext::Free::operator()(ssl_ctx_st* p) const { SSL_CTX_free(p); }
void TlsContext::MethodFree::operator()(bio_method_st* p) const { BIO_meth_free(p); }

TlsContext::TlsContext(const TlsConfig& config) : expected_peer_name_(config.expected_peer_name) {
  ERR_clear_error();
  ctx_.reset(SSL_CTX_new(TLS_method()));
  if (!ctx_) pki_fail("SSL_CTX_new");
  bio_method_.reset(TlsBuffers::method());
  if (!bio_method_) pki_fail("BIO_meth_new");
  SSL_CTX* c = ctx_.get();
  if (SSL_CTX_set_min_proto_version(c, TLS1_3_VERSION) != 1 ||
      SSL_CTX_set_max_proto_version(c, TLS1_3_VERSION) != 1)
    pki_fail("this OpenSSL cannot be limited to TLS 1.3");
  // Only the AEAD suites: a subset the caller names, never a suite from outside the list.
  std::string allowed = std::string(":") + kTlsSuites + ":";
  std::stringstream names(config.suites);
  for (std::string s; std::getline(names, s, ':');)
    if (allowed.find(":" + s + ":") == std::string::npos)
      throw Error(ErrorKind::kInvalidArgument,
                  "tls: suite '" + s + "' is not allowed (allowed: " + std::string(kTlsSuites) + ")");
  if (config.suites.empty() || SSL_CTX_set_ciphersuites(c, config.suites.c_str()) != 1)
    pki_fail("cipher suites '" + config.suites + "'");
  // No tickets or cache: a session is never resumed, so every connection proves its certificate.
  SSL_CTX_set_options(c, SSL_OP_NO_TICKET | SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_COMPRESSION);
  SSL_CTX_set_num_tickets(c, 0);
  SSL_CTX_set_session_cache_mode(c, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_verify(c, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);

  std::vector<X509Ptr> chain = read_certs(config.cert_pem, "the certificate");
  if (SSL_CTX_use_certificate(c, chain[0].get()) != 1) pki_fail("the certificate was not accepted");
  for (size_t i = 1; i < chain.size(); ++i)
    if (SSL_CTX_add1_chain_cert(c, chain[i].get()) != 1)
      pki_fail("intermediate certificate " + std::to_string(i));
  PkeyPtr key = read_key(config.key_pem, "the private key");
  if (X509_check_private_key(chain[0].get(), key.get()) != 1)
    pki_fail("the private key does not match the certificate");
  if (SSL_CTX_use_PrivateKey(c, key.get()) != 1) pki_fail("the private key was not accepted");
  X509_STORE* store = SSL_CTX_get_cert_store(c);
  for (X509Ptr& ca : read_certs(config.ca_pem, "the CA certificates"))
    if (X509_STORE_add_cert(store, ca.get()) != 1) pki_fail("the CA certificate was not accepted");
}

TlsContext::~TlsContext() = default;

// ---- session --------------------------------------------------------------------------------------------

void TlsSession::Free::operator()(ssl_st* p) const { SSL_free(p); }

TlsSession::TlsSession(std::shared_ptr<const TlsContext> ctx, TlsRole role, std::string peer,
                       std::string expected_peer_name)
    : ctx_(std::move(ctx)),
      role_(role),
      peer_(std::move(peer)),
      expected_name_(std::move(expected_peer_name)) {
  if (!ctx_) throw Error(ErrorKind::kInvalidArgument, "tls session with " + peer_ + ": no context");
  if (expected_name_.empty()) expected_name_ = ctx_->expected_peer_name();
  ERR_clear_error();
  ssl_.reset(SSL_new(ctx_->native()));
  if (!ssl_) fail("setup");
  BIO* bio = BIO_new(ctx_->buffer_bio());
  if (bio == nullptr) fail("setup");
  BIO_set_data(bio, this);
  SSL_set_bio(ssl_.get(), bio, bio);  // the SSL owns it from here
  // The session is neither copied nor moved, so the SSL can point back at it.
  SSL_set_app_data(ssl_.get(), this);
  SSL_set_verify(ssl_.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, &TlsSession::on_verify);
  if (!expected_name_.empty()) {
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl_.get());
    X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    const int ok = is_ip_address(expected_name_)
                       ? X509_VERIFY_PARAM_set1_ip_asc(param, expected_name_.c_str())
                       : X509_VERIFY_PARAM_set1_host(param, expected_name_.c_str(), 0);
    if (ok != 1) fail("setup (expected peer name '" + expected_name_ + "')");
  }
  if (role_ == TlsRole::kClient)
    SSL_set_connect_state(ssl_.get());
  else
    SSL_set_accept_state(ssl_.get());
}

TlsSession::~TlsSession() { ssl_.reset(); }  // before the buffers its BIO points into

int TlsSession::on_verify(int ok, x509_store_ctx_st* store) {
  if (ok != 1) {
    auto* ssl = static_cast<SSL*>(X509_STORE_CTX_get_ex_data(store, SSL_get_ex_data_X509_STORE_CTX_idx()));
    auto* self = ssl != nullptr ? static_cast<TlsSession*>(SSL_get_app_data(ssl)) : nullptr;
    if (X509* leaf = X509_STORE_CTX_get0_cert(store); self != nullptr && leaf != nullptr) {
      char subject[256];
      X509_NAME_oneline(X509_get_subject_name(leaf), subject, sizeof(subject));
      self->refused_subject_ = subject;
    }
  }
  return ok;
}

void TlsSession::fail(const std::string& op, unsigned long err) {
  if (err == 0) err = ERR_peek_error();
  const int lib = ERR_GET_LIB(err);
  const int reason = ERR_GET_REASON(err);
  std::string why;
  const long verify = ssl_ ? SSL_get_verify_result(ssl_.get()) : X509_V_OK;
  if (ssl_ && verify != X509_V_OK && !done_) {
    why = std::string("peer certificate refused: ").append(X509_verify_cert_error_string(verify));
    if (verify == X509_V_ERR_HOSTNAME_MISMATCH || verify == X509_V_ERR_IP_ADDRESS_MISMATCH)
      why += " (expected the name '" + expected_name_ + "')";
    if (!refused_subject_.empty()) why.append("; its subject: ").append(refused_subject_);
    ERR_clear_error();
  } else if (lib == ERR_LIB_SSL && reason == SSL_R_PEER_DID_NOT_RETURN_A_CERTIFICATE) {
    ERR_clear_error();
    why = "the peer presented no certificate (both ends must)";
  } else if (lib == ERR_LIB_SSL &&
             (reason == SSL_R_DECRYPTION_FAILED_OR_BAD_RECORD_MAC || reason == SSL_R_DECRYPTION_FAILED)) {
    why = "integrity check failed: a record did not authenticate (" + openssl_reason(err) +
          "), its bytes were altered in transit";
  } else if (lib == ERR_LIB_SSL &&
             (reason == SSL_R_UNSUPPORTED_PROTOCOL || reason == SSL_R_NO_PROTOCOLS_AVAILABLE ||
              reason == SSL_R_WRONG_VERSION_NUMBER)) {
    why = "the peer does not speak TLS 1.3, the only version allowed (" + openssl_reason(err) + ")";
  } else if (lib == ERR_LIB_SSL && reason >= SSL_AD_REASON_OFFSET) {
    // An alert the peer sent: it refused this end (its certificate, name or protocol).
    why = "the peer refused this end: " + openssl_reason(err);
  } else {
    why = openssl_reason(err);
  }
  failed_ = true;
  failure_ = "tls " + op + " with " + peer_ + ": " + why;
  throw Error(ErrorKind::kProtocol, failure_);
}

void TlsSession::check_alive(const char* op) const {
  if (failed_)
    throw Error(ErrorKind::kAborted,
                std::string("tls ").append(op) + " with " + peer_ + ": failed earlier: " + failure_);
}

void TlsSession::check_speaks_tls() {
  if (first_bytes_.empty()) return;
  // A TLS stream starts with a record header: type handshake (22), or alert (21) from a server
  // that refuses the hello, then the legacy version's major byte 3.
  const uint8_t type = first_bytes_[0];
  const bool type_ok = type == 22 || (role_ == TlsRole::kClient && type == 21);
  if (type_ok && (first_bytes_.size() < 2 || first_bytes_[1] == 3)) return;
  failed_ = true;
  failure_ = "tls handshake with " + peer_ +
             ": the peer did not speak TLS (its first bytes: " + describe_bytes(first_bytes_) +
             "); is it a rumor without TLS, or not rumor at all?";
  throw Error(ErrorKind::kProtocol, failure_);
}

void TlsSession::feed(std::span<const uint8_t> ciphertext) {
  check_alive("read");
  constexpr size_t kShown = 8;
  for (size_t i = 0; i < ciphertext.size() && first_bytes_.size() < kShown; ++i)
    first_bytes_.push_back(ciphertext[i]);
  if (in_read_ > 0 && in_read_ >= in_.size() / 2) {  // amortized: drop what OpenSSL has read
    in_.erase(in_.begin(), in_.begin() + static_cast<long>(in_read_));
    in_read_ = 0;
  }
  in_.insert(in_.end(), ciphertext.begin(), ciphertext.end());
}

bool TlsSession::handshake_step() {
  check_alive("handshake");
  if (done_) return true;
  check_speaks_tls();
  ERR_clear_error();
  const int rc = SSL_do_handshake(ssl_.get());
  if (rc == 1) {
    done_ = true;
    return true;
  }
  const int e = SSL_get_error(ssl_.get(), rc);
  if (e == SSL_ERROR_WANT_READ) return false;
  if (e == SSL_ERROR_ZERO_RETURN) {
    failed_ = true;
    failure_ = "tls handshake with " + peer_ + ": the peer closed TLS during the handshake";
    throw Error(ErrorKind::kPeerGone, failure_);
  }
  fail("handshake");
}

size_t TlsSession::read(std::span<uint8_t> out) {
  check_alive("read");
  if (!done_)
    throw Error(ErrorKind::kInvalidArgument, "tls read with " + peer_ + ": before the handshake completed");
  if (out.empty() || peer_closed_) return 0;
  ERR_clear_error();
  size_t got = 0;
  const int rc = SSL_read_ex(ssl_.get(), out.data(), out.size(), &got);
  if (rc == 1) return got;
  const int e = SSL_get_error(ssl_.get(), rc);
  if (e == SSL_ERROR_WANT_READ) return 0;
  if (e == SSL_ERROR_ZERO_RETURN) {
    peer_closed_ = true;
    return 0;
  }
  fail("read");
}

void TlsSession::write(std::span<const uint8_t> plaintext) {
  check_alive("write");
  if (!done_)
    throw Error(ErrorKind::kInvalidArgument, "tls write with " + peer_ + ": before the handshake completed");
  while (!plaintext.empty()) {
    ERR_clear_error();
    size_t put = 0;
    // A memory BIO never pushes back, so this seals everything it is given.
    if (SSL_write_ex(ssl_.get(), plaintext.data(), plaintext.size(), &put) != 1 || put == 0) fail("write");
    plaintext = plaintext.subspan(put);
  }
}

void TlsSession::close() {
  if (failed_ || !done_) return;
  ERR_clear_error();
  SSL_shutdown(ssl_.get());  // 0 = our close_notify queued, the peer's not seen yet: all we want
  ERR_clear_error();
}

size_t TlsSession::pending_out() const { return out_.size() - out_sent_; }

std::span<const uint8_t> TlsSession::peek_out() { return std::span<const uint8_t>(out_).subspan(out_sent_); }

void TlsSession::consume_out(size_t n) {
  out_sent_ = std::min(out_.size(), out_sent_ + n);
  if (out_sent_ == out_.size()) {
    out_.clear();
    out_sent_ = 0;
  } else if (out_sent_ >= (size_t{1} << 20) && out_sent_ >= out_.size() / 2) {
    out_.erase(out_.begin(), out_.begin() + static_cast<long>(out_sent_));
    out_sent_ = 0;
  }
}

std::vector<uint8_t> TlsSession::take_out() {
  std::span<const uint8_t> s = peek_out();
  std::vector<uint8_t> v(s.begin(), s.end());
  consume_out(v.size());
  return v;
}

std::string TlsSession::suite() const {
  if (!done_) return "";
  const SSL_CIPHER* c = SSL_get_current_cipher(ssl_.get());
  return c != nullptr ? SSL_CIPHER_standard_name(c) : "";
}

std::string TlsSession::peer_subject() const {
  const X509* cert = done_ ? SSL_get0_peer_certificate(ssl_.get()) : nullptr;
  if (cert == nullptr) return "";
  char subject[256];
  X509_NAME_oneline(X509_get_subject_name(cert), subject, sizeof(subject));
  return subject;
}

std::string TlsSession::waiting_for() const {
  if (done_) return "nothing (handshake complete)";
  if (first_bytes_.empty())
    return role_ == TlsRole::kServer ? "the client's hello (the peer sent nothing)"
                                     : "the server's hello (the peer sent nothing)";
  return std::string("the peer's next handshake message (state: ") + SSL_state_string_long(ssl_.get()) + ")";
}

std::string closed_during_handshake(const TlsSession& s) {
  return "the peer closed the connection during the TLS handshake (this end waited for " + s.waiting_for() +
         "): it refused this rank, or it has TLS off (RUMOR_TLS_* must be set on every rank or on none)";
}

// ---- blocking helpers over a nonblocking socket
// --------------------------------------------------------------

namespace {

// Sends what the socket takes now; true once nothing is left to send.
bool send_some(int fd, TlsSession& s, const std::string& op) {
  while (true) {
    std::span<const uint8_t> out = s.peek_out();
    if (out.empty()) return true;
    const ssize_t n = ::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
    if (n > 0) {
      s.consume_out(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    if (n < 0 && errno == EINTR) continue;
    const int err = errno;
    throw Error(err == EPIPE || err == ECONNRESET ? ErrorKind::kPeerGone : ErrorKind::kSystem,
                "tls " + op + " with " + s.peer() + ": send(): " + errno_string(err));
  }
}

}  // namespace

bool tls_send_some(int fd, TlsSession& s) { return send_some(fd, s, "write"); }

void tls_handshake(int fd, TlsSession& s, const Deadline& deadline) {
  std::vector<uint8_t> in(16 * 1024);
  while (true) {
    bool done = false;
    try {
      done = s.handshake_step();
    } catch (const Error&) {
      // Tell the peer why (its alert), if the socket takes it at once; the refusal stands anyway.
      try {
        send_some(fd, s, "handshake");
      } catch (const Error&) {
      }
      throw;
    }
    const bool flushed = send_some(fd, s, "handshake");
    if (done && flushed) return;
    pollfd p{fd, static_cast<short>((done ? 0 : POLLIN) | (flushed ? 0 : POLLOUT)), 0};
    const int rc = ::poll(&p, 1, deadline.ms_left(1000));
    if (rc < 0 && errno != EINTR)
      throw Error(ErrorKind::kSystem, "tls handshake with " + s.peer() + ": poll(): " + errno_string(errno));
    if (rc <= 0) {
      if (deadline.expired())
        throw Error(
            ErrorKind::kTimeout,
            "tls handshake with " + s.peer() + ": deadline passed while waiting for " +
                (done ? std::string("the socket to take this end's last handshake bytes") : s.waiting_for()));
      continue;
    }
    if (done) continue;
    const ssize_t n = ::recv(fd, in.data(), in.size(), 0);
    if (n > 0) {
      s.feed(std::span<const uint8_t>(in.data(), static_cast<size_t>(n)));
    } else if (n == 0) {
      throw Error(ErrorKind::kPeerGone, "tls handshake with " + s.peer() +
                                            ": the peer closed the connection while this end waited for " +
                                            s.waiting_for());
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      const int err = errno;
      throw Error(err == ECONNRESET ? ErrorKind::kPeerGone : ErrorKind::kSystem,
                  "tls handshake with " + s.peer() + ": recv(): " + errno_string(err));
    }
  }
}

void tls_flush(int fd, TlsSession& s, const Deadline& deadline) {
  while (!send_some(fd, s, "write")) {
    pollfd p{fd, POLLOUT, 0};
    const int rc = ::poll(&p, 1, deadline.ms_left(1000));
    if (rc < 0 && errno != EINTR)
      throw Error(ErrorKind::kSystem, "tls write with " + s.peer() + ": poll(): " + errno_string(errno));
    if (rc <= 0 && deadline.expired())
      throw Error(ErrorKind::kTimeout, "tls write with " + s.peer() + ": deadline passed with " +
                                           std::to_string(s.pending_out()) +
                                           " bytes not taken by the socket (the peer does not read)");
  }
}

// ---- PKI --------------------------------------------------------------------------------------------------

namespace {

PkeyPtr new_p256_key() {
  PkeyPtr k(EVP_EC_gen("P-256"));
  if (!k) pki_fail("EC P-256 key generation");
  return k;
}

// The key pair of a given private scalar d: the public point d*G computed here, because
// EVP_PKEY_fromdata takes a key pair as given and does not derive one half from the other.
PkeyPtr p256_key_from_scalar(std::span<const uint8_t> scalar) {
  if (scalar.size() != 32)
    throw Error(ErrorKind::kInvalidArgument,
                "tls: a P-256 private scalar is 32 bytes, got " + std::to_string(scalar.size()));
  std::unique_ptr<EC_GROUP, GroupFree> group(EC_GROUP_new_by_curve_name(NID_X9_62_prime256v1));
  if (!group) pki_fail("the P-256 group");
  std::unique_ptr<BIGNUM, SecretBnFree> d(BN_bin2bn(scalar.data(), static_cast<int>(scalar.size()), nullptr));
  if (!d) pki_fail("BN_bin2bn");
  if (BN_is_zero(d.get()) || BN_cmp(d.get(), EC_GROUP_get0_order(group.get())) >= 0)
    throw Error(ErrorKind::kInvalidArgument, "tls: the private scalar is not in [1, n-1] for P-256");
  std::unique_ptr<EC_POINT, PointFree> pub(EC_POINT_new(group.get()));
  if (!pub || EC_POINT_mul(group.get(), pub.get(), d.get(), nullptr, nullptr, nullptr) != 1)
    pki_fail("the public point of a P-256 private scalar");
  std::vector<unsigned char> point(
      EC_POINT_point2oct(group.get(), pub.get(), POINT_CONVERSION_UNCOMPRESSED, nullptr, 0, nullptr));
  if (point.empty() || EC_POINT_point2oct(group.get(), pub.get(), POINT_CONVERSION_UNCOMPRESSED, point.data(),
                                          point.size(), nullptr) != point.size())
    pki_fail("encoding a P-256 public point");
  std::unique_ptr<OSSL_PARAM_BLD, ParamBldFree> bld(OSSL_PARAM_BLD_new());
  if (!bld ||
      OSSL_PARAM_BLD_push_utf8_string(bld.get(), OSSL_PKEY_PARAM_GROUP_NAME, SN_X9_62_prime256v1, 0) != 1 ||
      OSSL_PARAM_BLD_push_BN(bld.get(), OSSL_PKEY_PARAM_PRIV_KEY, d.get()) != 1 ||
      OSSL_PARAM_BLD_push_octet_string(bld.get(), OSSL_PKEY_PARAM_PUB_KEY, point.data(), point.size()) != 1)
    pki_fail("P-256 key parameters");
  std::unique_ptr<OSSL_PARAM, ParamFree> params(OSSL_PARAM_BLD_to_param(bld.get()));
  std::unique_ptr<EVP_PKEY_CTX, PkeyCtxFree> ctx(EVP_PKEY_CTX_new_from_name(nullptr, "EC", nullptr));
  EVP_PKEY* key = nullptr;
  if (!params || !ctx || EVP_PKEY_fromdata_init(ctx.get()) <= 0 ||
      EVP_PKEY_fromdata(ctx.get(), &key, EVP_PKEY_KEYPAIR, params.get()) <= 0)
    pki_fail("a P-256 key from its private scalar");
  return PkeyPtr(key);
}

void add_ext(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX v3;
  X509V3_set_ctx_nodb(&v3);
  X509V3_set_ctx(&v3, issuer, cert, nullptr, nullptr, 0);
  std::unique_ptr<X509_EXTENSION, ExtFree> ext(X509V3_EXT_conf_nid(nullptr, &v3, nid, value.c_str()));
  if (!ext || X509_add_ext(cert, ext.get(), -1) != 1)
    pki_fail(std::string("extension ") + OBJ_nid2sn(nid) + "=" + value);
}

// A certificate's fields, unsigned: v3, 127-bit random serial, validity, subject CN, public key.
X509Ptr new_cert(const std::string& common_name, EVP_PKEY* key, CertTime not_before, CertTime not_after) {
  if (common_name.empty()) throw Error(ErrorKind::kInvalidArgument, "tls: a certificate needs a common name");
  if (not_after <= not_before)
    throw Error(ErrorKind::kInvalidArgument, "tls: certificate '" + common_name + "' ends before it starts");
  X509Ptr x(X509_new());
  if (!x) pki_fail("X509_new");
  if (X509_set_version(x.get(), X509_VERSION_3) != 1) pki_fail("X509_set_version");
  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof(serial)) != 1) pki_fail("RAND_bytes for a serial number");
  serial[0] &= 0x7f;  // a positive INTEGER
  std::unique_ptr<BIGNUM, BnFree> bn(BN_bin2bn(serial, sizeof(serial), nullptr));
  if (!bn || BN_to_ASN1_INTEGER(bn.get(), X509_get_serialNumber(x.get())) == nullptr)
    pki_fail("serial number");
  if (ASN1_TIME_set(X509_getm_notBefore(x.get()), std::chrono::system_clock::to_time_t(not_before)) ==
          nullptr ||
      ASN1_TIME_set(X509_getm_notAfter(x.get()), std::chrono::system_clock::to_time_t(not_after)) == nullptr)
    pki_fail("validity of '" + common_name + "'");
  X509_NAME* name = X509_get_subject_name(x.get());
  if (X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8,
                                 reinterpret_cast<const unsigned char*>(common_name.c_str()), -1, -1, 0) != 1)
    pki_fail("common name '" + common_name + "'");
  if (X509_set_pubkey(x.get(), key) != 1) pki_fail("X509_set_pubkey");
  return x;
}

PemCredentials to_pem(X509* cert, EVP_PKEY* key) {
  auto text = [](BIO* b) {
    char* data = nullptr;
    const long n = BIO_get_mem_data(b, &data);
    return std::string(data, static_cast<size_t>(n));
  };
  BioPtr c(BIO_new(BIO_s_mem())), k(BIO_new(BIO_s_mem()));
  if (!c || !k || PEM_write_bio_X509(c.get(), cert) != 1 ||
      PEM_write_bio_PrivateKey(k.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1)
    pki_fail("PEM encoding");
  return {text(c.get()), text(k.get())};
}

// The CA's certificate for its key (see make_ca).
PemCredentials self_signed_ca(const std::string& common_name, PkeyPtr key, CertTime not_before,
                              CertTime not_after) {
  X509Ptr x = new_cert(common_name, key.get(), not_before, not_after);
  if (X509_set_issuer_name(x.get(), X509_get_subject_name(x.get())) != 1) pki_fail("issuer name");
  add_ext(x.get(), x.get(), NID_basic_constraints, "critical,CA:TRUE");
  add_ext(x.get(), x.get(), NID_key_usage, "critical,keyCertSign,cRLSign");
  add_ext(x.get(), x.get(), NID_subject_key_identifier, "hash");
  add_ext(x.get(), x.get(), NID_authority_key_identifier, "keyid:always");
  if (X509_sign(x.get(), key.get(), EVP_sha256()) <= 0) pki_fail("signing CA '" + common_name + "'");
  return to_pem(x.get(), key.get());
}

}  // namespace

PemCredentials make_ca(const std::string& common_name, CertTime not_before, CertTime not_after) {
  ERR_clear_error();
  return self_signed_ca(common_name, new_p256_key(), not_before, not_after);
}

PemCredentials make_ca(const std::string& common_name, CertTime not_before, CertTime not_after,
                       std::span<const uint8_t> private_scalar) {
  ERR_clear_error();
  return self_signed_ca(common_name, p256_key_from_scalar(private_scalar), not_before, not_after);
}

PemCredentials issue_certificate(const PemCredentials& ca, const std::string& common_name,
                                 const std::vector<std::string>& sans, CertTime not_before,
                                 CertTime not_after) {
  ERR_clear_error();
  std::vector<X509Ptr> ca_certs = read_certs(ca.cert_pem, "the CA certificate");
  PkeyPtr ca_key = read_key(ca.key_pem, "the CA key");
  if (X509_check_private_key(ca_certs[0].get(), ca_key.get()) != 1)
    pki_fail("the CA key does not match its certificate");
  std::string alt;
  for (const std::string& s : sans) {
    // Names are joined into OpenSSL's "DNS:a,IP:b" syntax: a separator inside one would add a name.
    const bool ip = is_ip_address(s);
    const bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
      return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
             c == '-' || c == '_' || c == '*';
    });
    if (!ip && !plain)
      throw Error(ErrorKind::kInvalidArgument, "tls: '" + s + "' is neither an IP address nor a DNS name");
    // append(), not operator+(const char*, std::string&&): GCC 12 at -O3 reports a false -Wrestrict.
    alt.append(alt.empty() ? "" : ",").append(ip ? "IP:" : "DNS:").append(s);
  }
  PkeyPtr key = new_p256_key();
  X509Ptr x = new_cert(common_name, key.get(), not_before, not_after);
  if (X509_set_issuer_name(x.get(), X509_get_subject_name(ca_certs[0].get())) != 1) pki_fail("issuer name");
  add_ext(x.get(), ca_certs[0].get(), NID_basic_constraints, "critical,CA:FALSE");
  add_ext(x.get(), ca_certs[0].get(), NID_key_usage, "critical,digitalSignature");
  add_ext(x.get(), ca_certs[0].get(), NID_ext_key_usage, "serverAuth,clientAuth");
  add_ext(x.get(), ca_certs[0].get(), NID_subject_key_identifier, "hash");
  add_ext(x.get(), ca_certs[0].get(), NID_authority_key_identifier, "keyid:always");
  if (!alt.empty()) add_ext(x.get(), ca_certs[0].get(), NID_subject_alt_name, alt);
  if (X509_sign(x.get(), ca_key.get(), EVP_sha256()) <= 0) pki_fail("signing '" + common_name + "'");
  return to_pem(x.get(), key.get());
}

}  // namespace rumor::net
