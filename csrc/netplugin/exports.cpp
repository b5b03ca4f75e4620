// The exported plugin tables, one per NCCL net API version (v8..v12), each adapting its own
// signatures to the version-neutral core in plugin.h. NCCL (2.19 and later) tries the newest
// symbol it knows first, so every NCCL from 2.19 on finds one it can use. These are the only
// symbols the library exports (see exports.map).
#include <climits>
#include <vector>

#include "netplugin/nccl_net_api.h"
#include "netplugin/plugin.h"

#define RUMOR_NETPLUGIN_EXPORT __attribute__((visibility("default")))

namespace rumor::netplugin {
namespace {

using abi::Result;

// Every message NCCL hands a net plugin is at most this big (its pre-v9 adapters' limit too), and
// test() reports sizes as int in every version.
constexpr size_t kMaxMessageBytes = size_t{1} << 30;

template <typename Props>
Result get_properties(int dev, Props* p) {
  if (p == nullptr || dev < 0 || dev >= device_count()) return abi::kInvalidArgument;
  *p = Props{};
  p->name = device_name_cstr(dev);
  p->pci_path = device_pci_cstr(dev);
  p->guid = static_cast<uint64_t>(dev);
  p->ptr_support = abi::kPtrHost;
  p->reg_is_global = 0;
  p->speed_mbps = device(dev).speed_mbps;
  p->port = 0;
  p->latency = 0;
  p->max_comms = 65536;
  p->max_recvs = kMaxRecvs;
  p->device_type = abi::kDeviceHost;
  p->device_version = abi::kDeviceInvalidVersion;
  if constexpr (requires { p->force_flush; }) {
    p->force_flush = 0;
    p->vprops.ndevs = 1;
    p->vprops.devs[0] = dev;
    p->max_p2p_bytes = kMaxMessageBytes;
    p->max_coll_bytes = kMaxMessageBytes;
  }
  if constexpr (requires { p->max_multi_request_size; }) p->max_multi_request_size = 1;
  if constexpr (requires { p->rail_id; }) {
    p->rail_id = -1;
    p->plane_id = -1;
  }
  return abi::kSuccess;
}

Result init_v8(abi::Logger logger) { return init(logger); }
Result init_v10(abi::Logger logger, abi::ProfilerCallback) { return init(logger); }
Result init_ctx(void** ctx, uint64_t comm_id, abi::CommConfig* cfg, abi::Logger logger,
                abi::ProfilerCallback) {
  if (ctx == nullptr) return abi::kInvalidArgument;
  Result rc = init(logger);
  return rc != abi::kSuccess ? rc : ctx_create(ctx, comm_id, cfg);
}
Result finalize_ctx(void* ctx) { return ctx_destroy(ctx); }

Result devices(int* ndev) {
  if (ndev == nullptr) return abi::kInvalidArgument;
  *ndev = device_count();
  return abi::kSuccess;
}

Result listen_dev(int dev, void* handle, void** comm) { return listen(dev, handle, comm); }
Result listen_ctx(void*, int dev, void* handle, void** comm) { return listen(dev, handle, comm); }
Result connect_v8(int dev, void* handle, void** comm, abi::DeviceHandle**) {
  return connect(dev, handle, comm);
}
Result connect_v10(int dev, abi::CommConfig*, void* handle, void** comm, abi::DeviceHandle**) {
  return connect(dev, handle, comm);
}
Result connect_ctx(void*, int dev, void* handle, void** comm, abi::DeviceHandle**) {
  return connect(dev, handle, comm);
}
Result accept_any(void* listen_comm, void** comm, abi::DeviceHandle**) { return accept(listen_comm, comm); }

// DMA-BUF, device memory handles and device-side receive completion belong to GPU offload; this
// plugin moves host memory only.
Result reg_mr_dmabuf(void*, void*, size_t, int, uint64_t, int, void**) {
  log(abi::kLogWarn, "NET/rumor: regMrDmaBuf: DMA-BUF registration is not supported (host memory only)");
  return abi::kInternalError;
}
Result get_device_mr(void*, void*, void**) { return abi::kInternalError; }
// NCCL (2.28's net.cc) calls irecvConsumed after the GPU consumed every receive, whatever the
// plugin's device type, with a request test() already completed and freed: nothing to release,
// and the pointer must not be touched. An error here failed every NCCL job after its first
// receive.
Result irecv_consumed(void*, int, void*) { return abi::kSuccess; }
// The hints (peer and flow counts) do not change how a connection is built here: accepted and ignored.
Result set_net_attr(void*, abi::NetAttr*) { return abi::kSuccess; }

Result isend_v8(void* comm, void* data, int size, int tag, void*, void** request) {
  if (size < 0) return abi::kInvalidArgument;
  return isend(comm, data, static_cast<size_t>(size), tag, request);
}
Result isend_v9(void* comm, void* data, size_t size, int tag, void*, void** request) {
  return isend(comm, data, size, tag, request);
}
Result isend_v10(void* comm, void* data, size_t size, int tag, void*, void*, void** request) {
  return isend(comm, data, size, tag, request);
}

Result irecv_v8(void* comm, int n, void** data, int* sizes, int* tags, void**, void** request) {
  if (n < 1 || n > kMaxRecvs || sizes == nullptr) return abi::kInvalidArgument;
  size_t wide[kMaxRecvs];
  for (int i = 0; i < n; ++i) {
    if (sizes[i] < 0) return abi::kInvalidArgument;
    wide[i] = static_cast<size_t>(sizes[i]);
  }
  return irecv(comm, n, data, wide, tags, request);
}
Result irecv_v9(void* comm, int n, void** data, size_t* sizes, int* tags, void**, void** request) {
  return irecv(comm, n, data, sizes, tags, request);
}
Result irecv_v10(void* comm, int n, void** data, size_t* sizes, int* tags, void**, void**, void** request) {
  return irecv(comm, n, data, sizes, tags, request);
}

Result iflush_any(void* comm, int, void**, int*, void**, void** request) { return iflush(comm, request); }

// v11 and v12 differ only in their property and vNIC structs. makeVDevice stays null from v9 on:
// NCCL then uses the physical devices as they are, while a makeVDevice that fails would abort its
// topology setup whenever it tries to fuse two NICs.
template <typename Props, typename VProps>
constexpr abi::NetCtx<Props, VProps> ctx_table() {
  return {"rumor",       init_ctx,      devices,        get_properties<Props>,
          listen_ctx,    connect_ctx,   accept_any,     reg_mr,
          reg_mr_dmabuf, dereg_mr,      isend_v10,      irecv_v10,
          iflush_any,    test,          close_send,     close_recv,
          close_listen,  get_device_mr, irecv_consumed, nullptr,
          finalize_ctx,  set_net_attr};
}

}  // namespace
}  // namespace rumor::netplugin

namespace np = rumor::netplugin;

// Not const: NCCL declares the symbols it looks up as mutable structs.
extern "C" {

RUMOR_NETPLUGIN_EXPORT np::abi::NetV8 ncclNetPlugin_v8 = {
    "rumor",           np::init_v8,       np::devices,        np::get_properties<np::abi::PropertiesV8>,
    np::listen_dev,    np::connect_v8,    np::accept_any,     np::reg_mr,
    np::reg_mr_dmabuf, np::dereg_mr,      np::isend_v8,       np::irecv_v8,
    np::iflush_any,    np::test,          np::close_send,     np::close_recv,
    np::close_listen,  np::get_device_mr, np::irecv_consumed,
};

// makeVDevice: null from v9 on (see ctx_table).
RUMOR_NETPLUGIN_EXPORT np::abi::NetV9 ncclNetPlugin_v9 = {
    "rumor",           np::init_v8,       np::devices,        np::get_properties<np::abi::PropertiesV9>,
    np::listen_dev,    np::connect_v8,    np::accept_any,     np::reg_mr,
    np::reg_mr_dmabuf, np::dereg_mr,      np::isend_v9,       np::irecv_v9,
    np::iflush_any,    np::test,          np::close_send,     np::close_recv,
    np::close_listen,  np::get_device_mr, np::irecv_consumed, nullptr,
};

RUMOR_NETPLUGIN_EXPORT np::abi::NetV10 ncclNetPlugin_v10 = {
    "rumor",           np::init_v10,      np::devices,        np::get_properties<np::abi::PropertiesV9>,
    np::listen_dev,    np::connect_v10,   np::accept_any,     np::reg_mr,
    np::reg_mr_dmabuf, np::dereg_mr,      np::isend_v10,      np::irecv_v10,
    np::iflush_any,    np::test,          np::close_send,     np::close_recv,
    np::close_listen,  np::get_device_mr, np::irecv_consumed, nullptr,
};

RUMOR_NETPLUGIN_EXPORT np::abi::NetV11 ncclNetPlugin_v11 =
    np::ctx_table<np::abi::PropertiesV11, np::abi::VDeviceProps4>();
RUMOR_NETPLUGIN_EXPORT np::abi::NetV12 ncclNetPlugin_v12 =
    np::ctx_table<np::abi::PropertiesV12, np::abi::VDeviceProps8>();

}  // extern "C"
