// sources: csrc/net/auth.cpp csrc/net/handshake.cpp
// libFuzzer target for the handshake's byte handling (net/handshake.h): arbitrary bytes, cut
// into arbitrary pieces, go to the accepting side's state machine and to the dialing side's
// reply check; an honest exchange is replayed alongside to check that it still authenticates.
// Build (run from the repository root; the line above lists the sources a script compiles):
//   clang++-14 -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Icsrc \
//     tests/fuzz/fuzz_handshake.cpp csrc/net/auth.cpp csrc/net/handshake.cpp -lcrypto -pthread \
//     -o /tmp/fuzz_handshake && /tmp/fuzz_handshake -max_total_time=60
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "net/auth.h"
#include "net/handshake.h"

namespace {

using rumor::net::ServerHandshake;

struct Input {
  const uint8_t* p;
  size_t n;
  uint8_t byte() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
};

rumor::net::Nonce nonce_from(Input& in) {
  rumor::net::Nonce x{};
  for (auto& b : x) b = in.byte();
  return x;
}

void check(bool ok) {
  if (!ok) std::abort();
}

// The state machine's own invariants, whatever it was fed.
void check_invariants(const ServerHandshake& s) {
  check(s.wanted() <= rumor::net::kHelloBytes);
  check(s.output().size() <= rumor::net::kChallengeBytes + rumor::net::kReplyBytes);
  if (s.state() == ServerHandshake::State::kFailed) check(!s.error().empty() && s.output().empty());
  if (s.state() == ServerHandshake::State::kAuthenticated || s.state() == ServerHandshake::State::kAccepted)
    check(s.error().empty());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const rumor::net::Key key = [] {
    rumor::net::Key k{};
    for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<uint8_t>(0xA5 ^ i);
    return k;
  }();
  Input in{data, size};
  const uint8_t mode = in.byte();
  const uint32_t world = 1 + in.byte() % 8;
  const uint32_t server_rank = in.byte() % world;
  const rumor::net::Nonce server_nonce = nonce_from(in);

  if (mode % 3 == 0) {
    // Hostile client: the rest of the input is its byte stream, in chunks it chooses.
    ServerHandshake s(key, server_rank, world, server_nonce);
    while (in.n > 0) {
      const size_t chunk = std::min<size_t>(in.n, 1 + in.byte() % 80);
      const size_t used = s.feed({in.p, std::min(chunk, in.n)});
      check(used <= chunk);
      in.p += used;
      in.n -= used;
      check_invariants(s);
      if (!s.output().empty()) s.sent(in.byte() % (s.output().size() + 1));
      if (s.state() == ServerHandshake::State::kAuthenticated) {
        // Without the key a stranger authenticates only by guessing a 256-bit MAC.
        (in.byte() & 1) ? s.accept() : s.fail("already claimed");
      }
      if (used == 0 && s.wanted() == 0) break;
    }
    return 0;
  }

  // An honest client, fields from the input, so the success path is explored too.
  rumor::net::Hello h;
  h.rank = in.byte() % (world + 1);
  h.comm_id = static_cast<uint64_t>(in.byte()) << 40 | in.byte();
  h.stream = in.byte() % 4;
  h.nonce = nonce_from(in);
  ServerHandshake s(key, server_rank, world, server_nonce);
  const auto hello = rumor::net::encode_hello(h);
  check(s.feed(hello) == hello.size());
  check_invariants(s);
  const bool valid_claim = h.rank < world && h.rank > server_rank;
  check(valid_claim == (s.state() == ServerHandshake::State::kProof));
  if (!valid_claim) return 0;
  check(rumor::net::decode_hello(hello).has_value());

  if (mode % 3 == 1) {
    // The dialer's check of a reply: the honest challenge with input bytes XORed in.
    auto out = s.output();
    std::array<uint8_t, rumor::net::kChallengeBytes> reply{};
    std::memcpy(reply.data(), out.data(), out.size());
    bool changed = false;
    for (auto& b : reply) {
      const uint8_t x = in.byte();
      changed |= x != 0;
      b ^= x;
    }
    const size_t len = in.byte() % 2 ? reply.size() : in.byte() % reply.size();
    rumor::net::Nonce sn{};
    uint32_t sr = 0;
    std::string why;
    const auto r = rumor::net::check_challenge(key, h, {reply.data(), len}, server_rank, &sn, &sr, &why);
    if (!changed && len == reply.size()) check(r == rumor::net::ChallengeResult::kOk && sn == server_nonce);
    if (r != rumor::net::ChallengeResult::kOk) check(!why.empty());
    return 0;
  }

  // mode 2: the honest proof, possibly corrupted; only the exact one may authenticate.
  auto proof =
      rumor::net::encode_proof(rumor::net::handshake_proof(key, false, h, server_nonce, server_rank));
  bool changed = false;
  for (auto& b : proof) {
    const uint8_t x = in.byte();
    changed |= x != 0;
    b ^= x;
  }
  s.sent(s.output().size());
  s.feed(proof);
  check_invariants(s);
  check(changed == (s.state() == ServerHandshake::State::kFailed));
  return 0;
}
