#include "comm/neighbor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/reduce.h"

namespace rumor {

namespace neighbor_generic {
bool weighted_sum(void* out, const void* in, double self_weight, const void* const* srcs,
                  const double* weights, size_t nsrc, size_t n, DType dtype);
bool uniform_sum(void* out, const void* in, const void* const* srcs, size_t nsrc, size_t n, double factor,
                 bool divide, DType dtype);
}  // namespace neighbor_generic
#ifdef RUMOR_AVX2_KERNELS
namespace neighbor_avx2 {
bool weighted_sum(void* out, const void* in, double self_weight, const void* const* srcs,
                  const double* weights, size_t nsrc, size_t n, DType dtype);
bool uniform_sum(void* out, const void* in, const void* const* srcs, size_t nsrc, size_t n, double factor,
                 bool divide, DType dtype);
}  // namespace neighbor_avx2
#endif

using net::make_recv;
using net::make_send;
using net::Transfer;

namespace {

std::string rank_list(std::span<const uint32_t> r) {
  std::string s = "[";
  for (size_t i = 0; i < r.size(); ++i) s += (i ? ", " : "") + std::to_string(r[i]);
  return s + "]";
}

// Ranks must name other members, each at most once: a duplicate would post two messages
// where the peer expects one, and a self edge has no channel.
void validate_ranks(const Communicator& comm, std::span<const uint32_t> ranks, const char* what,
                    const char* role) {
  std::vector<bool> seen(comm.size(), false);
  for (uint32_t r : ranks) {
    if (r >= comm.size())
      throw Error(ErrorKind::kInvalidArgument, std::string(what) + ": " + role + " rank " +
                                                   std::to_string(r) + " is outside a group of " +
                                                   std::to_string(comm.size()));
    if (r == comm.rank())
      throw Error(ErrorKind::kInvalidArgument, std::string(what) + ": " + role + " ranks " +
                                                   rank_list(ranks) + " include this rank itself (" +
                                                   std::to_string(r) +
                                                   "); pass its weight as the self weight");
    if (seen[r])
      throw Error(ErrorKind::kInvalidArgument, std::string(what) + ": " + role + " ranks " +
                                                   rank_list(ranks) + " name rank " + std::to_string(r) +
                                                   " twice");
    seen[r] = true;
  }
}

void validate_weight(double w, const char* what, const std::string& which) {
  if (!std::isfinite(w))
    throw Error(ErrorKind::kInvalidArgument,
                std::string(what) + ": " + which + " must be finite, got " + std::to_string(w));
}

std::vector<uint32_t> ranks_of(std::span<const NeighborEdge> e) {
  std::vector<uint32_t> r;
  r.reserve(e.size());
  for (const auto& x : e) r.push_back(x.rank);
  return r;
}

void validate_allreduce(const Communicator& comm, DType dtype, double self_weight,
                        std::span<const NeighborEdge> srcs, std::span<const NeighborEdge> dsts,
                        const char* what) {
  if (dtype != DType::F32 && dtype != DType::F64 && dtype != DType::F16 && dtype != DType::BF16)
    throw Error(ErrorKind::kInvalidArgument, std::string(what) + ": dtype " + std::string(dtype_name(dtype)) +
                                                 " is not supported (float32, float64, float16, bfloat16)");
  validate_weight(self_weight, what, "the self weight");
  for (const auto& e : srcs)
    validate_weight(e.weight, what, "the weight of source " + std::to_string(e.rank));
  for (const auto& e : dsts)
    validate_weight(e.weight, what, "the weight of destination " + std::to_string(e.rank));
  validate_ranks(comm, ranks_of(srcs), what, "source");
  validate_ranks(comm, ranks_of(dsts), what, "destination");
}

}  // namespace

void weighted_sum(void* out, const void* in, double self_weight, std::span<const void* const> srcs,
                  std::span<const double> weights, size_t count, DType dtype) {
  if (srcs.size() != weights.size())
    throw Error(ErrorKind::kInvalidArgument, "weighted_sum: " + std::to_string(srcs.size()) +
                                                 " sources but " + std::to_string(weights.size()) +
                                                 " weights");
  if (count == 0) return;
  bool ok = false;
#ifdef RUMOR_AVX2_KERNELS
  if (std::strcmp(reduce_isa(), "avx2") == 0)
    ok = neighbor_avx2::weighted_sum(out, in, self_weight, srcs.data(), weights.data(), srcs.size(), count,
                                     dtype);
  else
#endif
    ok = neighbor_generic::weighted_sum(out, in, self_weight, srcs.data(), weights.data(), srcs.size(), count,
                                        dtype);
  if (!ok)
    throw Error(ErrorKind::kInvalidArgument,
                "weighted_sum: dtype " + std::string(dtype_name(dtype)) + " has no weighted sum");
}

void uniform_weighted_sum(void* out, const void* in, double weight, std::span<const void* const> srcs,
                          size_t count, DType dtype) {
  if (count == 0) return;
  // A weight 1/k with k an integer (BlueFog's 1/(d+1)) divides the sum by k: the rounding of
  // a division, not of a product with a rounded reciprocal.
  const double k = std::round(1.0 / weight);
  const bool divide = std::isfinite(k) && k >= 1 && k < 1e15 && 1.0 / k == weight;
  const double factor = divide ? k : weight;
  bool ok = false;
#ifdef RUMOR_AVX2_KERNELS
  if (std::strcmp(reduce_isa(), "avx2") == 0)
    ok = neighbor_avx2::uniform_sum(out, in, srcs.data(), srcs.size(), count, factor, divide, dtype);
  else
#endif
    ok = neighbor_generic::uniform_sum(out, in, srcs.data(), srcs.size(), count, factor, divide, dtype);
  if (!ok)
    throw Error(ErrorKind::kInvalidArgument,
                "uniform_weighted_sum: dtype " + std::string(dtype_name(dtype)) + " has no weighted sum");
}

// ---- topology check ---------------------------------------------------------------------------

std::optional<TopologyMismatch> find_topology_mismatch(Communicator& comm, std::span<const uint32_t> srcs,
                                                       std::span<const uint32_t> dsts) {
  const uint32_t n = comm.size(), me = comm.rank();
  validate_ranks(comm, srcs, "topology check", "source");
  validate_ranks(comm, dsts, "topology check", "destination");
  if (n == 1) return std::nullopt;
  // One byte per ordered pair tells each receiver who will send to it; the receiver compares
  // that with whom it expects. O(n) bytes per rank, whatever the degree.
  std::vector<uint8_t> sends(n, 0), senders(n, 0), expected(n, 0);
  for (uint32_t d : dsts) sends[d] = 1;
  for (uint32_t s : srcs) expected[s] = 1;
  const std::vector<size_t> ones(n, 1);
  comm.alltoall(sends.data(), ones, senders.data(), ones, DType::U8);
  // Lowest (sender, receiver) pair that disagrees, encoded so that MIN picks it on every rank.
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  int64_t first = kNone, local_count = 0;
  for (uint32_t p = 0; p < n; ++p) {
    if (p == me || senders[p] == expected[p]) continue;
    const int64_t code = (static_cast<int64_t>(p) * n + me) * 2 + (senders[p] ? 1 : 0);
    first = std::min(first, code);
    ++local_count;
  }
  comm.allreduce(&first, 1, DType::I64, ReduceOp::MIN);
  if (first == kNone) return std::nullopt;
  // Only on failure: how many pairs disagree, for the message.
  comm.allreduce(&local_count, 1, DType::I64, ReduceOp::SUM);
  TopologyMismatch m;
  m.unexpected_send = (first & 1) != 0;
  m.sender = static_cast<uint32_t>((first / 2) / n);
  m.receiver = static_cast<uint32_t>((first / 2) % n);
  m.count = static_cast<uint64_t>(local_count);
  return m;
}

std::string describe_mismatch(const TopologyMismatch& m, const Communicator& comm, const char* unit) {
  (void)comm;
  const std::string s = std::string(unit) + " " + std::to_string(m.sender);
  const std::string r = std::string(unit) + " " + std::to_string(m.receiver);
  std::string msg = m.unexpected_send ? s + " sends to " + r + ", but " + r + " does not receive from " + s
                                      : r + " receives from " + s + ", but " + s + " does not send to " + r;
  if (m.count > 1) msg += " (" + std::to_string(m.count) + " mismatched pairs in all)";
  return msg;
}

void check_topology(Communicator& comm, std::span<const uint32_t> srcs, std::span<const uint32_t> dsts,
                    const char* what, const char* unit) {
  auto m = find_topology_mismatch(comm, srcs, dsts);
  if (m)
    throw Error(ErrorKind::kInvalidArgument, std::string(what) + ": send and receive lists do not match: " +
                                                 describe_mismatch(*m, comm, unit));
}

// ---- neighbor_allreduce -----------------------------------------------------------------------

namespace {

// The exchange and combination, without validation or check (shared with the hierarchical op).
void neighbor_allreduce_body(Communicator& comm, const net::OpInfo& op, const void* in, void* out,
                             size_t count, DType dtype, double self_weight,
                             std::span<const NeighborEdge> srcs, std::span<const NeighborEdge> dsts,
                             NeighborScratch* scratch) {
  NeighborScratch local_scratch;
  NeighborScratch& sc = scratch != nullptr ? *scratch : local_scratch;
  const size_t bytes = count * dtype_size(dtype);
  // Senders scale by their weight for each destination; destinations sharing a weight share
  // one scaled copy, and weight 1 sends the input itself.
  std::vector<double> scale_weights;
  size_t nscaled = 0;
  std::vector<const void*> send_from(dsts.size(), in);
  for (size_t k = 0; k < dsts.size(); ++k) {
    const double w = dsts[k].weight;
    if (w == 1.0) continue;
    auto it = std::find(scale_weights.begin(), scale_weights.end(), w);
    size_t idx = static_cast<size_t>(it - scale_weights.begin());
    if (it == scale_weights.end()) {
      scale_weights.push_back(w);
      if (sc.scaled.size() <= nscaled) sc.scaled.emplace_back();
      sc.scaled[nscaled].resize(bytes);
      weighted_sum(sc.scaled[nscaled].data(), in, w, {}, {}, count, dtype);
      ++nscaled;
    }
    send_from[k] = sc.scaled[idx].data();
  }
  sc.recv.resize(srcs.size() * bytes);
  std::byte* recv = sc.recv.data();
  std::vector<Transfer> ts;
  ts.reserve(srcs.size() + dsts.size());
  for (size_t k = 0; k < srcs.size(); ++k) ts.push_back(make_recv(srcs[k].rank, recv + k * bytes, bytes));
  for (size_t k = 0; k < dsts.size(); ++k) ts.push_back(make_send(dsts[k].rank, send_from[k], bytes));
  comm.exchange(ts, op);
  std::vector<const void*> parts(srcs.size());
  std::vector<double> weights(srcs.size());
  bool uniform = !srcs.empty();
  for (size_t k = 0; k < srcs.size(); ++k) {
    parts[k] = recv + k * bytes;
    weights[k] = srcs[k].weight;
    uniform = uniform && srcs[k].weight == self_weight;
  }
  if (uniform)
    uniform_weighted_sum(out, in, self_weight, parts, count, dtype);
  else
    weighted_sum(out, in, self_weight, parts, weights, count, dtype);
}

}  // namespace

void neighbor_allreduce(Communicator& comm, const void* in, void* out, size_t count, DType dtype,
                        double self_weight, std::span<const NeighborEdge> srcs,
                        std::span<const NeighborEdge> dsts, bool topo_check, NeighborScratch* scratch) {
  const char* what = "neighbor_allreduce";
  validate_allreduce(comm, dtype, self_weight, srcs, dsts, what);
  if (topo_check) check_topology(comm, ranks_of(srcs), ranks_of(dsts), what);
  net::OpInfo op = comm.begin_op(what, Opcode::kNeighbor);
  op.bytes = static_cast<int64_t>(count * dtype_size(dtype));
  comm.run_guarded(op, [&] {
    neighbor_allreduce_body(comm, op, in, out, count, dtype, self_weight, srcs, dsts, scratch);
  });
}

// ---- neighbor_allgather -----------------------------------------------------------------------

void neighbor_allgather(Communicator& comm, const void* in, size_t bytes, std::span<const uint32_t> srcs,
                        std::span<const size_t> recv_bytes, std::span<const uint32_t> dsts, void* out,
                        bool topo_check) {
  const char* what = "neighbor_allgather";
  if (recv_bytes.size() != srcs.size())
    throw Error(ErrorKind::kInvalidArgument, std::string(what) + ": " + std::to_string(srcs.size()) +
                                                 " sources but " + std::to_string(recv_bytes.size()) +
                                                 " receive sizes");
  validate_ranks(comm, srcs, what, "source");
  validate_ranks(comm, dsts, what, "destination");
  if (topo_check) check_topology(comm, srcs, dsts, what);
  net::OpInfo op = comm.begin_op(what, Opcode::kNeighbor);
  op.bytes = static_cast<int64_t>(bytes);
  comm.run_guarded(op, [&] {
    std::vector<Transfer> ts;
    ts.reserve(srcs.size() + dsts.size());
    auto* o = static_cast<std::byte*>(out);
    size_t off = 0;
    for (size_t k = 0; k < srcs.size(); ++k) {
      ts.push_back(make_recv(srcs[k], o + off, recv_bytes[k]));
      off += recv_bytes[k];
    }
    for (uint32_t d : dsts) ts.push_back(make_send(d, in, bytes));
    comm.exchange(ts, op);
  });
}

std::vector<uint64_t> neighbor_exchange_words(Communicator& comm, std::span<const uint64_t> words,
                                              std::span<const uint32_t> srcs, std::span<const uint32_t> dsts,
                                              bool topo_check) {
  const char* what = "neighbor_allgather (shapes)";
  validate_ranks(comm, srcs, what, "source");
  validate_ranks(comm, dsts, what, "destination");
  if (topo_check) check_topology(comm, srcs, dsts, what);
  net::OpInfo op = comm.begin_op(what, Opcode::kNeighbor);
  const size_t bytes = words.size() * sizeof(uint64_t);
  std::vector<uint64_t> got(srcs.size() * words.size());
  comm.run_guarded(op, [&] {
    std::vector<Transfer> ts;
    for (size_t k = 0; k < srcs.size(); ++k)
      ts.push_back(make_recv(srcs[k], got.data() + k * words.size(), bytes));
    for (uint32_t d : dsts) ts.push_back(make_send(d, words.data(), bytes));
    comm.exchange(ts, op);
  });
  return got;
}

// ---- hierarchical -----------------------------------------------------------------------------

void hierarchical_neighbor_allreduce(Communicator& comm, const void* in, void* out, size_t count, DType dtype,
                                     double self_weight, std::span<const NeighborEdge> machine_srcs,
                                     std::span<const NeighborEdge> machine_dsts, bool topo_check,
                                     NeighborScratch* scratch) {
  const char* what = "hierarchical_neighbor_allreduce";
  Communicator& local = comm.local_comm();
  Communicator* leaders = comm.leaders_comm();
  // Every rank checks what it can (a rank that stopped here alone would leave its host waiting);
  // only leaders know the machine count to check the machine ranks against.
  validate_allreduce(local, dtype, self_weight, {}, {}, what);
  if (leaders != nullptr) validate_allreduce(*leaders, dtype, self_weight, machine_srcs, machine_dsts, what);
  net::OpInfo op = comm.begin_op(what, Opcode::kNeighbor);
  op.bytes = static_cast<int64_t>(count * dtype_size(dtype));
  op.algo = "hierarchical";
  // A machine-level mismatch is found by the leaders only; they pass the message to their
  // host so that every rank raises the same error (and none waits for a broadcast).
  constexpr size_t kMsg = 256;
  char message[kMsg] = {};
  // Every rank of the group on one host and a machine mix that keeps the host's weights as they
  // are (weight 1, no machine edges: what Decentralized's schedules give a single node): the
  // host's average is the result, already identical on every rank (an allreduce's bits are), so
  // neither the leader's pass over it nor its broadcast, a second copy of the whole buffer into
  // every rank, is needed. With 4 ranks on 2 cores those ran beside forward in Decentralized's
  // default. The ranks of a host pass the same machine arguments (the leader's are the ones used).
  const bool one_host =
      local.size() == comm.size() && self_weight == 1.0 && machine_srcs.empty() && machine_dsts.empty();
  comm.run_guarded(op, [&] {
    local.allreduce_into(in, out, count, dtype, ReduceOp::AVG);
    if (one_host) return;
    if (leaders != nullptr) {
      std::optional<TopologyMismatch> m;
      if (topo_check) m = find_topology_mismatch(*leaders, ranks_of(machine_srcs), ranks_of(machine_dsts));
      if (m) {
        std::string s = describe_mismatch(*m, *leaders, "machine");
        std::memcpy(message, s.data(), std::min(s.size(), kMsg - 1));
      } else {
        net::OpInfo lop = leaders->begin_op(what, Opcode::kNeighbor);
        leaders->run_guarded(lop, [&] {
          neighbor_allreduce_body(*leaders, lop, out, out, count, dtype, self_weight, machine_srcs,
                                  machine_dsts, scratch);
        });
      }
    }
    if (topo_check) local.broadcast(message, kMsg, DType::U8, 0);
    if (message[0] == '\0') local.broadcast(out, count, dtype, 0);
  });
  if (message[0] != '\0')
    throw Error(ErrorKind::kInvalidArgument,
                std::string(what) + ": machine send and receive lists do not match: " + message);
}

}  // namespace rumor
