#include "net/handshake.h"

#include <algorithm>
#include <utility>

namespace rumor::net {

namespace {

constexpr char kServerLabel[16] = {'r', 'u', 'm', 'o', 'r', '/', 'v', '2',
                                   ' ', 's', 'e', 'r', 'v', 'e', 'r', '\0'};
constexpr char kClientLabel[16] = {'r', 'u', 'm', 'o', 'r', '/', 'v', '2',
                                   ' ', 'c', 'l', 'i', 'e', 'n', 't', '\0'};
constexpr size_t kTranscriptBytes = 2 * kNonceBytes + 4 + 4 + 8 + 4 + 4;

void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

std::span<const uint8_t> bytes_of(const char (&s)[16]) { return {reinterpret_cast<const uint8_t*>(s), 16}; }

}  // namespace

std::array<uint8_t, kHelloBytes> encode_hello(const Hello& h) {
  std::array<uint8_t, kHelloBytes> b{};
  std::memcpy(b.data(), kHelloMagic, 8);
  put32(&b[8], h.version);
  put32(&b[12], h.rank);
  put64(&b[16], h.comm_id);
  put32(&b[24], h.stream);
  put32(&b[28], h.flags);
  std::memcpy(&b[32], h.nonce.data(), kNonceBytes);
  return b;
}

std::optional<Hello> decode_hello(std::span<const uint8_t> b) {
  if (b.size() != kHelloBytes || std::memcmp(b.data(), kHelloMagic, 8) != 0) return std::nullopt;
  Hello h;
  h.version = get32(&b[8]);
  h.rank = get32(&b[12]);
  h.comm_id = get64(&b[16]);
  h.stream = get32(&b[24]);
  h.flags = get32(&b[28]);
  std::memcpy(h.nonce.data(), &b[32], kNonceBytes);
  return h;
}

Mac handshake_proof(const Key& key, bool server, const Hello& hello, const Nonce& server_nonce,
                    uint32_t server_rank) {
  std::array<uint8_t, kTranscriptBytes> t{};
  uint8_t* p = t.data();
  std::memcpy(p, hello.nonce.data(), kNonceBytes);
  p += kNonceBytes;
  std::memcpy(p, server_nonce.data(), kNonceBytes);
  p += kNonceBytes;
  put32(p, hello.version);
  put32(p + 4, hello.rank);
  put64(p + 8, hello.comm_id);
  put32(p + 16, hello.stream);
  put32(p + 20, server_rank);
  return hmac_sha256(key, bytes_of(server ? kServerLabel : kClientLabel), t);
}

ServerHandshake::ServerHandshake(const Key& key, uint32_t server_rank, uint32_t world_size,
                                 const Nonce& server_nonce)
    : key_(&key), server_rank_(server_rank), world_size_(world_size), server_nonce_(server_nonce) {}

size_t ServerHandshake::wanted() const {
  switch (state_) {
    case State::kHello:
      return kHelloBytes - got_;
    case State::kProof:
      return kProofBytes - got_;
    default:
      return 0;
  }
}

void ServerHandshake::fail(std::string why) {
  state_ = State::kFailed;
  error_ = std::move(why);
  out_.clear();
  out_pos_ = 0;
}

void ServerHandshake::sent(size_t n) { out_pos_ = std::min(out_.size(), out_pos_ + n); }

void ServerHandshake::accept() {
  if (state_ != State::kAuthenticated) return;
  out_.insert(out_.end(), kAccept, kAccept + sizeof(kAccept));
  state_ = State::kAccepted;
}

size_t ServerHandshake::feed(std::span<const uint8_t> in) {
  const size_t n = std::min(in.size(), wanted());
  if (n == 0) return 0;
  std::memcpy(in_.data() + got_, in.data(), n);
  const size_t before = got_;
  got_ += n;
  if (state_ == State::kHello) {
    // Garbage is refused as soon as its first bytes differ from the magic, before it can hold a
    // slot for the whole handshake deadline.
    const size_t seen = std::min<size_t>(got_, 8);
    if (before < 8 && std::memcmp(in_.data(), kHelloMagic, seen) != 0) {
      fail("bad magic (not a rumor peer)");
      return n;
    }
    if (got_ < kHelloBytes) return n;
    hello_ = *decode_hello({in_.data(), kHelloBytes});
    got_ = 0;
    if (hello_.version != kProtocolVersion) {
      fail("protocol version " + std::to_string(hello_.version) + ", expected " +
           std::to_string(kProtocolVersion));
    } else if (hello_.flags != 0) {
      fail("unknown hello flags " + std::to_string(hello_.flags));
    } else if (hello_.rank >= world_size_) {
      fail("claims rank " + std::to_string(hello_.rank) + ", outside a world of " +
           std::to_string(world_size_));
    } else if (hello_.rank <= server_rank_) {
      // The higher rank of a pair dials: a lower (or equal) rank never connects here.
      fail("claims rank " + std::to_string(hello_.rank) + ", which never dials rank " +
           std::to_string(server_rank_));
    } else {
      std::array<uint8_t, kChallengeBytes> c{};
      std::memcpy(c.data(), kChallengeMagic, 8);
      put32(&c[8], kProtocolVersion);
      put32(&c[12], server_rank_);
      std::memcpy(&c[16], server_nonce_.data(), kNonceBytes);
      const Mac proof = handshake_proof(*key_, true, hello_, server_nonce_, server_rank_);
      std::memcpy(&c[48], proof.data(), kMacBytes);
      out_.assign(c.begin(), c.end());
      out_pos_ = 0;
      state_ = State::kProof;
    }
    return n;
  }
  // kProof
  if (got_ < kProofBytes) return n;
  if (std::memcmp(in_.data(), kProofMagic, 8) != 0) {
    fail("sent something other than a proof after its hello");
    return n;
  }
  const Mac expected = handshake_proof(*key_, false, hello_, server_nonce_, server_rank_);
  if (!mac_equal(expected, {in_.data() + 8, kMacBytes})) {
    fail("its proof did not match the job key (a different RUMOR_JOB_SECRET, or a replayed or forged proof)");
    return n;
  }
  got_ = 0;
  state_ = State::kAuthenticated;
  return n;
}

ChallengeResult check_challenge(const Key& key, const Hello& hello, std::span<const uint8_t> reply,
                                std::optional<uint32_t> expected_server_rank, Nonce* server_nonce,
                                uint32_t* server_rank, std::string* why) {
  if (reply.size() >= kReplyBytes && std::memcmp(reply.data(), kBusy, kReplyBytes) == 0) {
    *why = "the listener is busy with too many unauthenticated connections";
    return ChallengeResult::kBusy;
  }
  if (reply.size() != kChallengeBytes || std::memcmp(reply.data(), kChallengeMagic, 8) != 0) {
    *why = "the peer answered with something other than a rumor v2 challenge (an older rumor, or not rumor)";
    return ChallengeResult::kRefused;
  }
  const uint32_t version = get32(&reply[8]);
  const uint32_t rank = get32(&reply[12]);
  if (version != kProtocolVersion) {
    *why = "the peer speaks protocol version " + std::to_string(version) + ", expected " +
           std::to_string(kProtocolVersion);
    return ChallengeResult::kRefused;
  }
  if (expected_server_rank && rank != *expected_server_rank) {
    *why = "reached rank " + std::to_string(rank) + ", expected rank " +
           std::to_string(*expected_server_rank) + " (a stale address?)";
    return ChallengeResult::kRefused;
  }
  Nonce sn{};
  std::memcpy(sn.data(), &reply[16], kNonceBytes);
  const Mac expected = handshake_proof(key, true, hello, sn, rank);
  if (!mac_equal(expected, reply.subspan(48, kMacBytes))) {
    *why = "the peer's proof did not match the job key (different RUMOR_JOB_SECRET?)";
    return ChallengeResult::kRefused;
  }
  *server_nonce = sn;
  *server_rank = rank;
  return ChallengeResult::kOk;
}

std::array<uint8_t, kProofBytes> encode_proof(const Mac& proof) {
  std::array<uint8_t, kProofBytes> b{};
  std::memcpy(b.data(), kProofMagic, 8);
  std::memcpy(b.data() + 8, proof.data(), kMacBytes);
  return b;
}

}  // namespace rumor::net
