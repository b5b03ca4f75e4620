// The first bytes on every TCP connection. The connecting side sends a Hello; the accepting
// side checks magic, protocol version and the job token before the socket joins any
// communicator, and answers with kAccept. Anything else is closed, logged and forgotten.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>

namespace rumor::net {

constexpr uint32_t kProtocolVersion = 1;
constexpr size_t kTokenBytes = 16;
using Token = std::array<uint8_t, kTokenBytes>;

struct Hello {
  char magic[8];
  uint32_t version;
  uint32_t rank;     // sender's world rank
  uint64_t comm_id;  // which communicator the stream belongs to
  uint32_t stream;   // stream index within the peer pair
  uint32_t reserved;
  uint8_t token[kTokenBytes];
  uint8_t pad[16];
};
static_assert(sizeof(Hello) == 64);

constexpr char kHelloMagic[8] = {'R', 'U', 'M', 'O', 'R', 'H', 'S', '1'};
constexpr char kAccept[8] = {'R', 'U', 'M', 'O', 'R', 'O', 'K', '1'};

inline Hello make_hello(const Token& token, uint32_t rank, uint64_t comm_id, uint32_t stream) {
  Hello h{};
  std::memcpy(h.magic, kHelloMagic, 8);
  h.version = kProtocolVersion;
  h.rank = rank;
  h.comm_id = comm_id;
  h.stream = stream;
  std::memcpy(h.token, token.data(), kTokenBytes);
  return h;
}

}  // namespace rumor::net
