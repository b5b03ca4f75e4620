// The part of NCCL's C API rumor calls, declared by us from the published header (NVIDIA/nccl
// src/nccl.h.in) so that rumor builds without nccl.h, without libnccl and without a CUDA header:
// the library is dlopen()ed at run time (cuda/nccl_lib.h) and called through the pointer types
// below. Only values, layouts and signatures must match NCCL's; the names are ours.
//
// cudaStream_t is a pointer to an opaque struct, so streams cross as void*; NCCL's enums are
// plain C enums, int-sized on every ABI NCCL supports. The static_asserts pin what the ABI needs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace rumor::nccl::abi {

// ncclResult_t. kInProgress (2.14+) is what a nonblocking communicator returns while a call is
// still being carried out in the background; kTimeout only exists in recent releases.
enum Result : int {
  kSuccess = 0,
  kUnhandledCudaError = 1,
  kSystemError = 2,
  kInternalError = 3,
  kInvalidArgument = 4,
  kInvalidUsage = 5,
  kRemoteError = 6,
  kInProgress = 7,
  kTimeout = 8,
};

// ncclDataType_t (values stable since 2.0; bfloat16 from 2.10).
enum DataType : int {
  kInt8 = 0,
  kUint8 = 1,
  kInt32 = 2,
  kUint32 = 3,
  kInt64 = 4,
  kUint64 = 5,
  kFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBfloat16 = 9,
};

// ncclRedOp_t's built-in operations (kAvg from 2.10).
enum RedOp : int {
  kSum = 0,
  kProd = 1,
  kMax = 2,
  kMin = 3,
  kAvg = 4,
};

// ncclUniqueId: 128 opaque bytes made by one rank and handed to all others out of band.
constexpr size_t kUniqueIdBytes = 128;
struct UniqueId {
  char internal[kUniqueIdBytes];
};

// ncclConfig_t as NCCL 2.14 defined it: the versioned prefix (size, magic, version) and
// `blocking`. Every later NCCL only appends fields, copies min(config.size, its own sizeof) bytes
// and resets each field newer than config.version to its default, so this shorter struct with
// version 2.14.0 is read correctly by 2.14 and every release after it (checked against the
// parsers of 2.14, 2.17, 2.18 and 2.30). Declaring a newer layout would buy nothing: the later
// fields (CTA counts, net name, ...) are tuning knobs rumor leaves at NCCL's defaults.
struct Config {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;  // 0: init and every call return kInProgress instead of blocking
};
constexpr unsigned int kConfigMagic = 0xcafebeef;

// NCCL_VERSION(): 2.8 and older encode x*1000 + y*100 + z, later releases x*10000 + y*100 + z.
constexpr int version_code(int major, int minor, int patch) {
  return (major <= 2 && minor <= 8) ? major * 1000 + minor * 100 + patch
                                    : major * 10000 + minor * 100 + patch;
}

// An opaque ncclComm_t.
using Comm = struct OpaqueComm*;
using Stream = void*;

extern "C" {
using GetVersionFn = Result (*)(int* version);
using GetUniqueIdFn = Result (*)(UniqueId* id);
using CommInitRankConfigFn = Result (*)(Comm* comm, int nranks, UniqueId id, int rank, Config* config);
using CommInitRankFn = Result (*)(Comm* comm, int nranks, UniqueId id, int rank);
using CommGetAsyncErrorFn = Result (*)(Comm comm, Result* async_error);
using CommAbortFn = Result (*)(Comm comm);
using CommDestroyFn = Result (*)(Comm comm);
using CommFinalizeFn = Result (*)(Comm comm);
using GetErrorStringFn = const char* (*)(Result result);
using GetLastErrorFn = const char* (*)(Comm comm);
using AllReduceFn = Result (*)(const void* send, void* recv, size_t count, DataType dtype, RedOp op,
                               Comm comm, Stream stream);
using BroadcastFn = Result (*)(const void* send, void* recv, size_t count, DataType dtype, int root,
                               Comm comm, Stream stream);
using ReduceFn = Result (*)(const void* send, void* recv, size_t count, DataType dtype, RedOp op, int root,
                            Comm comm, Stream stream);
using AllGatherFn = Result (*)(const void* send, void* recv, size_t send_count, DataType dtype, Comm comm,
                               Stream stream);
using ReduceScatterFn = Result (*)(const void* send, void* recv, size_t recv_count, DataType dtype, RedOp op,
                                   Comm comm, Stream stream);
using SendFn = Result (*)(const void* send, size_t count, DataType dtype, int peer, Comm comm, Stream stream);
using RecvFn = Result (*)(void* recv, size_t count, DataType dtype, int peer, Comm comm, Stream stream);
using GroupStartFn = Result (*)();
using GroupEndFn = Result (*)();
using CommCountFn = Result (*)(Comm comm, int* count);
using CommUserRankFn = Result (*)(Comm comm, int* rank);
}

static_assert(sizeof(Result) == 4 && sizeof(DataType) == 4 && sizeof(RedOp) == 4, "NCCL enums are int-sized");
static_assert(sizeof(UniqueId) == 128, "ncclUniqueId is 128 bytes");
static_assert(offsetof(Config, size) == 0 && offsetof(Config, magic) == 8 &&
                  offsetof(Config, version) == 12 && offsetof(Config, blocking) == 16,
              "ncclConfig_t v2.14 prefix layout (LP64)");
static_assert(version_code(2, 8, 4) == 2804 && version_code(2, 14, 3) == 21403, "NCCL_VERSION encoding");

}  // namespace rumor::nccl::abi
