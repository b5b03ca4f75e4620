#include "ops/compressed_allreduce.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace rumor::ops {

using net::make_recv;
using net::make_send;
using net::Transfer;

namespace {

uint64_t mix(uint64_t x) {
  // splitmix64's finalizer: consecutive inputs give unrelated outputs.
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

bool codec_dtype(DType t) {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::F64;
}

void to_f32(const std::byte* src, DType dtype, float* dst, size_t n) {
  switch (dtype) {
    case DType::F32:
      if (n > 0) std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::F16: {
      const auto* s = reinterpret_cast<const _Float16*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    case DType::BF16: {
      const auto* s = reinterpret_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) {
        uint32_t u = static_cast<uint32_t>(s[i]) << 16;
        std::memcpy(&dst[i], &u, sizeof(float));
      }
      return;
    }
    case DType::F64: {
      const auto* s = reinterpret_cast<const double*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    default:
      throw Error(ErrorKind::kInvalidArgument, "compressed allreduce: unsupported dtype");
  }
}

std::vector<size_t> prefix(const std::vector<size_t>& v) {
  std::vector<size_t> off(v.size() + 1, 0);
  for (size_t i = 0; i < v.size(); ++i) off[i + 1] = off[i] + v[i];
  return off;
}

// Slot of peer q among the n-1 peers of rank r (receive buffers hold one slot per peer).
size_t peer_slot(uint32_t q, uint32_t r) { return q < r ? q : q - 1; }

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

// Then each owner's reduced, re-encoded block goes to everyone (an allgather of encodings).
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

std::string kind_name(compress::Kind k) {
  switch (k) {
    case compress::Kind::kMinMaxU8:
      return "minmax-u8";
    case compress::Kind::kQSGD:
      return "qsgd";
    case compress::Kind::kSign:
      return "sign";
    case compress::Kind::kF16:
      return "f16";
    case compress::Kind::kBF16:
      return "bf16";
  }
  return "?";
}

}  // namespace

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

uint64_t encode_seed(uint64_t base, uint64_t step, uint32_t rank, uint32_t block, uint32_t phase) {
  uint64_t h = mix(base);
  h = mix(h ^ step);
  h = mix(h ^ ((static_cast<uint64_t>(rank) << 32) | block));
  return mix(h ^ phase);
}

size_t pipeline_piece(const compress::CodecParams& params, size_t count, uint32_t n, size_t piece_elements) {
  if (piece_elements == 0) return 0;
  const size_t align = block_align(params);
  const size_t piece = align * std::max<size_t>(1, piece_elements / align);
  const auto counts = split_blocks(count, n, align);
  return *std::max_element(counts.begin(), counts.end()) > piece ? piece : 0;
}

uint64_t piece_seed(uint64_t block_seed, size_t piece) {
  return piece == 0 ? block_seed : mix(block_seed ^ mix(static_cast<uint64_t>(piece)));
}

// ---- CompressedAllreduce ----------------------------------------------------------------------

CompressedAllreduce::CompressedAllreduce(const compress::CodecParams& params, bool average, bool hierarchical,
                                         uint64_t seed)
    : params_(params),
      codec_(compress::make_codec(params)),
      average_(average),
      hierarchical_(hierarchical),
      seed_(seed) {}

void CompressedAllreduce::run(Communicator& comm, void* buf, size_t count, DType dtype) {
  net::OpInfo op = comm.begin_op("compressed allreduce", kCompressedAllreduceOpcode);
  op.bytes = static_cast<int64_t>(count * dtype_size(dtype));
  op.algo = hierarchical_ ? "hierarchical" : "reduce-scatter + allgather";
  if (!codec_dtype(dtype))
    throw Error(ErrorKind::kInvalidArgument, op.where() + ": " + codec_->name() + " cannot encode " +
                                                 std::string(dtype_name(dtype)) +
                                                 " (expected float32, float16, bfloat16 or float64)");
  const uint64_t step = calls_++;
  if (comm.size() == 1) return;  // nothing to exchange: the input is the result
  auto* b = static_cast<std::byte*>(buf);
  if (hierarchical_ && comm.all_local()) {
    // One host: nothing would be compressed, and a plain allreduce beats reduce + broadcast.
    comm.allreduce(b, count, dtype, average_ ? ReduceOp::AVG : ReduceOp::SUM);
    return;
  }
  const double divisor = average_ ? static_cast<double>(comm.size()) : 1.0;
  comm.run_guarded(op, [&] {
    if (!hierarchical_) {
      flat(comm, b, count, dtype, divisor, step, op);
      return;
    }
    Communicator& local = comm.local_comm();
    local.reduce(b, count, dtype, ReduceOp::SUM, 0);
    // Several hosts (checked above), so the leaders' group has at least two members.
    if (Communicator* leaders = comm.leaders_comm()) {
      net::OpInfo lop = leaders->begin_op("compressed allreduce (host leaders)", kCompressedAllreduceOpcode);
      leaders->run_guarded(lop, [&] { flat(*leaders, b, count, dtype, divisor, step, lop); });
    }
    local.broadcast(b, count, dtype, 0);
  });
}

void CompressedAllreduce::flat(Communicator& comm, std::byte* buf, size_t count, DType dtype, double divisor,
                               uint64_t step, const net::OpInfo& op) {
  const uint32_t n = comm.size(), r = comm.rank();
  const size_t es = dtype_size(dtype);
  // Pieces start on chunk boundaries of their block, so each chunk is encoded exactly as in one
  // piece: the result is bit for bit the unpipelined one, except for QSGD (see piece_seed).
  // The default piece, 1 MiB of float32, is small enough that codec work on one piece hides
  // behind the transfer of the next and large enough that per-piece headers cost nothing.
  if (const size_t piece = pipeline_piece(params_, count, n, piece_); piece != 0) {
    pipelined(comm, buf, count, dtype, divisor, step, op, piece);
    return;
  }
  const Blocks blocks(count, n, block_align(params_), *codec_);
  const auto& counts = blocks.counts;
  const auto& off = blocks.off;
  const auto& enc = blocks.enc;
  const auto& eoff = blocks.eoff;
  // One slot per block: in the reduce-scatter slot j carries our contribution to block j; once
  // it is sent, the allgather reuses the slots for the reduced blocks.
  send_.resize(blocks.wire_bytes());
  recv_.resize(static_cast<size_t>(n - 1) * enc[r]);
  std::byte* wire = send_.data();

  for (uint32_t j = 0; j < n; ++j)
    if (j != r && counts[j] > 0)
      codec_->encode(buf + off[j] * es, counts[j], dtype, wire + eoff[j], enc[j],
                     encode_seed(seed_, step, r, j, 0));
  scatter_to_owners(comm, op, blocks, wire, recv_.data());

  if (counts[r] > 0) {
    // Our own contribution enters at full precision; the peers' through their encodings, added
    // in rank order.
    acc_.resize(counts[r]);
    to_f32(buf + off[r] * es, dtype, acc_.data(), counts[r]);
    for (uint32_t q = 0; q < n; ++q)
      if (q != r)
        codec_->decode(recv_.data() + peer_slot(q, r) * enc[r], enc[r], acc_.data(), counts[r], DType::F32,
                       true);
    if (divisor != 1.0) {
      const auto d = static_cast<float>(divisor);
      for (float& v : acc_) v /= d;
    }
    codec_->encode(acc_.data(), counts[r], DType::F32, wire + eoff[r], enc[r],
                   encode_seed(seed_, step, r, r, 1));
  }

  gather_from_owners(comm, op, blocks, wire);
  // The owner decodes its block from the bytes it sent too, so every rank holds the same bits.
  for (uint32_t j = 0; j < n; ++j)
    if (counts[j] > 0) codec_->decode(wire + eoff[j], enc[j], buf + off[j] * es, counts[j], dtype, false);
}

void CompressedAllreduce::pipelined(Communicator& comm, std::byte* buf, size_t count, DType dtype,
                                    double divisor, uint64_t step, const net::OpInfo& op, size_t piece) {
  const uint32_t n = comm.size(), r = comm.rank();
  const size_t es = dtype_size(dtype);
  const Blocks blocks(count, n, block_align(params_), *codec_);
  const auto& counts = blocks.counts;
  const auto& off = blocks.off;
  // Block j in pieces: piece p holds plen(j, p) elements from off[j] + p * piece; its encoding
  // takes penc[j][p] bytes at pbyte[j][p] of the block's region (regions back to back at rbyte[j]).
  std::vector<size_t> pieces(n), region(n);
  std::vector<std::vector<size_t>> penc(n), pbyte(n);
  auto plen = [&](uint32_t j, size_t p) { return std::min(piece, counts[j] - p * piece); };
  for (uint32_t j = 0; j < n; ++j) {
    pieces[j] = (counts[j] + piece - 1) / piece;
    for (size_t p = 0; p < pieces[j]; ++p) {
      pbyte[j].push_back(region[j]);
      penc[j].push_back(codec_->encoded_bytes(plen(j, p)));
      region[j] += penc[j].back();
    }
  }
  const std::vector<size_t> rbyte = prefix(region);
  const size_t slots = *std::max_element(pieces.begin(), pieces.end());
  send_.resize(rbyte.back());      // our contributions to the peers' blocks
  gathered_.resize(rbyte.back());  // every block reduced, as its owner encoded it
  recv_.resize(static_cast<size_t>(n - 1) * region[r]);
  acc_.resize(std::min(piece, counts[r]));

  // Per peer and direction the messages go in one fixed order that both ends derive alike: in
  // slot t, piece t of the reduce-scatter, then piece t - 1 of the allgather. A send waits (held)
  // until its piece is encoded; receives are posted at once.
  std::vector<Transfer> ts;
  std::vector<std::vector<size_t>> x1_send(n), x1_recv(n), x2_send(n), x2_recv(n);
  for (size_t t = 0; t <= slots; ++t) {
    for (uint32_t s = 1; s < n; ++s) {
      const uint32_t to = (r + s) % n, from = (r + n - s) % n;
      if (t < pieces[to]) {
        x1_send[to].push_back(ts.size());
        ts.push_back(make_send(to, send_.data() + rbyte[to] + pbyte[to][t], penc[to][t]));
        ts.back().held = true;
      }
      if (t < pieces[r]) {
        x1_recv[from].push_back(ts.size());
        ts.push_back(
            make_recv(from, recv_.data() + peer_slot(from, r) * region[r] + pbyte[r][t], penc[r][t]));
      }
      if (t >= 1 && t - 1 < pieces[r]) {
        x2_send[to].push_back(ts.size());
        ts.push_back(make_send(to, gathered_.data() + rbyte[r] + pbyte[r][t - 1], penc[r][t - 1]));
        ts.back().held = true;
      }
      if (t >= 1 && t - 1 < pieces[from]) {
        x2_recv[from].push_back(ts.size());
        ts.push_back(make_recv(from, gathered_.data() + rbyte[from] + pbyte[from][t - 1], penc[from][t - 1]));
      }
    }
  }

  size_t encoded = 0, reduced = 0;  // slots encoded, own pieces reduced
  std::vector<size_t> decoded(n, 0);
  // One step of codec work per call, the most urgent first: reducing our piece (the peers wait
  // for it), encoding the next pieces for the peers, decoding what owners sent back.
  auto work = [&]() -> bool {
    if (reduced < pieces[r]) {
      bool ready = true;
      for (uint32_t q = 0; q < n && ready; ++q)
        if (q != r) ready = ts[x1_recv[q][reduced]].finished();
      if (ready) {
        const size_t p = reduced, len = plen(r, p), at = off[r] + p * piece;
        // As flat(): our own contribution at full precision, the peers' decoded in rank order.
        to_f32(buf + at * es, dtype, acc_.data(), len);
        for (uint32_t q = 0; q < n; ++q)
          if (q != r)
            codec_->decode(recv_.data() + peer_slot(q, r) * region[r] + pbyte[r][p], penc[r][p], acc_.data(),
                           len, DType::F32, true);
        if (divisor != 1.0) {
          const auto d = static_cast<float>(divisor);
          for (size_t i = 0; i < len; ++i) acc_[i] /= d;
        }
        std::byte* mine = gathered_.data() + rbyte[r] + pbyte[r][p];
        codec_->encode(acc_.data(), len, DType::F32, mine, penc[r][p],
                       piece_seed(encode_seed(seed_, step, r, r, 1), p));
        for (uint32_t q = 0; q < n; ++q)
          if (q != r) ts[x2_send[q][p]].held = false;
        codec_->decode(mine, penc[r][p], buf + at * es, len, dtype, false);
        ++reduced;
        return true;
      }
    }
    if (encoded < slots) {
      const size_t t = encoded++;
      for (uint32_t j = 0; j < n; ++j) {
        if (j == r || t >= pieces[j]) continue;
        codec_->encode(buf + (off[j] + t * piece) * es, plen(j, t), dtype,
                       send_.data() + rbyte[j] + pbyte[j][t], penc[j][t],
                       piece_seed(encode_seed(seed_, step, r, j, 0), t));
        ts[x1_send[j][t]].held = false;
      }
      return true;
    }
    for (uint32_t j = 0; j < n; ++j) {
      if (j == r || decoded[j] >= pieces[j] || !ts[x2_recv[j][decoded[j]]].finished()) continue;
      const size_t p = decoded[j]++;
      codec_->decode(gathered_.data() + rbyte[j] + pbyte[j][p], penc[j][p], buf + (off[j] + p * piece) * es,
                     plen(j, p), dtype, false);
      return true;
    }
    return false;
  };
  comm.exchange(ts, op, work);
  while (work()) {
  }
  bool complete = reduced == pieces[r] && encoded == slots;
  for (uint32_t j = 0; j < n; ++j) complete &= j == r || decoded[j] == pieces[j];
  if (!complete)
    throw Error(ErrorKind::kInvalidArgument,
                op.where() + ": pipelined schedule ended with pieces left undone");
}

// ---- OneBitAllreduce --------------------------------------------------------------------------

OneBitAllreduce::OneBitAllreduce(uint32_t chunk)
    : codec_(compress::make_codec(compress::CodecParams{compress::Kind::kSign, chunk, 16})),
      align_(block_align(compress::CodecParams{compress::Kind::kSign, chunk, 16})) {}

void OneBitAllreduce::run(Communicator& comm, float* buf, size_t count, std::span<float> worker_error,
                          std::span<float> server_error) {
  const float* we = worker_error.empty() ? nullptr : worker_error.data();
  run_filled(comm, buf, count, worker_error, server_error,
             [this, buf, &we](size_t begin, size_t n, float* x) {
               const float* e = we != nullptr ? we : own_worker_.data();
               for (size_t i = 0; i < n; ++i) x[i] = buf[begin + i] + e[begin + i];
             });
}

void OneBitAllreduce::run_filled(Communicator& comm, float* buf, size_t count, std::span<float> worker_error,
                                 std::span<float> server_error, const Fill& fill) {
  net::OpInfo op = comm.begin_op("1-bit allreduce", kOneBitAllreduceOpcode);
  op.bytes = static_cast<int64_t>(count * sizeof(float));
  if ((!worker_error.empty() && worker_error.size() != count) ||
      (!server_error.empty() && server_error.size() != count))
    throw Error(ErrorKind::kInvalidArgument, op.where() + ": error buffers of " +
                                                 std::to_string(worker_error.size()) + " and " +
                                                 std::to_string(server_error.size()) +
                                                 " elements for a buffer of " + std::to_string(count));
  if (comm.size() == 1) return;  // a single rank's average is its input: nothing is lost
  // Owned errors belong to one buffer: a buffer of another size starts from zero error.
  if (worker_error.empty()) {
    if (own_worker_.size() != count) own_worker_.assign(count, 0.0f);
    worker_error = own_worker_;
  }
  if (server_error.empty()) {
    if (own_server_.size() != count) own_server_.assign(count, 0.0f);
    server_error = own_server_;
  }
  comm.run_guarded(op, [&] {
    const uint32_t n = comm.size(), r = comm.rank();
    const Blocks blocks(count, n, align_, *codec_);
    const auto& counts = blocks.counts;
    const auto& off = blocks.off;
    const auto& enc = blocks.enc;
    const auto& eoff = blocks.eoff;
    enc_.resize(blocks.wire_bytes());
    recv_.resize(static_cast<size_t>(n - 1) * enc[r]);
    std::byte* wire = enc_.data();
    float* we = worker_error.data();

    // Worker: compress input + carried error, keep what this compression loses. Tile by tile,
    // so the input is produced (fill), encoded and its error taken while it is in cache.
    for (uint32_t j = 0; j < n; ++j) {
      if (counts[j] == 0) continue;
      compress::SignTileEncoder tiles(*codec_, counts[j], wire + eoff[j], enc[j]);
      tile_.resize(tiles.tile());
      for (size_t t = 0; t < counts[j]; t += tiles.tile()) {
        const size_t len = std::min(tiles.tile(), counts[j] - t);
        fill(off[j] + t, len, tile_.data());
        tiles.encode_tile(t, tile_.data(), len, we + off[j] + t);
      }
    }
    scatter_to_owners(comm, op, blocks, wire, recv_.data());

    // Server: average the compressed contributions (its own included, as sent), add its carried
    // error, compress once more and keep what that loses.
    if (counts[r] > 0) {
      const size_t c = counts[r];
      acc_.resize(c);
      for (uint32_t q = 0; q < n; ++q) {
        const std::byte* src = q == r ? wire + eoff[r] : recv_.data() + peer_slot(q, r) * enc[r];
        codec_->decode(src, enc[r], acc_.data(), c, DType::F32, q != 0);
      }
      float* es = server_error.data() + off[r];
      const auto nf = static_cast<float>(n);
      for (size_t i = 0; i < c; ++i) acc_[i] = acc_[i] / nf + es[i];
      compress::SignTileEncoder tiles(*codec_, c, wire + eoff[r], enc[r]);
      for (size_t t = 0; t < c; t += tiles.tile())
        tiles.encode_tile(t, acc_.data() + t, std::min(tiles.tile(), c - t), es + t);
    }

    gather_from_owners(comm, op, blocks, wire);
    for (uint32_t j = 0; j < n; ++j)
      if (counts[j] > 0) codec_->decode(wire + eoff[j], enc[j], buf + off[j], counts[j], DType::F32, false);
  });
}

// ---- bucket ops -------------------------------------------------------------------------------

std::string CompressedAllreduceBucketOp::name() const {
  std::string s = "compressed allreduce (" + kind_name(impl_.params().kind);
  if (impl_.params().kind == compress::Kind::kQSGD)
    s += ", " + std::to_string(impl_.params().levels) + " levels";
  if (impl_.hierarchical()) s += ", hierarchical";
  s += impl_.average() ? ", average)" : ", sum)";
  return s;
}

OneBitMomentumBucketOp::OneBitMomentumBucketOp(float* momentum, float* worker_error, float* server_error,
                                               size_t count, float beta1, uint32_t chunk,
                                               std::shared_ptr<BucketOp> warmup, bool hierarchical)
    : momentum_(momentum),
      worker_error_(worker_error),
      server_error_(server_error),
      count_(count),
      beta1_(beta1),
      impl_(chunk),
      warmup_(std::move(warmup)),
      hierarchical_(hierarchical) {
  if (count > 0 && (momentum == nullptr || worker_error == nullptr || server_error == nullptr))
    throw Error(ErrorKind::kInvalidArgument, "1-bit momentum op: null momentum or error buffer");
  if (!(beta1 >= 0.0f && beta1 < 1.0f))
    throw Error(ErrorKind::kInvalidArgument,
                "1-bit momentum op: beta1 must be in [0, 1), got " + std::to_string(beta1));
}

void OneBitMomentumBucketOp::run(Communicator& comm, void* data, size_t count, DType dtype) {
  if (dtype != DType::F32 || count != count_)
    throw Error(ErrorKind::kInvalidArgument, "1-bit momentum op: bucket of " + std::to_string(count) + " " +
                                                 std::string(dtype_name(dtype)) +
                                                 " elements, but its momentum holds " +
                                                 std::to_string(count_) + " float32");
  if (!compressing_.load()) {
    // Warm-up: plain Adam on the averaged gradient.
    if (warmup_)
      warmup_->run(comm, data, count, dtype);
    else
      comm.allreduce(data, count, dtype, ReduceOp::AVG);
    return;
  }
  const auto* g = static_cast<const float*>(data);
  const float b = beta1_, a = 1.0f - beta1_;
  auto update_locally = [&] {
    for (size_t i = 0; i < count; ++i)
      momentum_[i] = b * momentum_[i] + a * g[i] * (inv_denom_ != nullptr ? inv_denom_[i] : 1.0f);
  };
  if (comm.size() == 1) {  // nothing to compress: the momentum is the average
    update_locally();
    return;
  }
  if (hierarchical_) {
    update_locally();
    if (comm.all_local()) {  // no host boundary to compress across
      comm.allreduce(momentum_, count, DType::F32, ReduceOp::AVG);
      return;
    }
    net::OpInfo op = comm.begin_op("1-bit momentum allreduce (hierarchical)", kOneBitAllreduceOpcode);
    comm.run_guarded(op, [&] {
      Communicator& local = comm.local_comm();
      local.reduce(momentum_, count, DType::F32, ReduceOp::SUM, 0);
      // Several hosts (checked above), so the leaders' group has at least two members.
      if (Communicator* leaders = comm.leaders_comm()) {
        // The 1-bit allreduce averages over leaders; scaling each host's sum by leaders / ranks
        // makes that the average over every rank, also for hosts of different sizes.
        const float scale = static_cast<float>(leaders->size()) / static_cast<float>(comm.size());
        const float* m = momentum_;
        const float* we = worker_error_;
        impl_.run_filled(*leaders, momentum_, count, {worker_error_, count}, {server_error_, count},
                         [=](size_t begin, size_t n, float* x) {
                           for (size_t i = begin; i < begin + n; ++i) x[i - begin] = m[i] * scale + we[i];
                         });
      }
      local.broadcast(momentum_, count, DType::F32, 0);
    });
    return;
  }
  // The momentum update and the worker's error feedback are computed tile by tile inside the
  // 1-bit allreduce (m + e_w is what the worker compresses); the momentum itself is overwritten by
  // the average afterwards, so the update is never stored.
  const float* u = momentum_;
  const float* we = worker_error_;
  const float* inv = inv_denom_;
  impl_.run_filled(comm, momentum_, count, {worker_error_, count}, {server_error_, count},
                   [=](size_t begin, size_t n, float* x) {
                     if (inv != nullptr) {
                       for (size_t i = begin; i < begin + n; ++i)
                         x[i - begin] = b * u[i] + a * g[i] * inv[i] + we[i];
                     } else {
                       for (size_t i = begin; i < begin + n; ++i) x[i - begin] = b * u[i] + a * g[i] + we[i];
                     }
                   });
}

}  // namespace rumor::ops
