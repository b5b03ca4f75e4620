#include "net/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>
#include <string_view>

#include "core/types.h"

namespace rumor::net {

Key unauthenticated_key(std::span<const uint8_t> token) {
  constexpr std::string_view kLabel = "rumor/unauthenticated";
  Key k{};
  unsigned int len = 0;
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  bool ok = ctx != nullptr && EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) == 1 &&
            EVP_DigestUpdate(ctx, kLabel.data(), kLabel.size()) == 1 &&
            EVP_DigestUpdate(ctx, token.data(), token.size()) == 1 &&
            EVP_DigestFinal_ex(ctx, k.data(), &len) == 1 && len == k.size();
  EVP_MD_CTX_free(ctx);
  if (!ok) throw Error(ErrorKind::kSystem, "SHA-256 of the job token failed (libcrypto)");
  return k;
}

Mac hmac_sha256(const Key& key, std::span<const uint8_t> a, std::span<const uint8_t> b) {
  Mac m{};
  unsigned int len = 0;
  // One-shot HMAC() cannot take two parts without a copy, and the EVP_MAC API is OpenSSL 3 only:
  // the HMAC_CTX calls work on 1.1 and 3.x alike.
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
  HMAC_CTX* ctx = HMAC_CTX_new();
  bool ok = ctx != nullptr &&
            HMAC_Init_ex(ctx, key.data(), static_cast<int>(key.size()), EVP_sha256(), nullptr) == 1 &&
            HMAC_Update(ctx, a.data(), a.size()) == 1 && HMAC_Update(ctx, b.data(), b.size()) == 1 &&
            HMAC_Final(ctx, m.data(), &len) == 1 && len == m.size();
  HMAC_CTX_free(ctx);
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
  if (!ok) throw Error(ErrorKind::kSystem, "HMAC-SHA256 failed (libcrypto)");
  return m;
}

bool mac_equal(const Mac& expected, std::span<const uint8_t> got) {
  if (got.size() != expected.size()) return false;
  return CRYPTO_memcmp(expected.data(), got.data(), expected.size()) == 0;
}

Nonce random_nonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1)
    throw Error(ErrorKind::kSystem, "no random bytes for a handshake nonce (RAND_bytes failed)");
  return n;
}

}  // namespace rumor::net
