// The first bytes on every TCP connection: a mutual HMAC challenge-response under the job's
// connection key (net/auth.h), binding both ranks, the communicator, the stream and each side's
// role. Only after it does a socket join a communicator. Layout, v2 (integers little-endian):
//
//   client -> server  Hello      64 B  "RUMORHS1" version rank comm_id(u64) stream flags(=0)
//                                       client_nonce[32]
//   server -> client  Challenge  80 B  "RUMORCH2" version server_rank server_nonce[32]
//                                       server_proof[32]
//   client -> server  Proof      40 B  "RUMORPF2" client_proof[32]
//   server -> client  Accept      8 B  "RUMOROK2"
//
//   transcript   = client_nonce | server_nonce | version | client rank | comm_id | stream |
//                  server rank                                  (88 bytes, fixed layout)
//   server_proof = HMAC-SHA256(key, "rumor/v2 server\0" | transcript)
//   client_proof = HMAC-SHA256(key, "rumor/v2 client\0" | transcript)
//
// The labels differ, so a proof cannot be reflected back to its sender; each side's fresh nonce
// is in the transcript, so a recorded proof fails on any other connection. A listener that drops
// a connection still in its handshake because too many are pending sends "RUMORBSY" first: the
// dialer retries (a refusal for any other reason is a bare close, telling a stranger nothing).
//
// This file is pure: parsing and checking over bytes, no sockets (tests/fuzz drives it).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "net/auth.h"

namespace rumor::net {

constexpr uint32_t kProtocolVersion = 2;
constexpr size_t kTokenBytes = 16;
// The public session id of a job (names its shared-memory segments); proves nothing.
using Token = std::array<uint8_t, kTokenBytes>;

constexpr size_t kHelloBytes = 64;
constexpr size_t kChallengeBytes = 80;
constexpr size_t kProofBytes = 40;
constexpr size_t kReplyBytes = 8;  // Accept or Busy

// v1's magic, kept so that a v1 listener reports "protocol version 2, expected 1".
constexpr char kHelloMagic[8] = {'R', 'U', 'M', 'O', 'R', 'H', 'S', '1'};
constexpr char kChallengeMagic[8] = {'R', 'U', 'M', 'O', 'R', 'C', 'H', '2'};
constexpr char kProofMagic[8] = {'R', 'U', 'M', 'O', 'R', 'P', 'F', '2'};
constexpr char kAccept[8] = {'R', 'U', 'M', 'O', 'R', 'O', 'K', '2'};
constexpr char kBusy[8] = {'R', 'U', 'M', 'O', 'R', 'B', 'S', 'Y'};

struct Hello {
  uint32_t version = kProtocolVersion;
  uint32_t rank = 0;     // the dialer's world rank
  uint64_t comm_id = 0;  // which communicator the stream belongs to
  uint32_t stream = 0;   // stream index within the peer pair
  uint32_t flags = 0;
  Nonce nonce{};
};

std::array<uint8_t, kHelloBytes> encode_hello(const Hello& h);
// Layout only (magic, size); the values are checked by ServerHandshake.
std::optional<Hello> decode_hello(std::span<const uint8_t> bytes);

// HMAC of the transcript under the label of `server` (true) or client role.
Mac handshake_proof(const Key& key, bool server, const Hello& hello, const Nonce& server_nonce,
                    uint32_t server_rank);

// The accepting side, as a state machine over bytes. The listener moves bytes between it and
// a non-blocking socket; feed() never waits and never reads past what the handshake needs.
class ServerHandshake {
 public:
  enum class State {
    kHello,          // waiting for the Hello
    kProof,          // Challenge queued or sent; waiting for the client's Proof
    kAuthenticated,  // the client proved the key: the owner decides (accept() or a refusal)
    kAccepted,       // Accept queued: complete once output() is empty
    kFailed,         // error() says why; close the connection
  };

  ServerHandshake(const Key& key, uint32_t server_rank, uint32_t world_size, const Nonce& server_nonce);

  // Bytes the state machine can use next (0 when it is waiting for the owner or done).
  size_t wanted() const;
  // Consumes up to wanted() bytes of `in`; returns how many it consumed.
  size_t feed(std::span<const uint8_t> in);
  // Bytes to send to the client, in order; the owner reports what it sent with sent().
  std::span<const uint8_t> output() const { return {out_.data() + out_pos_, out_.size() - out_pos_}; }
  void sent(size_t n);
  void accept();
  void fail(std::string why);

  State state() const { return state_; }
  const std::string& error() const { return error_; }
  // Valid from kProof on.
  const Hello& hello() const { return hello_; }

 private:
  const Key* key_;  // outlives the handshake (the listener's)
  uint32_t server_rank_;
  uint32_t world_size_;
  Nonce server_nonce_;
  State state_ = State::kHello;
  std::array<uint8_t, kHelloBytes> in_{};  // the larger of Hello and Proof
  size_t got_ = 0;
  Hello hello_{};
  std::vector<uint8_t> out_;
  size_t out_pos_ = 0;
  std::string error_;
};

// The dialing side's checks, also pure. check_challenge returns the server's nonce, or nullopt
// with *why set (a sentence naming what was expected). expected_server_rank: nullopt accepts any
// rank (a probe that does not know whom it reached).
enum class ChallengeResult { kOk, kBusy, kRefused };
ChallengeResult check_challenge(const Key& key, const Hello& hello, std::span<const uint8_t> reply,
                                std::optional<uint32_t> expected_server_rank, Nonce* server_nonce,
                                uint32_t* server_rank, std::string* why);
std::array<uint8_t, kProofBytes> encode_proof(const Mac& proof);

}  // namespace rumor::net
