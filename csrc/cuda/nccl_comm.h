// One NCCL communicator over a group of ranks, with rumor's failure rules: every wait has a
// deadline, a deadline or an NCCL error aborts the communicator (so NCCL's kernels and proxy
// threads stop instead of spinning on a dead peer), the error names the op, the rank and NCCL's
// reason, and once aborted every call raises at once.
//
// CUDA-free: device buffers and streams cross as integers (a cudaStream_t is a pointer) and the
// completion of work on a stream is a caller-supplied query (cudaEventQuery on the GPU side), so
// this file builds and is tested against a host-memory fake NCCL on machines without CUDA.
//
// Threads: calls are serialized by an internal mutex, so concurrent use is safe but buys
// nothing; NCCL itself wants one thread to issue a communicator's operations in the same order
// on every rank, and the caller must keep that order. abort() may be called from any thread at
// any time: a thread polling NCCL notices it within one poll interval and raises kAborted. The
// object owns all of its state; nothing is process-wide.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/types.h"
#include "cuda/nccl_lib.h"

namespace rumor::nccl {

// rumor's types as NCCL's; Error(kInvalidArgument) for a type NCCL has no reduction for (int16).
abi::DataType to_nccl(DType t);
abi::RedOp to_nccl(ReduceOp op);

// One side of a grouped point-to-point exchange: count elements at buf to or from peer.
struct P2p {
  uintptr_t buf;
  size_t count;
  int peer;
};

class NcclCommunicator {
 public:
  // Creates rank `rank` of an `nranks` communicator for the ranks that call this with the same
  // unique id (made by one of them with NcclLibrary::unique_id()). `bind_device` (may be empty)
  // runs just before ncclCommInitRankConfig on this thread: NCCL binds the communicator to the
  // thread's current CUDA device at that moment. Creation is nonblocking (config.blocking = 0)
  // and polled until `deadline`; past it the communicator is aborted and Error(kTimeout) names
  // "nccl init", this rank, the group size and the ranks it waited for. `timeout_s` bounds
  // every later wait for NCCL to accept a call (NCCL may answer ncclInProgress) and close().
  NcclCommunicator(std::shared_ptr<const NcclLibrary> lib, const UniqueIdBytes& id, int nranks, int rank,
                   const std::function<void()>& bind_device, Deadline deadline, double timeout_s);
  // Destroys the communicator: finalize (flushes what was issued, bounded by timeout_s, abort
  // past it) then destroy; after an abort there is nothing left to do.
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return nranks_; }
  const NcclLibrary& library() const { return *lib_; }
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  double timeout_s() const { return timeout_s_.load(std::memory_order_relaxed); }
  void set_timeout(double seconds);

  // Enqueue operations: each queues NCCL's kernel on `stream` and returns without waiting for
  // it (see wait()). Buffers are device addresses; counts are elements of dtype. Data movement
  // (broadcast, allgather, send, recv, exchange) takes any dtype, moved as bytes; reductions
  // need a type NCCL reduces. In-place use follows NCCL (e.g. allgather's send may be
  // recv + rank * count).
  void allreduce(uintptr_t send, uintptr_t recv, size_t count, DType dtype, ReduceOp op, uintptr_t stream);
  void broadcast(uintptr_t send, uintptr_t recv, size_t count, DType dtype, int root, uintptr_t stream);
  void reduce(uintptr_t send, uintptr_t recv, size_t count, DType dtype, ReduceOp op, int root,
              uintptr_t stream);
  void allgather(uintptr_t send, uintptr_t recv, size_t send_count, DType dtype, uintptr_t stream);
  void reduce_scatter(uintptr_t send, uintptr_t recv, size_t recv_count, DType dtype, ReduceOp op,
                      uintptr_t stream);
  void send(uintptr_t buf, size_t count, DType dtype, int peer, uintptr_t stream);
  void recv(uintptr_t buf, size_t count, DType dtype, int peer, uintptr_t stream);
  // All sends and receives in one NCCL group, so they progress together (neighbor exchange:
  // every rank sending to and receiving from several peers at once cannot deadlock).
  void exchange(const std::vector<P2p>& sends, const std::vector<P2p>& recvs, DType dtype, uintptr_t stream);

  // Waits until `completed()` returns true (e.g. cudaEventQuery on an event recorded after the
  // op), checking NCCL's asynchronous error between polls. On an NCCL error or at `deadline`
  // the communicator is aborted and Error (kPeerGone / kSystem / kTimeout) names `op`, this
  // rank and NCCL's reason. `completed` runs on this thread, without the internal lock.
  void wait(const std::function<bool()>& completed, Deadline deadline, const std::string& op);

  // Raises if NCCL reported an asynchronous error (aborting first) or after an abort; never
  // blocks.
  void check(const std::string& op);

  // Aborts the communicator (idempotent; any thread). Later calls raise Error(kAborted).
  void abort();
  // Finalize + destroy now, bounded by timeout_s (the destructor does the same). Raises if the
  // finalize failed or timed out (the communicator is then aborted).
  void close();

 private:
  std::string who(const std::string& op) const;
  // Waits (lock held) for a call that answered ncclInProgress to finish.
  void settle(abi::Result r, const std::string& op, Deadline deadline, const std::string& expected);
  // Raises Error(kAborted) if the communicator is gone; performs a pending abort() request.
  void throw_if_aborted(const std::string& op);
  [[noreturn]] void fail(ErrorKind kind, const std::string& op, const std::string& reason);
  void abort_locked(const std::string& reason);
  std::string nccl_reason(abi::Result r) const;
  template <typename Call>
  void enqueue(const std::string& op, Call&& call);

  std::shared_ptr<const NcclLibrary> lib_;
  Api api_;  // a copy: the entry points of lib_, which this object keeps loaded
  int nranks_;
  int rank_;
  std::atomic<double> timeout_s_;

  std::mutex mu_;  // every NCCL call on comm_, and comm_ itself
  abi::Comm comm_ = nullptr;
  std::string abort_reason_;  // why the communicator was aborted (set once, under mu_)
  std::atomic<bool> aborted_{false};
  std::atomic<bool> abort_requested_{false};
};

}  // namespace rumor::nccl
