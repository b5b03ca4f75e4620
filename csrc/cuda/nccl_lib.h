// NCCL loaded at run time. rumor neither links libnccl nor includes nccl.h: one build serves
// every NCCL a user has (the nvidia-nccl wheel torch depends on, a system install, or none at
// all on CPU-only machines), and importing rumor never fails for want of it. The Python side
// decides which files to try (rumor/_nccl.py: RUMOR_NCCL_LIBRARY, the nvidia.nccl wheel, torch's
// lib folder, then the loader's search path); this class only opens what it is given.
//
// CUDA-free on purpose (streams are void*), so it builds and is tested where there is no nvcc.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/nccl_api.h"

namespace rumor::nccl {

using UniqueIdBytes = std::array<uint8_t, abi::kUniqueIdBytes>;

// The entry points rumor calls. Those marked optional may be null; every other one is non-null
// in a loaded library.
struct Api {
  abi::GetVersionFn get_version = nullptr;
  abi::GetUniqueIdFn get_unique_id = nullptr;
  abi::CommInitRankConfigFn comm_init_rank_config = nullptr;
  abi::CommGetAsyncErrorFn comm_get_async_error = nullptr;
  abi::CommAbortFn comm_abort = nullptr;
  abi::CommDestroyFn comm_destroy = nullptr;
  abi::CommFinalizeFn comm_finalize = nullptr;  // optional
  abi::GetErrorStringFn get_error_string = nullptr;
  abi::GetLastErrorFn get_last_error = nullptr;  // optional
  abi::AllReduceFn all_reduce = nullptr;
  abi::BroadcastFn broadcast = nullptr;
  abi::ReduceFn reduce = nullptr;
  abi::AllGatherFn all_gather = nullptr;
  abi::ReduceScatterFn reduce_scatter = nullptr;
  abi::SendFn send = nullptr;
  abi::RecvFn recv = nullptr;
  abi::GroupStartFn group_start = nullptr;
  abi::GroupEndFn group_end = nullptr;
  abi::CommCountFn comm_count = nullptr;
  abi::CommUserRankFn comm_user_rank = nullptr;
};

class NcclLibrary {
 public:
  // 2.14 is the oldest release whose communicators can be created without blocking
  // (ncclCommInitRankConfig with blocking = 0, ncclInProgress, ncclCommFinalize). A blocking
  // ncclCommInitRank that waits for a dead peer cannot be bounded: no communicator handle exists
  // to abort until it returns, and rumor never makes a wait without a deadline. Everything else
  // rumor uses is older (ncclAvg and bfloat16: 2.10; send/recv: 2.7). torch 2.0 shipped 2.14.3
  // and every later torch a newer NCCL, so this excludes no torch 2.x install.
  static constexpr int kMinMajor = 2;
  static constexpr int kMinMinor = 14;
  static constexpr int kMinVersionCode = abi::version_code(kMinMajor, kMinMinor, 0);

  // Opens the first candidate that is an NCCL library of at least kMinVersionCode and resolves
  // every entry point. A candidate containing '/' is a file path (it must exist); any other is a
  // name for the dynamic loader's search (LD_LIBRARY_PATH, the ld cache, libraries already
  // loaded: if torch loaded libnccl.so.2, its copy is shared). When none is usable, throws
  // Error(kSystem) that lists every candidate with why it was rejected: file not found, the
  // loader's message, "not an NCCL library: missing symbol X", or "too old: NCCL a.b.c < 2.14".
  explicit NcclLibrary(const std::vector<std::string>& candidates);
  ~NcclLibrary();
  NcclLibrary(const NcclLibrary&) = delete;
  NcclLibrary& operator=(const NcclLibrary&) = delete;

  // The file that was opened (as the loader resolved it).
  const std::string& path() const { return path_; }
  // NCCL_VERSION_CODE of the loaded library and its "major.minor.patch" form.
  int version_code() const { return version_code_; }
  const std::string& version() const { return version_; }
  const Api& api() const { return api_; }

  // A fresh ncclUniqueId: NCCL's rank 0 makes it (it also starts NCCL's bootstrap listener in
  // this process) and every rank of the new communicator must receive these bytes.
  UniqueIdBytes unique_id() const;

  // NCCL's text for a result code ("unknown NCCL result N" when the library gives none).
  std::string error_string(abi::Result r) const;

  // "a.b.c" of an NCCL_VERSION_CODE (either encoding).
  static std::string version_string(int code);

 private:
  void* handle_ = nullptr;
  std::string path_;
  int version_code_ = 0;
  std::string version_;
  Api api_;
};

}  // namespace rumor::nccl
