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

// ---- bucket op --------------------------------------------------------------------------------

std::string CompressedAllreduceBucketOp::name() const {
  std::string s = "compressed allreduce (" + kind_name(impl_.params().kind);
  if (impl_.params().kind == compress::Kind::kQSGD)
    s += ", " + std::to_string(impl_.params().levels) + " levels";
  if (impl_.hierarchical()) s += ", hierarchical";
  s += impl_.average() ? ", average)" : ", sum)";
  return s;
}

}  // namespace rumor::ops
