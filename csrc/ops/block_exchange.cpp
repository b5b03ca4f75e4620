#include "ops/block_exchange.h"

#include <algorithm>

namespace rumor::ops {

using net::make_recv;
using net::make_send;
using net::Transfer;

std::vector<size_t> split_blocks(size_t count, uint32_t n, size_t align) {
  if (n == 0) throw Error(ErrorKind::kInvalidArgument, "split_blocks: no ranks");
  align = std::max<size_t>(align, 1);
  const size_t units = (count + align - 1) / align;
  std::vector<size_t> counts(n, 0);
  size_t left = count;
  // The extra units go to the last blocks, so the one that ends short is one of the longer
  // ones: block sizes then differ by at most one unit.
  for (uint32_t j = 0; j < n; ++j) {
    const size_t u = units / n + (j >= n - units % n ? 1 : 0);
    counts[j] = std::min(left, u * align);
    left -= counts[j];
  }
  return counts;
}

size_t block_align(const compress::CodecParams& params) {
  if (params.chunk != 0) return params.chunk;
  // Codec defaults are not part of the interface: a granule that divides the usual power-of-two
  // chunk sizes keeps most chunks whole without knowing them.
  switch (params.kind) {
    case compress::Kind::kF16:
    case compress::Kind::kBF16:
      return 32;  // no chunks: only keep blocks cache-line aligned
    default:
      return 1024;
  }
}

std::vector<size_t> prefix(const std::vector<size_t>& v) {
  std::vector<size_t> off(v.size() + 1, 0);
  for (size_t i = 0; i < v.size(); ++i) off[i + 1] = off[i] + v[i];
  return off;
}

void scatter_to_owners(Communicator& comm, const net::OpInfo& op, const Blocks& b, const std::byte* wire,
                       std::byte* recv) {
  const uint32_t n = comm.size(), r = comm.rank();
  const auto& counts = b.counts;
  const auto& enc = b.enc;
  const auto& eoff = b.eoff;
  std::vector<Transfer> ts;
  ts.reserve(2 * n);
  for (uint32_t s = 1; s < n; ++s) {
    const uint32_t to = (r + s) % n, from = (r + n - s) % n;
    if (counts[to] > 0) ts.push_back(make_send(to, wire + eoff[to], enc[to]));
    if (counts[r] > 0) ts.push_back(make_recv(from, recv + peer_slot(from, r) * enc[r], enc[r]));
  }
  comm.exchange(ts, op);
}

void gather_from_owners(Communicator& comm, const net::OpInfo& op, const Blocks& b, std::byte* wire) {
  const uint32_t n = comm.size(), r = comm.rank();
  const auto& counts = b.counts;
  const auto& enc = b.enc;
  const auto& eoff = b.eoff;
  std::vector<Transfer> ts;
  ts.reserve(2 * n);
  for (uint32_t s = 1; s < n; ++s) {
    const uint32_t to = (r + s) % n, from = (r + n - s) % n;
    if (counts[r] > 0) ts.push_back(make_send(to, wire + eoff[r], enc[r]));
    if (counts[from] > 0) ts.push_back(make_recv(from, wire + eoff[from], enc[from]));
  }
  comm.exchange(ts, op);
}

}  // namespace rumor::ops
