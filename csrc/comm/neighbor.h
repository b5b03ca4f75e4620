// Neighbor exchange over a graph topology (BlueFog's neighbor_allreduce / neighbor_allgather).
//
// Convention: W[i, j] is the weight of edge i -> j (the row is the sender), and a receiver
// computes x_i <- W[i, i] x_i + sum_j W[j, i] x_j over its in-neighbors j. Every rank passes its
// own view of the edges: the ranks it receives from (srcs) and sends to (dsts). Ranks are
// communicator ranks. All sends and receives of one call run concurrently.
//
// The lists of all ranks must agree (i in j's srcs exactly when j is in i's dsts). With the
// topology check on, a disagreement is found before any data moves and every rank raises the
// same kInvalidArgument error naming the pair. Without it, a receive nobody sends runs into the
// deadline and a send nobody receives fails the frame check of the receiver's next operation
// with that sender: an error, never silently mixed data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/types.h"

namespace rumor {

struct NeighborEdge {
  uint32_t rank = 0;
  double weight = 1.0;
};

// Buffers an operation needs for received and scaled messages. Passing the same scratch to
// successive calls avoids allocating (and page-faulting) them every time; it grows to the
// largest call and keeps that memory. Calls sharing one scratch must not overlap: pass one per
// communicator, whose operations run one at a time.
struct NeighborScratch {
  std::vector<std::byte> recv;
  std::vector<std::vector<std::byte>> scaled;
};

// One disagreement between a sender's and a receiver's lists.
struct TopologyMismatch {
  uint32_t sender = 0;
  uint32_t receiver = 0;
  // true: sender lists receiver as a destination, receiver does not list sender as a source.
  // false: receiver expects sender, which does not send to it.
  bool unexpected_send = false;
  uint64_t count = 0;  // how many pairs disagree in all
};

// Collective over comm (every rank must call it): an alltoall of one byte per pair ("I send to
// you") and an allreduce of the first disagreement. Every rank gets the same answer.
std::optional<TopologyMismatch> find_topology_mismatch(Communicator& comm, std::span<const uint32_t> srcs,
                                                       std::span<const uint32_t> dsts);
// "rank 1 sends to rank 2 but rank 2 does not receive from it (3 mismatched pairs)"; `unit`
// names what the ranks are ("rank", "machine").
std::string describe_mismatch(const TopologyMismatch& m, const Communicator& comm, const char* unit);
// Throws kInvalidArgument (on every rank) if the lists disagree.
void check_topology(Communicator& comm, std::span<const uint32_t> srcs, std::span<const uint32_t> dsts,
                    const char* what, const char* unit = "rank");

// out = self_weight * in + sum_k srcs[k].weight * m_k, where m_k is what srcs[k].rank sent: its
// `in` scaled by the weight it lists for this rank among its dsts (the scaled copy is made only
// for weights other than 1). in and out may be the same buffer. F32, F64, F16 and BF16
// (half types accumulate in float and round once).
void neighbor_allreduce(Communicator& comm, const void* in, void* out, size_t count, DType dtype,
                        double self_weight, std::span<const NeighborEdge> srcs,
                        std::span<const NeighborEdge> dsts, bool topo_check,
                        NeighborScratch* scratch = nullptr);

// Sends `bytes` bytes of `in` to every rank in dsts and receives recv_bytes[k] bytes from
// srcs[k], concatenated into `out` in the order of srcs. A size that differs from what the
// sender sends fails the frame check (kProtocol) on the receiver.
void neighbor_allgather(Communicator& comm, const void* in, size_t bytes, std::span<const uint32_t> srcs,
                        std::span<const size_t> recv_bytes, std::span<const uint32_t> dsts, void* out,
                        bool topo_check);

// For allgather with sizes unknown to the receiver: sends `words` (e.g. this rank's byte count
// and shape) to every dst and returns what each src sent, in the order of srcs
// (srcs.size() * words.size() values; every rank must send the same number of words).
std::vector<uint64_t> neighbor_exchange_words(Communicator& comm, std::span<const uint64_t> words,
                                              std::span<const uint32_t> srcs, std::span<const uint32_t> dsts,
                                              bool topo_check);

// Average within each host (comm.local_comm()), neighbor_allreduce among the host leaders
// (comm.leaders_comm(): machine m is the host whose lowest rank comes m-th; machine edges are leaders
// communicator ranks), then broadcast within the host. Only the leader's machine lists and
// weights are used. With topo_check, a mismatch among machines raises on every rank.
void hierarchical_neighbor_allreduce(Communicator& comm, const void* in, void* out, size_t count, DType dtype,
                                     double self_weight, std::span<const NeighborEdge> machine_srcs,
                                     std::span<const NeighborEdge> machine_dsts, bool topo_check,
                                     NeighborScratch* scratch = nullptr);

// out = self_weight * in + sum_k weights[k] * srcs[k] over count elements (a kernel of the ops
// above, exposed for tests). in may alias out; srcs may not.
void weighted_sum(void* out, const void* in, double self_weight, std::span<const void* const> srcs,
                  std::span<const double> weights, size_t count, DType dtype);

// out = weight * (in + sum srcs): summed first and scaled once (divided by k when weight is
// exactly 1/k), which neighbor_allreduce uses when self and every source share one weight.
void uniform_weighted_sum(void* out, const void* in, double weight, std::span<const void* const> srcs,
                          size_t count, DType dtype);

}  // namespace rumor
