#include "netplugin/wire.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>

namespace rumor::netplugin::wire {

bool random_bytes(void* out, size_t len) {
  auto* p = static_cast<uint8_t*>(out);
  while (len > 0) {
    ssize_t n = ::getrandom(p, len, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
  return true;
}

namespace {
void hmac(const void* key, size_t key_len, const void* data, size_t len, uint8_t* out) {
  unsigned int out_len = 32;
  ::HMAC(EVP_sha256(), key, static_cast<int>(key_len), static_cast<const unsigned char*>(data), len, out,
         &out_len);
}
}  // namespace

Key derive_key(std::string_view secret) {
  static constexpr char kLabel[] = "rumor/netplugin/v1";
  Key k{};
  hmac(secret.data(), secret.size(), kLabel, sizeof(kLabel) - 1, k.data());
  return k;
}

std::string check_hello(const Hello& h, const Id& listen_id) {
  if (h.magic != kHelloMagic) return "not a rumor net plugin hello";
  if (h.version != kProtocolVersion)
    return "protocol version " + std::to_string(h.version) + ", expected " +
           std::to_string(kProtocolVersion) + " (another rumor version?)";
  if (h.nstreams < 1 || h.nstreams > kMaxStreams || h.stream >= h.nstreams)
    return "stream " + std::to_string(h.stream) + " of " + std::to_string(h.nstreams) + " is out of range";
  if (h.flags & ~kFlagAuth) return "unknown flags " + std::to_string(h.flags);
  // Not secret once authenticated (the MACs bind it), but compared in constant time anyway: in an
  // unauthenticated job it is all that keeps a stranger's connection out.
  if (CRYPTO_memcmp(h.listen_id.data(), listen_id.data(), listen_id.size()) != 0)
    return "greets another listener";
  return {};
}

Mac hello_mac(const Key& key, char role, const Hello& h, const Nonce& acceptor_nonce) {
  // Fixed layout, every field explicit (no struct padding hashed): role, listen id, connection id,
  // stream, stream count, flags, both nonces.
  uint8_t msg[1 + 16 + 8 + 2 + 2 + 2 + 16 + 16];
  size_t at = 0;
  auto put = [&](const void* p, size_t n) {
    std::memcpy(msg + at, p, n);
    at += n;
  };
  put(&role, 1);
  put(h.listen_id.data(), h.listen_id.size());
  put(&h.conn_id, sizeof(h.conn_id));
  put(&h.stream, sizeof(h.stream));
  put(&h.nstreams, sizeof(h.nstreams));
  put(&h.flags, sizeof(h.flags));
  put(h.nonce.data(), h.nonce.size());
  put(acceptor_nonce.data(), acceptor_nonce.size());
  Mac m{};
  hmac(key.data(), key.size(), msg, at, m.data());
  return m;
}

bool mac_equal(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

std::string check_chunk(const ChunkHeader& h) {
  if (h.magic != kChunkMagic) return "bad chunk magic";
  if (h.total > kMaxMessageBytes)
    return "message size " + std::to_string(h.total) + " exceeds " + std::to_string(kMaxMessageBytes);
  if (h.len > h.total || h.offset > h.total - h.len)
    return "chunk [" + std::to_string(h.offset) + ", +" + std::to_string(h.len) + ") outside a " +
           std::to_string(h.total) + "-byte message";
  return {};
}

std::string admit_chunk(MessageBook& m, const ChunkHeader& h) {
  if (h.total != m.total || h.tag != m.tag)
    return "chunk of message " + std::to_string(h.seq) + " says " + std::to_string(h.total) + " bytes tag " +
           std::to_string(h.tag) + ", its first chunk said " + std::to_string(m.total) + " bytes tag " +
           std::to_string(m.tag);
  if (h.len > m.total - m.reserved)
    return "chunk of message " + std::to_string(h.seq) + " carries " + std::to_string(h.len) +
           " bytes, only " + std::to_string(m.total - m.reserved) +
           " of it are not yet sent (duplicated or overlapping chunk)";
  m.reserved += h.len;
  return {};
}

}  // namespace rumor::netplugin::wire
