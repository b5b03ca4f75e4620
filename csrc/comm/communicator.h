// A group of ranks and the collectives among them. Collectives are synchronous C++ calls on
// contiguous buffers; Worker (work.h) makes them asynchronous. Buffers are plain pointers so
// that tensors of any framework (and any torch version) can cross without torch headers.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "comm/context.h"
#include "comm/work.h"
#include "net/channel.h"

namespace rumor {

enum class Opcode : uint8_t {
  kAllreduce = 1,
  kReduceScatter = 2,
  kAllgather = 3,
  kBroadcast = 4,
  kReduce = 5,
  kAlltoall = 6,
  kBarrier = 7,
  kSendRecv = 8,
  kArenaAllreduce = 9,
  kNeighbor = 10,
};

class HostDirect;
class HostSmall;

enum class AllreduceAlgo : uint8_t { kAuto = 0, kRing = 1, kRecursiveDoubling = 2, kHierarchical = 3 };

class Communicator {
 public:
  // world_ranks: the members in communicator-rank order; the calling process must be one.
  Communicator(std::shared_ptr<Context> ctx, uint64_t id, std::string name,
               std::vector<uint32_t> world_ranks);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  uint32_t rank() const { return rank_; }
  uint32_t size() const { return static_cast<uint32_t>(world_ranks_.size()); }
  const std::vector<uint32_t>& world_ranks() const { return world_ranks_; }
  const std::string& name() const { return name_; }
  Worker& worker() { return worker_; }
  double timeout_s() const { return ctx_->timeout_s(); }

  // In place on buf (count elements).
  void allreduce(void* buf, size_t count, DType dtype, ReduceOp op,
                 AllreduceAlgo algo = AllreduceAlgo::kAuto);
  // The same result in `out`, `in` left as it was (the two are the same buffer or do not
  // overlap). On one host's direct path every rank reads the inputs where they are and writes
  // the outputs, with no copy of `in` first: that copy alone moved as many bytes as the whole
  // allreduce's bound. Elsewhere `in` is copied into `out`, which is then reduced in place.
  void allreduce_into(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                      AllreduceAlgo algo = AllreduceAlgo::kAuto);
  // `in` holds size() blocks of counts[i] elements and is left untouched; `out` receives the
  // reduction of everyone's block rank() (counts[rank()] elements).
  void reduce_scatter(const void* in, void* out, std::span<const size_t> counts, DType dtype, ReduceOp op);
  // buf holds size() blocks of counts[i] elements; this rank's block must be filled in, or `own`
  // holds it (counts[rank()] elements, left untouched). On one host's direct path the peers read
  // `own` where it is and write every rank's output, with no copy into buf first (that copy cost
  // a third of a two-rank allgather's bytes); elsewhere it is copied into place first.
  void allgather(void* buf, std::span<const size_t> counts, DType dtype, const void* own = nullptr);
  // Whether an allgather of these blocks refuses, on every rank and before any buffer is touched,
  // ranks that passed other block sizes or another dtype: one rank, or the shared slots (the
  // other paths compare sizes only). The Python API then needs no round of its own to check shapes.
  bool allgather_checks_blocks(std::span<const size_t> counts, DType dtype) const;
  void broadcast(void* buf, size_t count, DType dtype, uint32_t root);
  // Reduction lands in buf on root; other ranks' buf is scratch afterwards.
  void reduce(void* buf, size_t count, DType dtype, ReduceOp op, uint32_t root);
  // send_counts[i] elements from `in` go to rank i; recv_counts[i] from rank i land in `out`.
  void alltoall(const void* in, std::span<const size_t> send_counts, void* out,
                std::span<const size_t> recv_counts, DType dtype);
  void barrier();
  // Empty-frame barrier inside another operation (shares its tag and deadline).
  void barrier_within(const net::OpInfo& op);
  void send(const void* buf, size_t bytes, uint32_t dst);
  void recv(void* buf, size_t bytes, uint32_t src);
  // Connects to every member (an alltoall of nothing) and returns each one's smallest round trip
  // in seconds as the kernel sampled it on the TCP channel: 0 for this rank and shared memory.
  std::vector<double> peer_rtts();
  // The same figure for the channels already open only, connecting none (0 elsewhere): what the
  // operations so far have used, without an all-pairs mesh a large job's ring never needs.
  std::vector<double> link_rtts() const;

  bool all_local() const { return all_local_; }
  bool uses_shm() const { return ctx_->options().shm; }
  const Context& context() const { return *ctx_; }
  const std::string& shm_prefix() const { return shm_prefix_; }
  uint64_t id() const { return id_; }
  uint64_t next_arena_id() { return next_arena_id_++; }
  trace::Recorder& recorder() { return ctx_->recorder(); }
  net::OpInfo begin_op(const char* name, Opcode code) { return begin(name, code); }
  template <typename Fn>
  void run_guarded(const net::OpInfo& op, Fn&& fn) {
    guarded(op, std::forward<Fn>(fn));
  }

  // Building blocks for operations written outside this class (codecs, neighbor exchange):
  // run all transfers concurrently until done, within op's deadline. Transfers to one peer in
  // one direction complete in order. Call inside run_guarded so that a failure aborts.
  void exchange(std::span<net::Transfer> ts, const net::OpInfo& op);
  // The same, calling work() between rounds of progress so that computation overlaps the
  // transfers in flight: work does one bounded piece (it returns false when it had none ready)
  // and may release held sends. A held send with no work left to release it is a logic error.
  // With `beside`, a transfer striped over a TCP channel's streams may start on those that the
  // earlier ones to the same peer in the same direction have finished with (instead of every
  // stream idling until the slowest is done). Each stream still carries messages in order and a
  // message that would go whole waits, so transfers still finish in order, but one's bytes can
  // land before the previous one's last: only for transfers whose destinations do not overlap.
  void exchange(std::span<net::Transfer> ts, const net::OpInfo& op, const std::function<bool()>& work,
                bool beside = false);
  std::string peer_desc(uint32_t peer) const;
  net::Channel& channel(uint32_t peer, const net::OpInfo& op);
  // Ranks on this rank's host (in communicator order) and one leader per host (the lowest rank
  // of each host); built on first use, without communication.
  Communicator& local_comm();
  Communicator* leaders_comm();  // nullptr on ranks that are not their host's leader

  // Fails every channel so that peers blocked on this rank error out quickly.
  void abort(const std::string& why);
  bool aborted() const { return broken_.load(); }

  // Whether a collective of this many bytes reads and writes the peers' buffers in place
  // (comm/direct.h): every rank on this host, shared memory on, big enough to pay for it.
  bool use_direct(size_t bytes) const;
  // Two ranks on this host, an allreduce of this many bytes: rank 0 chooses between the rings and
  // the direct path by time, and both ranks take its choice (PathChoice, comm/direct.h).
  bool two_rank_choice(size_t bytes) const;
  // The path the last operation that returned took ("ring", "direct", "shared slots", ...): what a
  // timeline shows for it, for tests and diagnostics.
  const char* last_algo() const { return last_algo_; }

 private:
  struct Op;
  struct SitePipe;  // the overlapped 2-D allreduce's cross-site thread (communicator.cpp)
  net::OpInfo begin(const char* name, Opcode code);
  // Runs an operation body; any error aborts the communicator (peers then fail promptly).
  // Every operation is also recorded here (flight recorder, and the timeline when one is on).
  template <typename Fn>
  void guarded(const net::OpInfo& op, Fn&& fn) {
    trace::Recorder& rec = ctx_->recorder();
    const double outer_blocked = std::exchange(blocked_us_, 0.0);
    struct Restore {  // an operation run inside another of this communicator adds to its figure
      double& v;
      double outer;
      ~Restore() { v += outer; }
    } restore{blocked_us_, outer_blocked};
    const trace::Recorder::OpToken tok = rec.op_begin(trace_desc(op));
    try {
      fn();
    } catch (const Error& e) {
      rec.op_end(tok, trace_desc(op), false, e.what());
      // Already broken: another thread aborted this communicator while the op ran, and what the
      // op then saw (a timeout it never reached, a peer "aborting" by the flag this rank set on
      // their shared ring) is not the cause: the abort's reason is.
      if (broken_.load()) {
        std::string why;
        {
          std::lock_guard lk(broken_mu_);
          why = broken_why_;
        }
        throw Error(ErrorKind::kAborted, op.where() + ": the communicator was aborted while it ran: " + why +
                                             " (the operation then saw: " + e.what() + ")");
      }
      abort(e.what());
      throw;
    } catch (const std::exception& e) {
      rec.op_end(tok, trace_desc(op), false, e.what());
      abort(e.what());
      throw Error(ErrorKind::kSystem, op.where() + ": " + e.what());
    }
    rec.op_end(tok, trace_desc(op), true);
    last_algo_ = op.algo;
  }
  trace::OpDesc trace_desc(const net::OpInfo& op) const;

  void allreduce_impl(const std::byte* in, std::byte* out, size_t count, DType dtype, ReduceOp op,
                      AllreduceAlgo algo);
  void allreduce_ring(std::byte* buf, size_t count, DType dtype, ReduceOp op, const net::OpInfo& info);
  void allreduce_rd(std::byte* buf, size_t count, DType dtype, ReduceOp op, const net::OpInfo& info);
  void allreduce_hier(std::byte* buf, size_t count, DType dtype, ReduceOp op);
  void allreduce_2d(std::byte* buf, size_t count, DType dtype, ReduceOp op);
  void allreduce_2d_overlapped(std::byte* buf, size_t count, DType dtype, ReduceOp op, size_t pieces);
  // The ring of allreduce_ring over ring_at_ (piece c of block b at ring_at_[b * pieces + c]).
  // With a pipe, the first step's pieces wait for the pipe's local reduce-scatter, and pieces
  // whose last transfer arrived are announced to it (allreduce_2d_overlapped).
  void ring_run(size_t pieces, DType dtype, ReduceOp op, const net::OpInfo& info, SitePipe* pipe);
  // On the cross communicator, from the pipe's thread: one operation running ring_run.
  void allreduce_gated(size_t pieces, DType dtype, ReduceOp op, SitePipe& pipe);
  void ring_reduce_scatter(std::byte* buf, std::span<const size_t> counts, DType dtype, ReduceOp op,
                           const net::OpInfo& info);
  void ring_allgather(std::byte* buf, std::span<const size_t> counts, DType dtype, const net::OpInfo& info);
  void binomial_broadcast(std::byte* buf, size_t bytes, uint32_t root, const net::OpInfo& info);
  // Across hosts: the ranks from the root on form a chain and each forwards chunk k to the next
  // while it receives chunk k + 1, so every link carries the buffer once.
  void chain_broadcast(std::byte* buf, size_t bytes, uint32_t root, const net::OpInfo& info);
  void ensure_hierarchy();
  // Below this many bytes allreduce uses recursive doubling. Lower across hosts, where each
  // extra full-buffer round costs link time rather than memory bandwidth.
  size_t small_bytes() const;
  // Every rank on this host, shared memory on: the shared slots (comm/direct.h, HostSmall) can serve.
  bool use_small() const;
  HostDirect& host_direct();
  HostSmall& host_small();

  std::shared_ptr<Context> ctx_;
  uint64_t id_;
  std::string name_;
  std::vector<uint32_t> world_ranks_;
  uint32_t rank_ = 0;
  std::vector<std::unique_ptr<net::Channel>> channels_;
  uint64_t next_tag_ = 0;
  std::vector<uint64_t> p2p_sent_, p2p_recv_;
  std::vector<std::byte> scratch_;
  // allreduce_ring's transfers, kept between operations: hundreds of them (about 1.4 KB each)
  // for a large buffer, an allocation big enough to be mapped and unmapped per operation.
  std::vector<net::Transfer> ring_ts_;
  std::vector<std::pair<std::byte*, size_t>> ring_at_;  // where ring_run finds each piece
  std::atomic<bool> broken_{false};
  std::string broken_why_;
  std::mutex broken_mu_;
  std::unique_ptr<HostDirect> direct_;  // one host: collectives on each other's buffers in place
  std::unique_ptr<HostSmall> small_;    // one host: small allreduces through shared slots
  // Hierarchical allreduce: ranks on this host, and one leader per host. Used only from
  // inside this communicator's operations, so they need no worker of their own.
  std::unique_ptr<Communicator> local_;
  std::unique_ptr<Communicator> leaders_;
  // Sites only, when every site has as many members: the i-th member of each site (allreduce_2d).
  std::unique_ptr<Communicator> cross_;
  std::unique_ptr<SitePipe> pipe_;  // after cross_: its thread stops before cross_ goes away
  bool hierarchy_built_ = false;
  std::string shm_prefix_;
  uint64_t next_arena_id_ = 0;
  bool all_local_ = true;      // every member on this rank's host
  bool hierarchical_ = false;  // several hosts, and at least one with several members
  bool is_leader_ = false;
  double blocked_us_ = 0;  // slept in exchange() during the current operation (timeline only)
  const char* last_algo_ = nullptr;
  const char* transport_ = "tcp";  // for the timeline: how this communicator's peers are reached
  Worker worker_;                  // last: its thread stops before the members it uses go away
};

}  // namespace rumor
