// The binary interface NCCL uses to load a network plugin, versions 8 to 12, declared from the
// published layouts (NVIDIA/nccl src/include/plugin/net/net_v*.h). Only the layout, the constants
// and the call signatures matter to NCCL: the names here are ours. NCCL dlsym()s one exported
// struct per version ("ncclNetPlugin_v12", then v11, ... down to the oldest it knows) and calls
// through its function pointers, so every field below must stay exactly where NCCL expects it;
// the static_asserts at the end pin the sizes on LP64 Linux.
#pragma once

#include <cstddef>
#include <cstdint>

namespace rumor::netplugin::abi {

// NCCL's result codes (a C enum: int-sized).
enum Result : int {
  kSuccess = 0,
  kUnhandledCudaError = 1,
  kSystemError = 2,      // an OS call failed (socket errors)
  kInternalError = 3,    // also "not supported" for optional entry points
  kInvalidArgument = 4,  // bad values from the caller
  kInvalidUsage = 5,     // e.g. a message larger than the posted receive buffer
  kRemoteError = 6,      // the peer went away
};

// Log levels and subsystem flags of the logger NCCL passes to init().
enum LogLevel : int {
  kLogNone = 0,
  kLogVersion = 1,
  kLogWarn = 2,
  kLogInfo = 3,
  kLogAbort = 4,
  kLogTrace = 5
};
constexpr unsigned long kLogSubsysInit = 0x1;
constexpr unsigned long kLogSubsysNet = 0x10;

using Logger = void (*)(LogLevel level, unsigned long flags, const char* file, int line, const char* fmt,
                        ...);
// v10+: NCCL's profiler hook for network events; we never call it.
using ProfilerCallback = Result (*)(void** event, int type, void* parent, int64_t plugin_id, void* ext_data);

// Pointer kinds for regMr() and the ptrSupport property.
constexpr int kPtrHost = 0x1;
constexpr int kPtrCuda = 0x2;
constexpr int kPtrDmaBuf = 0x4;

// listen() writes a handle of at most this many bytes; NCCL ships it to the connecting rank.
constexpr size_t kHandleMaxSize = 128;

// Network offload kinds (a C enum); a host-memory plugin reports kDeviceHost, version 0.
enum DeviceType : int { kDeviceHost = 0, kDeviceUnpack = 1 };
constexpr int kDeviceInvalidVersion = 0;

// connect()/accept() fill this only for device-offload plugins; identical layout in v8..v12.
struct DeviceHandle {
  DeviceType type;
  int version;
  void* handle;
  size_t size;
  int needs_proxy_progress;
};

// Virtual NIC description (v9+): 4 physical devices at most up to v11, 8 in v12.
struct VDeviceProps4 {
  int ndevs;
  int devs[4];
};
struct VDeviceProps8 {
  int ndevs;
  int devs[8];
};

// v10+: per-communicator configuration (v10 passes it to connect, v11+ to init).
struct CommConfig {
  int traffic_class;  // -1: undefined
};

// v11+: hints from setNetAttr(); -1 fields are undefined.
struct CommAttr {
  int32_t max_concurrent_peers;
  int32_t min_concurrent_peers;
  int32_t max_flows_per_peer;
  int32_t min_flows_per_peer;
};
struct NetAttr {
  CommAttr send;
  CommAttr recv;
  uint32_t op;
  uint32_t algo;
  uint32_t proto;
};

// Device properties: each version appends fields (v9 adds forceFlush in the middle).
struct PropertiesV8 {
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;
  int reg_is_global;
  int speed_mbps;
  int port;
  float latency;
  int max_comms;
  int max_recvs;
  DeviceType device_type;
  int device_version;
};

struct PropertiesV9 {  // also v10
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;
  int reg_is_global;
  int force_flush;
  int speed_mbps;
  int port;
  float latency;
  int max_comms;
  int max_recvs;
  DeviceType device_type;
  int device_version;
  VDeviceProps4 vprops;
  size_t max_p2p_bytes;
  size_t max_coll_bytes;
};

struct PropertiesV11 {
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;
  int reg_is_global;
  int force_flush;
  int speed_mbps;
  int port;
  float latency;
  int max_comms;
  int max_recvs;
  DeviceType device_type;
  int device_version;
  VDeviceProps4 vprops;
  size_t max_p2p_bytes;
  size_t max_coll_bytes;
  int max_multi_request_size;
};

struct PropertiesV12 {
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;
  int reg_is_global;
  int force_flush;
  int speed_mbps;
  int port;
  float latency;
  int max_comms;
  int max_recvs;
  DeviceType device_type;
  int device_version;
  VDeviceProps8 vprops;
  size_t max_p2p_bytes;
  size_t max_coll_bytes;
  int max_multi_request_size;
  int16_t rail_id;   // -1: undefined
  int16_t plane_id;  // -1: undefined
};

// The function tables. Entry points common to all versions keep their order; what changed:
//   v8:  int sizes in isend/irecv; init(logger); listen/connect(dev, ...)
//   v9:  size_t sizes; makeVDevice appended
//   v10: init(logger, profiler); connect(dev, config, ...); isend/irecv take profiler handles
//   v11: init(&ctx, commId, config, logger, profiler); listen/connect(ctx, dev, ...); finalize,
//        setNetAttr appended
//   v12: same calls as v11 with the larger property / vNIC structs
struct NetV8 {
  const char* name;
  Result (*init)(Logger logger);
  Result (*devices)(int* ndev);
  Result (*get_properties)(int dev, PropertiesV8* props);
  Result (*listen)(int dev, void* handle, void** listen_comm);
  Result (*connect)(int dev, void* handle, void** send_comm, DeviceHandle** send_dev_comm);
  Result (*accept)(void* listen_comm, void** recv_comm, DeviceHandle** recv_dev_comm);
  Result (*reg_mr)(void* comm, void* data, size_t size, int type, void** mhandle);
  Result (*reg_mr_dmabuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                          void** mhandle);
  Result (*dereg_mr)(void* comm, void* mhandle);
  Result (*isend)(void* send_comm, void* data, int size, int tag, void* mhandle, void** request);
  Result (*irecv)(void* recv_comm, int n, void** data, int* sizes, int* tags, void** mhandles,
                  void** request);
  Result (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request);
  Result (*test)(void* request, int* done, int* sizes);
  Result (*close_send)(void* send_comm);
  Result (*close_recv)(void* recv_comm);
  Result (*close_listen)(void* listen_comm);
  Result (*get_device_mr)(void* comm, void* mhandle, void** dptr_mhandle);
  Result (*irecv_consumed)(void* recv_comm, int n, void* request);
};

struct NetV9 {
  const char* name;
  Result (*init)(Logger logger);
  Result (*devices)(int* ndev);
  Result (*get_properties)(int dev, PropertiesV9* props);
  Result (*listen)(int dev, void* handle, void** listen_comm);
  Result (*connect)(int dev, void* handle, void** send_comm, DeviceHandle** send_dev_comm);
  Result (*accept)(void* listen_comm, void** recv_comm, DeviceHandle** recv_dev_comm);
  Result (*reg_mr)(void* comm, void* data, size_t size, int type, void** mhandle);
  Result (*reg_mr_dmabuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                          void** mhandle);
  Result (*dereg_mr)(void* comm, void* mhandle);
  Result (*isend)(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request);
  Result (*irecv)(void* recv_comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                  void** request);
  Result (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request);
  Result (*test)(void* request, int* done, int* sizes);
  Result (*close_send)(void* send_comm);
  Result (*close_recv)(void* recv_comm);
  Result (*close_listen)(void* listen_comm);
  Result (*get_device_mr)(void* comm, void* mhandle, void** dptr_mhandle);
  Result (*irecv_consumed)(void* recv_comm, int n, void* request);
  Result (*make_vdevice)(int* d, VDeviceProps4* props);
};

struct NetV10 {
  const char* name;
  Result (*init)(Logger logger, ProfilerCallback profiler);
  Result (*devices)(int* ndev);
  Result (*get_properties)(int dev, PropertiesV9* props);
  Result (*listen)(int dev, void* handle, void** listen_comm);
  Result (*connect)(int dev, CommConfig* config, void* handle, void** send_comm,
                    DeviceHandle** send_dev_comm);
  Result (*accept)(void* listen_comm, void** recv_comm, DeviceHandle** recv_dev_comm);
  Result (*reg_mr)(void* comm, void* data, size_t size, int type, void** mhandle);
  Result (*reg_mr_dmabuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                          void** mhandle);
  Result (*dereg_mr)(void* comm, void* mhandle);
  Result (*isend)(void* send_comm, void* data, size_t size, int tag, void* mhandle, void* phandle,
                  void** request);
  Result (*irecv)(void* recv_comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                  void** phandles, void** request);
  Result (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request);
  Result (*test)(void* request, int* done, int* sizes);
  Result (*close_send)(void* send_comm);
  Result (*close_recv)(void* recv_comm);
  Result (*close_listen)(void* listen_comm);
  Result (*get_device_mr)(void* comm, void* mhandle, void** dptr_mhandle);
  Result (*irecv_consumed)(void* recv_comm, int n, void* request);
  Result (*make_vdevice)(int* d, VDeviceProps4* props);
};

// v11 and v12 share every signature except the property and vNIC structs.
template <typename Props, typename VProps>
struct NetCtx {
  const char* name;
  Result (*init)(void** ctx, uint64_t comm_id, CommConfig* config, Logger logger, ProfilerCallback profiler);
  Result (*devices)(int* ndev);
  Result (*get_properties)(int dev, Props* props);
  Result (*listen)(void* ctx, int dev, void* handle, void** listen_comm);
  Result (*connect)(void* ctx, int dev, void* handle, void** send_comm, DeviceHandle** send_dev_comm);
  Result (*accept)(void* listen_comm, void** recv_comm, DeviceHandle** recv_dev_comm);
  Result (*reg_mr)(void* comm, void* data, size_t size, int type, void** mhandle);
  Result (*reg_mr_dmabuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                          void** mhandle);
  Result (*dereg_mr)(void* comm, void* mhandle);
  Result (*isend)(void* send_comm, void* data, size_t size, int tag, void* mhandle, void* phandle,
                  void** request);
  Result (*irecv)(void* recv_comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                  void** phandles, void** request);
  Result (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request);
  Result (*test)(void* request, int* done, int* sizes);
  Result (*close_send)(void* send_comm);
  Result (*close_recv)(void* recv_comm);
  Result (*close_listen)(void* listen_comm);
  Result (*get_device_mr)(void* comm, void* mhandle, void** dptr_mhandle);
  Result (*irecv_consumed)(void* recv_comm, int n, void* request);
  Result (*make_vdevice)(int* d, VProps* props);
  Result (*finalize)(void* ctx);
  Result (*set_net_attr)(void* ctx, NetAttr* attr);
};
using NetV11 = NetCtx<PropertiesV11, VDeviceProps4>;
using NetV12 = NetCtx<PropertiesV12, VDeviceProps8>;

// Pinned sizes (LP64): a field added or moved by mistake shows up here, not as a corrupted call.
static_assert(sizeof(DeviceHandle) == 32);
static_assert(sizeof(PropertiesV8) == 64);
static_assert(sizeof(PropertiesV9) == 104);
static_assert(sizeof(PropertiesV11) == 112);
static_assert(sizeof(PropertiesV12) == 128);
static_assert(sizeof(NetAttr) == 44);
static_assert(sizeof(NetV8) == 19 * sizeof(void*));
static_assert(sizeof(NetV9) == 20 * sizeof(void*));
static_assert(sizeof(NetV10) == 20 * sizeof(void*));
static_assert(sizeof(NetV11) == 22 * sizeof(void*));
static_assert(sizeof(NetV12) == 22 * sizeof(void*));

}  // namespace rumor::netplugin::abi
