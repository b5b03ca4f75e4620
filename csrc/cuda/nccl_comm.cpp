#include "cuda/nccl_comm.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <thread>

#include "core/log.h"

namespace rumor::nccl {

namespace {

// Polls stay cheap while an op is likely to finish within microseconds (small GPU collectives),
// then back off to at most 1 ms so a long wait costs no CPU the training step needs.
class Backoff {
 public:
  void pause() {
    if (++n_ <= 100) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(1000));
  }

 private:
  int n_ = 0;
  std::chrono::microseconds sleep_{50};
};

ErrorKind kind_of(abi::Result r) {
  switch (r) {
    case abi::kRemoteError:
      return ErrorKind::kPeerGone;
    case abi::kTimeout:
      return ErrorKind::kTimeout;
    case abi::kInvalidArgument:
    case abi::kInvalidUsage:
      return ErrorKind::kInvalidArgument;
    default:
      return ErrorKind::kSystem;
  }
}

std::string seconds_since(Clock::time_point start) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << std::chrono::duration<double>(Clock::now() - start).count() << " s";
  return os.str();
}

// NCCL moves bytes of any type; a type without an NCCL equivalent travels as uint8.
std::pair<abi::DataType, size_t> movable(DType t, size_t count) {
  if (t == DType::I16) {
    if (count > std::numeric_limits<size_t>::max() / 2)
      throw Error(ErrorKind::kInvalidArgument, "nccl: element count overflows the byte count");
    return {abi::kUint8, count * 2};
  }
  return {to_nccl(t), count};
}

void check_buffer(uintptr_t p, size_t count, const char* what, const std::string& op) {
  if (p == 0 && count > 0)
    throw Error(ErrorKind::kInvalidArgument,
                op + ": " + what + " is a null address for " + std::to_string(count) + " elements");
}

}  // namespace

abi::DataType to_nccl(DType t) {
  switch (t) {
    case DType::F32:
      return abi::kFloat32;
    case DType::F16:
      return abi::kFloat16;
    case DType::BF16:
      return abi::kBfloat16;  // NCCL 2.10+, below NcclLibrary's minimum
    case DType::F64:
      return abi::kFloat64;
    case DType::I32:
      return abi::kInt32;
    case DType::I64:
      return abi::kInt64;
    case DType::U8:
      return abi::kUint8;
    case DType::I8:
      return abi::kInt8;
    case DType::I16:
      break;
  }
  throw Error(ErrorKind::kInvalidArgument,
              "nccl: dtype " + std::string(dtype_name(t)) +
                  " has no NCCL type, so NCCL cannot reduce it (data movement moves it as bytes)");
}

abi::RedOp to_nccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
      return abi::kSum;
    case ReduceOp::AVG:
      return abi::kAvg;  // NCCL 2.10+, below NcclLibrary's minimum
    case ReduceOp::MIN:
      return abi::kMin;
    case ReduceOp::MAX:
      return abi::kMax;
    case ReduceOp::PROD:
      return abi::kProd;
  }
  throw Error(ErrorKind::kInvalidArgument,
              "nccl: reduce op code " + std::to_string(static_cast<int>(op)) + " has no NCCL equivalent");
}

// The average of one rank is its input. NCCL 2.28.9's one-rank ncclAvg leaves the last element
// of an odd-length out-of-place float64 call unwritten (seen on an H200, through rumor and through
// cupy's own ncclAllReduce of 4099 doubles; even lengths, float32 and ncclSum were right).
abi::RedOp to_nccl(ReduceOp op, int nranks) {
  return op == ReduceOp::AVG && nranks == 1 ? abi::kSum : to_nccl(op);
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<const NcclLibrary> lib, const UniqueIdBytes& id,
                                   int nranks, int rank, const std::function<void()>& bind_device,
                                   Deadline deadline, double timeout_s)
    : lib_(std::move(lib)),
      api_(lib_ ? lib_->api() : Api{}),
      nranks_(nranks),
      rank_(rank),
      timeout_s_(timeout_s) {
  if (!lib_) throw Error(ErrorKind::kInvalidArgument, "nccl init: no NCCL library");
  if (nranks < 1)
    throw Error(ErrorKind::kInvalidArgument,
                "nccl init: group size must be at least 1, got " + std::to_string(nranks));
  if (rank < 0 || rank >= nranks)
    throw Error(ErrorKind::kInvalidArgument, "nccl init: rank " + std::to_string(rank) +
                                                 " is outside a group of size " + std::to_string(nranks));
  set_timeout(timeout_s);

  abi::UniqueId uid{};
  std::memcpy(uid.internal, id.data(), sizeof(uid.internal));
  abi::Config config{};
  config.size = sizeof(config);
  config.magic = abi::kConfigMagic;
  config.version = static_cast<unsigned int>(abi::version_code(2, 14, 0));
  config.blocking = 0;
  if (bind_device) bind_device();

  const std::string op = "nccl init";
  std::lock_guard<std::mutex> lk(mu_);
  abi::Result r = api_.comm_init_rank_config(&comm_, nranks, uid, rank, &config);
  if (r != abi::kSuccess && r != abi::kInProgress) {
    std::string reason = "ncclCommInitRankConfig failed: " + nccl_reason(r);
    // A handle returned with an error may still own NCCL resources; abort releases them.
    if (comm_ != nullptr) fail(kind_of(r), op, reason);
    aborted_.store(true, std::memory_order_release);
    throw Error(kind_of(r), who(op) + ": " + reason);
  }
  settle(
      r, op, deadline,
      "all " + std::to_string(nranks) +
          " ranks to call ncclCommInitRankConfig with the same unique id "
          "(ranks that never joined, a unique id not shared with every rank, or a network NCCL cannot use)");
  RUMOR_LOG(kDebug, who(op) << ": ready (NCCL " << lib_->version() << ")");
}

NcclCommunicator::~NcclCommunicator() {
  try {
    close();
  } catch (const std::exception& e) {
    RUMOR_LOG(kWarn, "nccl: destroying rank " << rank_ << " of " << nranks_ << ": " << e.what());
  }
}

void NcclCommunicator::set_timeout(double seconds) {
  if (!(seconds > 0) || !std::isfinite(seconds))
    throw Error(ErrorKind::kInvalidArgument,
                "nccl: timeout must be positive and finite, got " + std::to_string(seconds) + " s");
  timeout_s_.store(seconds, std::memory_order_relaxed);
}

std::string NcclCommunicator::who(const std::string& op) const {
  return op + ": rank " + std::to_string(rank_) + " of " + std::to_string(nranks_);
}

std::string NcclCommunicator::nccl_reason(abi::Result r) const {
  std::string s = lib_->error_string(r);
  // The last error is NCCL's own line about what failed (a peer's address, a CUDA call).
  const char* last = api_.get_last_error != nullptr ? api_.get_last_error(comm_) : nullptr;
  if (last != nullptr && *last) s.append("; NCCL's last error: ").append(last);
  return s;
}

void NcclCommunicator::abort_locked(const std::string& reason) {
  if (aborted_.load(std::memory_order_acquire)) return;
  abort_reason_ = reason;
  aborted_.store(true, std::memory_order_release);
  if (comm_ == nullptr) return;
  // Abort stops NCCL's kernels and proxy threads even mid-operation and frees the communicator.
  if (abi::Result r = api_.comm_abort(comm_); r != abi::kSuccess)
    RUMOR_LOG(kWarn, who("nccl abort") << ": ncclCommAbort returned " << lib_->error_string(r));
  comm_ = nullptr;
}

void NcclCommunicator::fail(ErrorKind kind, const std::string& op, const std::string& reason) {
  abort_locked(who(op) + ": " + reason);
  throw Error(kind,
              who(op) + ": " + reason + "; the communicator was aborted (every later call on it fails)");
}

void NcclCommunicator::throw_if_aborted(const std::string& op) {
  if (!aborted_.load(std::memory_order_acquire) && abort_requested_.load(std::memory_order_acquire))
    abort_locked("abort() was called");
  if (aborted_.load(std::memory_order_acquire))
    throw Error(ErrorKind::kAborted,
                who(op) + ": the NCCL communicator is no longer usable (" + abort_reason_ + ")");
}

void NcclCommunicator::settle(abi::Result r, const std::string& op, Deadline deadline,
                              const std::string& expected) {
  if (r == abi::kSuccess) return;
  if (r != abi::kInProgress) fail(kind_of(r), op, nccl_reason(r));
  const Clock::time_point start = Clock::now();
  Backoff backoff;
  for (;;) {
    // The lock stays held (no other call may run on a nonblocking communicator until this one
    // settles); abort() from another thread is seen through its flag.
    throw_if_aborted(op);
    abi::Result state = abi::kInProgress;
    if (abi::Result q = api_.comm_get_async_error(comm_, &state); q != abi::kSuccess)
      fail(kind_of(q), op, "ncclCommGetAsyncError failed: " + nccl_reason(q));
    if (state == abi::kSuccess) return;
    if (state != abi::kInProgress) fail(kind_of(state), op, nccl_reason(state));
    if (deadline.expired())
      fail(ErrorKind::kTimeout, op, "timed out after " + seconds_since(start) + " waiting for " + expected);
    backoff.pause();
  }
}

template <typename Call>
void NcclCommunicator::enqueue(const std::string& op, Call&& call) {
  std::lock_guard<std::mutex> lk(mu_);
  throw_if_aborted(op);
  const Deadline deadline = Deadline::after(timeout_s());
  settle(call(comm_), op, deadline, "NCCL to accept the operation");
}

void NcclCommunicator::allreduce(uintptr_t send, uintptr_t recv, size_t count, DType dtype, ReduceOp op,
                                 uintptr_t stream) {
  const std::string name = "nccl allreduce";
  check_buffer(send, count, "send buffer", name);
  check_buffer(recv, count, "receive buffer", name);
  const abi::DataType t = to_nccl(dtype);
  const abi::RedOp o = to_nccl(op, nranks_);
  enqueue(name, [&](abi::Comm c) {
    return api_.all_reduce(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv), count, t, o, c,
                           reinterpret_cast<abi::Stream>(stream));
  });
}

void NcclCommunicator::broadcast(uintptr_t send, uintptr_t recv, size_t count, DType dtype, int root,
                                 uintptr_t stream) {
  const std::string name = "nccl broadcast";
  if (root < 0 || root >= nranks_)
    throw Error(ErrorKind::kInvalidArgument,
                who(name) + ": root " + std::to_string(root) + " is outside the group");
  // Only the root reads a send buffer.
  if (rank_ == root) check_buffer(send, count, "send buffer", name);
  check_buffer(recv, count, "receive buffer", name);
  const auto [t, n] = movable(dtype, count);
  enqueue(name, [&, t = t, n = n](abi::Comm c) {
    return api_.broadcast(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv), n, t, root, c,
                          reinterpret_cast<abi::Stream>(stream));
  });
}

void NcclCommunicator::reduce(uintptr_t send, uintptr_t recv, size_t count, DType dtype, ReduceOp op,
                              int root, uintptr_t stream) {
  const std::string name = "nccl reduce";
  if (root < 0 || root >= nranks_)
    throw Error(ErrorKind::kInvalidArgument,
                who(name) + ": root " + std::to_string(root) + " is outside the group");
  check_buffer(send, count, "send buffer", name);
  if (rank_ == root) check_buffer(recv, count, "receive buffer", name);
  const abi::DataType t = to_nccl(dtype);
  const abi::RedOp o = to_nccl(op, nranks_);
  enqueue(name, [&](abi::Comm c) {
    return api_.reduce(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv), count, t, o, root,
                       c, reinterpret_cast<abi::Stream>(stream));
  });
}

void NcclCommunicator::allgather(uintptr_t send, uintptr_t recv, size_t send_count, DType dtype,
                                 uintptr_t stream) {
  const std::string name = "nccl allgather";
  check_buffer(send, send_count, "send buffer", name);
  check_buffer(recv, send_count, "receive buffer", name);
  if (send_count > std::numeric_limits<size_t>::max() / static_cast<size_t>(nranks_))
    throw Error(ErrorKind::kInvalidArgument, who(name) + ": the gathered element count overflows");
  const auto [t, n] = movable(dtype, send_count);
  enqueue(name, [&, t = t, n = n](abi::Comm c) {
    return api_.all_gather(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv), n, t, c,
                           reinterpret_cast<abi::Stream>(stream));
  });
}

void NcclCommunicator::reduce_scatter(uintptr_t send, uintptr_t recv, size_t recv_count, DType dtype,
                                      ReduceOp op, uintptr_t stream) {
  const std::string name = "nccl reduce_scatter";
  check_buffer(send, recv_count, "send buffer", name);
  check_buffer(recv, recv_count, "receive buffer", name);
  if (recv_count > std::numeric_limits<size_t>::max() / static_cast<size_t>(nranks_))
    throw Error(ErrorKind::kInvalidArgument, who(name) + ": the scattered element count overflows");
  const abi::DataType t = to_nccl(dtype);
  const abi::RedOp o = to_nccl(op, nranks_);
  enqueue(name, [&](abi::Comm c) {
    return api_.reduce_scatter(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv), recv_count,
                               t, o, c, reinterpret_cast<abi::Stream>(stream));
  });
}

void NcclCommunicator::send(uintptr_t buf, size_t count, DType dtype, int peer, uintptr_t stream) {
  exchange({P2p{buf, count, peer}}, {}, dtype, stream);
}

void NcclCommunicator::recv(uintptr_t buf, size_t count, DType dtype, int peer, uintptr_t stream) {
  exchange({}, {P2p{buf, count, peer}}, dtype, stream);
}

void NcclCommunicator::exchange(const std::vector<P2p>& sends, const std::vector<P2p>& recvs, DType dtype,
                                uintptr_t stream) {
  const std::string name =
      sends.size() + recvs.size() == 1 ? (sends.empty() ? "nccl recv" : "nccl send") : "nccl exchange";
  for (const auto* list : {&sends, &recvs})
    for (const P2p& p : *list) {
      if (p.peer < 0 || p.peer >= nranks_)
        throw Error(ErrorKind::kInvalidArgument,
                    who(name) + ": peer " + std::to_string(p.peer) + " is outside the group");
      check_buffer(p.buf, p.count, list == &sends ? "send buffer" : "receive buffer", name);
      movable(dtype, p.count);  // validates the count
    }
  if (sends.empty() && recvs.empty()) return;
  const auto s = reinterpret_cast<abi::Stream>(stream);
  enqueue(name, [&](abi::Comm c) {
    // One group: NCCL starts every transfer together, so rings of sends and receives between
    // ranks cannot wait on each other.
    abi::Result r = api_.group_start();
    if (r != abi::kSuccess) return r;
    // A nonblocking communicator may answer ncclInProgress to any call; only ncclGroupEnd's
    // answer is then waited on (by enqueue), as NCCL asks.
    auto ok = [](abi::Result x) { return x == abi::kSuccess || x == abi::kInProgress; };
    for (const P2p& p : sends) {
      const auto [t, n] = movable(dtype, p.count);
      if (r = api_.send(reinterpret_cast<const void*>(p.buf), n, t, p.peer, c, s); !ok(r)) break;
    }
    if (ok(r))
      for (const P2p& p : recvs) {
        const auto [t, n] = movable(dtype, p.count);
        if (r = api_.recv(reinterpret_cast<void*>(p.buf), n, t, p.peer, c, s); !ok(r)) break;
      }
    // The group is always closed, also after a failed call, so this thread's NCCL group state
    // does not leak into its next operation; the first error wins.
    const abi::Result end = api_.group_end();
    return ok(r) ? end : r;
  });
}

void NcclCommunicator::check(const std::string& op) {
  std::lock_guard<std::mutex> lk(mu_);
  throw_if_aborted(op);
  abi::Result state = abi::kSuccess;
  if (abi::Result q = api_.comm_get_async_error(comm_, &state); q != abi::kSuccess)
    fail(kind_of(q), op, "ncclCommGetAsyncError failed: " + nccl_reason(q));
  if (state != abi::kSuccess && state != abi::kInProgress)
    fail(kind_of(state), op, "NCCL reported an asynchronous error: " + nccl_reason(state));
}

void NcclCommunicator::wait(const std::function<bool()>& completed, Deadline deadline,
                            const std::string& op) {
  const Clock::time_point start = Clock::now();
  Backoff backoff;
  for (;;) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      throw_if_aborted(op);
    }
    bool done = false;
    try {
      done = completed();
    } catch (const std::exception& e) {
      // The stream's state is unknown (a CUDA error is sticky): stop NCCL before reporting.
      std::lock_guard<std::mutex> lk(mu_);
      fail(ErrorKind::kSystem, op, std::string("the completion query failed: ") + e.what());
    }
    if (done) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      throw_if_aborted(op);
      abi::Result state = abi::kSuccess;
      if (abi::Result q = api_.comm_get_async_error(comm_, &state); q != abi::kSuccess)
        fail(kind_of(q), op, "ncclCommGetAsyncError failed: " + nccl_reason(q));
      if (state != abi::kSuccess && state != abi::kInProgress)
        fail(kind_of(state), op, "NCCL reported an asynchronous error: " + nccl_reason(state));
      if (deadline.expired())
        fail(ErrorKind::kTimeout, op,
             "not complete after " + seconds_since(start) +
                 ": waited for the operation's work on the stream to finish (a peer that never called it, "
                 "or called a different operation, leaves it waiting)");
    }
    backoff.pause();
  }
}

void NcclCommunicator::abort() {
  // The flag first: a thread polling under the lock sees it and aborts within one poll, so this
  // call never waits longer than that for the lock.
  abort_requested_.store(true, std::memory_order_release);
  std::lock_guard<std::mutex> lk(mu_);
  abort_locked("abort() was called");
}

void NcclCommunicator::close() {
  std::lock_guard<std::mutex> lk(mu_);
  if (aborted_.load(std::memory_order_acquire)) return;
  const Deadline deadline = Deadline::after(timeout_s());
  if (api_.comm_finalize != nullptr) {
    // Finalize completes what was issued (a peer still needs this rank's part of it), so a
    // communicator closed right after its last op leaves no peer waiting.
    settle(api_.comm_finalize(comm_), "nccl finalize", deadline, "the operations already issued to complete");
  }
  abort_reason_ = "closed";
  aborted_.store(true, std::memory_order_release);
  if (abi::Result r = api_.comm_destroy(comm_); r != abi::kSuccess)
    RUMOR_LOG(kWarn, who("nccl destroy") << ": ncclCommDestroy returned " << lib_->error_string(r));
  comm_ = nullptr;
}

}  // namespace rumor::nccl
