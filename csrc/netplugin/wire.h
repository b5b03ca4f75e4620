// The NCCL net plugin's wire format and the checks on what a peer sends, as pure functions over
// bytes (no sockets, no plugin state), so they can be fuzzed (tests/fuzz/fuzz_frames.cpp).
//
// Setup of one stream (connector C dials acceptor A; see docs/netplugin.md):
//   C -> A  Hello      listen id (from NCCL's handle), connection id, stream, nonce_c
//   A -> C  Challenge  nonce_a, mac_a = HMAC(key, "A" | hello | nonce_a)
//   C -> A  Proof      mac_c = HMAC(key, "C" | hello | nonce_a)
// Each side proves the job key over both fresh nonces, bound to the listen id, the connection,
// the stream and the role, so neither a recorded exchange nor the other side's MAC can be
// replayed. Without a job secret the MACs are zero and the flags say so; the two sides must agree
// on whether they authenticate.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace rumor::netplugin::wire {

constexpr uint32_t kHandleMagic = 0x524d4e50;     // "RMNP"
constexpr uint32_t kHelloMagic = 0x524d4e48;      // "RMNH"
constexpr uint32_t kChallengeMagic = 0x524d4e41;  // "RMNA"
constexpr uint32_t kProofMagic = 0x524d4e56;      // "RMNV"
constexpr uint32_t kChunkMagic = 0x524d4e43;      // "RMNC"
constexpr uint16_t kProtocolVersion = 2;
constexpr uint16_t kFlagAuth = 1;  // the sender holds a job key and proves it
constexpr uint16_t kMaxStreams = 64;
// test() reports sizes as int in every NCCL net API version, and NCCL never hands a net plugin
// more than 1 GiB: a larger total can only come from a corrupt or hostile peer.
constexpr uint64_t kMaxMessageBytes = 0x7fffffff;

using Id = std::array<uint8_t, 16>;
using Nonce = std::array<uint8_t, 16>;
using Mac = std::array<uint8_t, 32>;
using Key = std::array<uint8_t, 32>;

struct Hello {
  uint32_t magic;
  uint16_t version;
  uint16_t stream;
  uint16_t nstreams;
  uint16_t flags;
  uint32_t pad;
  uint64_t conn_id;  // groups the streams of one connection
  Id listen_id;      // from the handle
  Nonce nonce;       // connector's, fresh per stream
};
static_assert(sizeof(Hello) == 56);

struct Challenge {
  uint32_t magic;
  uint16_t flags;
  uint16_t pad;
  Nonce nonce;  // acceptor's, fresh per stream
  Mac mac;      // acceptor's proof
};
static_assert(sizeof(Challenge) == 56);

struct Proof {
  uint32_t magic;
  uint32_t pad;
  Mac mac;  // connector's proof
};
static_assert(sizeof(Proof) == 40);

// Precedes every chunk. A message always sends at least one chunk (a 0-byte one for size 0).
struct ChunkHeader {
  uint32_t magic;
  int32_t tag;
  uint64_t seq;     // message number on this connection, from 0
  uint64_t total;   // message size
  uint64_t offset;  // of this chunk in the message
  uint64_t len;     // of this chunk
};
static_assert(sizeof(ChunkHeader) == 40);

// Fills `len` bytes from the kernel's CSPRNG (getrandom); false if it failed.
bool random_bytes(void* out, size_t len);

// key = HMAC-SHA256(secret, "rumor/netplugin/v1").
Key derive_key(std::string_view secret);

// Empty when `h` greets listener `listen_id` as a stream of this protocol; else why not.
std::string check_hello(const Hello& h, const Id& listen_id);

// The MAC `role` ('A' acceptor, 'C' connector) proves the key with, over the hello (listen id,
// connection, stream, stream count, flags, connector nonce) and the acceptor's nonce.
Mac hello_mac(const Key& key, char role, const Hello& h, const Nonce& acceptor_nonce);
bool mac_equal(const Mac& a, const Mac& b);  // constant time

// Empty when a chunk header is self-consistent (magic, total within kMaxMessageBytes, the chunk
// inside the message); else what is wrong. Checked before the header's numbers are used at all.
std::string check_chunk(const ChunkHeader& h);

// What the receiver knows of a message once it was matched to a buffer.
struct MessageBook {
  uint64_t total = 0;
  int32_t tag = 0;
  uint64_t reserved = 0;  // bytes claimed by admitted chunks (placed or still arriving)
  uint64_t received = 0;  // bytes that arrived
};

// Admits a checked chunk to its matched message: the same total and tag, and no more bytes than
// the message has left unclaimed (so duplicated or overlapping chunks cannot complete a message
// twice or write past it). Reserves the chunk's bytes on success; else returns what is wrong.
std::string admit_chunk(MessageBook& m, const ChunkHeader& h);

}  // namespace rumor::netplugin::wire
