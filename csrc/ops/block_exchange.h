// The exchange both compressed allreduces (ops/compressed_allreduce.h, ops/onebit_allreduce.h)
// are built from: the buffer is split into one block per rank; every rank sends its encoding of
// block j to rank j (the block's owner), the owner reduces and re-encodes it, and the owners'
// encodings go to everyone. Shared so that the two cannot drift apart in how they cut blocks or
// order their messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "compress/codec.h"

namespace rumor::ops {

// Frame opcodes of the compressed collectives (beyond the communicator's own), kept in one list
// so that they stay distinct.
constexpr Opcode kCompressedAllreduceOpcode = static_cast<Opcode>(40);
constexpr Opcode kOneBitAllreduceOpcode = static_cast<Opcode>(41);

// Splits count elements into n blocks whose boundaries fall on multiples of `align` elements
// (the codec's chunk: a chunk cut in two would carry two headers and two scales). Block sizes
// differ by at most `align`; the last non-empty block takes the remainder.
std::vector<size_t> split_blocks(size_t count, uint32_t n, size_t align);

// Elements per block boundary for a codec: its chunk, or a fixed granule for codecs without one.
size_t block_align(const compress::CodecParams& params);

// Offsets of consecutive pieces of the given sizes, with the total as the last entry.
std::vector<size_t> prefix(const std::vector<size_t>& v);

// Slot of peer q among the n-1 peers of rank r (receive buffers hold one slot per peer).
inline size_t peer_slot(uint32_t q, uint32_t r) { return q < r ? q : q - 1; }

// The split of a buffer into one block per rank, and where each block's encoding lives: block
// j holds counts[j] elements from element off[j]; its encoding takes enc[j] bytes at eoff[j] of
// the wire buffer (encodings back to back).
struct Blocks {
  std::vector<size_t> counts, off, enc, eoff;
  Blocks(size_t count, uint32_t n, size_t align, const compress::Codec& codec)
      : counts(split_blocks(count, n, align)), off(prefix(counts)), enc(n) {
    for (uint32_t j = 0; j < n; ++j) enc[j] = counts[j] > 0 ? codec.encoded_bytes(counts[j]) : 0;
    eoff = prefix(enc);
  }
  size_t wire_bytes() const { return eoff.back(); }
};

// First every block's encoding goes to its owner: this rank sends block j to rank j and
// receives each peer's encoding of its own block into recv, at peer_slot(peer).
void scatter_to_owners(Communicator& comm, const net::OpInfo& op, const Blocks& b, const std::byte* wire,
                       std::byte* recv);

// Then each owner's reduced, re-encoded block goes to everyone (an allgather of encodings).
void gather_from_owners(Communicator& comm, const net::OpInfo& op, const Blocks& b, std::byte* wire);

}  // namespace rumor::ops
