// The cryptographic primitives of the connection handshake (net/handshake.h): HMAC-SHA256
// under the job's connection key, constant-time comparison and fresh nonces, all from OpenSSL's
// libcrypto. Nothing here touches a socket.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace rumor::net {

constexpr size_t kKeyBytes = 32;
constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
// The secret every connection proves (both directions). Python derives it from the job secret;
// without one it is unauthenticated_key(token), which anyone who knows the token can compute.
using Key = std::array<uint8_t, kKeyBytes>;
using Nonce = std::array<uint8_t, kNonceBytes>;
using Mac = std::array<uint8_t, kMacBytes>;

// SHA-256("rumor/unauthenticated" || token): the key of a job that has no secret, so that the
// handshake has one shape whether or not the job is authenticated.
Key unauthenticated_key(std::span<const uint8_t> token);

// HMAC-SHA256(key, a || b): two parts so that a label and a transcript need no joined copy.
Mac hmac_sha256(const Key& key, std::span<const uint8_t> a, std::span<const uint8_t> b);

// Constant time in the contents: a forged proof learns nothing from how long a refusal takes.
bool mac_equal(const Mac& expected, std::span<const uint8_t> got);

// kNonceBytes from the OS's CSPRNG; throws Error(kSystem) if it has none.
Nonce random_nonce();

}  // namespace rumor::net
