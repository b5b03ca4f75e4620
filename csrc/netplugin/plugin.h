// The version-neutral core of the NCCL net plugin (exports.cpp adapts it to each NCCL ABI version).
//
// One send comm / recv comm is one NCCL connection: `streams` TCP sockets between the same two
// processes. The sender cuts a message into chunks of `chunk` bytes; a stream thread that is free
// takes the next chunk (work stealing), so a slow socket carries fewer chunks instead of holding
// the whole message back as a static equal split would. Every chunk carries a header with the
// message sequence number, tag, total size and offset, so the receiver places it wherever it
// arrives from. Messages are matched to posted receives in the sender's order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "net/tls.h"
#include "netplugin/nccl_net_api.h"
#include "netplugin/wire.h"

namespace rumor::netplugin {

// Grouped receives: one irecv may post up to this many buffers (NCCL's maxRecvs property).
constexpr int kMaxRecvs = 8;

// Settings read once from the environment at the first init().
struct Config {
  int streams = 4;  // RUMOR_NET_PLUGIN_STREAMS (1..16)
  // RUMOR_NET_PLUGIN_CHUNK_KB (4..16384 KiB). 256 KiB: on 4 emulated hosts (2 cores) a ring at
  // 1 Gbit ran at 0.94 of the link with it against 0.92 with 64 KiB, unshaped 1.45x faster: each
  // chunk costs a header and a wake-up of a stream thread, and four hosts' threads share the CPU.
  size_t chunk = 256 << 10;
  double timeout_s = 300;  // RUMOR_NET_PLUGIN_TIMEOUT: deadline of every setup step
  // RUMOR_NET_PLUGIN_HELLO_TIMEOUT (1..timeout_s): an accepted socket that has not completed its
  // handshake within this is dropped, so half-open connections cannot pile up on a listener.
  double hello_timeout_s = 5;
  // RUMOR_NET_PLUGIN_TRACE: log this many data-path events (connect, accept, isend, irecv,
  // matches, completions) at NCCL's INFO level, for finding where a job stalls; 0 = none.
  long trace_lines = 0;
};

// One network interface offered to NCCL as a device.
struct DeviceInfo {
  std::string name;      // "eth0"
  std::string ip;        // numeric address advertised in listen handles
  std::string pci_path;  // /sys path of the NIC, empty for virtual interfaces
  int speed_mbps = 0;
};

// Process-wide setup: reads the environment and the interfaces once (later calls only update the
// logger). Returns kInternalError when no usable interface exists.
abi::Result init(abi::Logger logger);
const Config& config();
// The job key (RUMOR_JOB_SECRET or RUMOR_JOB_SECRET_FILE, read at init); null when the plugin runs
// unauthenticated (no secret given: one warning at init).
const wire::Key* auth_key();
// RUMOR_NET_PLUGIN_TLS=1: the TLS context every stream's session uses (read at init from
// RUMOR_TLS_CERT / _KEY / _CA / _PEER_NAME); null when TLS is off.
std::shared_ptr<const net::TlsContext> tls_context();
// Through NCCL's logger (stderr for warnings when init() got none).
void log(abi::LogLevel level, const std::string& msg);
// True while RUMOR_NET_PLUGIN_TRACE's budget of lines lasts (each true answer spends one).
bool tracing();
int device_count();
const DeviceInfo& device(int dev);  // dev in [0, device_count())
// NCCL keeps the name / PCI path pointers of getProperties(): these stay valid for the process.
char* device_name_cstr(int dev);
char* device_pci_cstr(int dev);  // nullptr when the interface has no PCI device

// v11+ per-communicator context handed back from init(&ctx, ...) and released by finalize().
abi::Result ctx_create(void** ctx, uint64_t comm_id, const abi::CommConfig* cfg);
abi::Result ctx_destroy(void* ctx);

abi::Result listen(int dev, void* handle, void** listen_comm);
// Never blocks: returns *send_comm == nullptr until every stream is connected; NCCL calls again
// with the same handle, whose spare bytes hold the connection in progress.
abi::Result connect(int dev, void* handle, void** send_comm);
abi::Result accept(void* listen_comm, void** recv_comm);
abi::Result reg_mr(void* comm, void* data, size_t size, int type, void** mhandle);
abi::Result dereg_mr(void* comm, void* mhandle);
abi::Result isend(void* send_comm, const void* data, size_t size, int tag, void** request);
abi::Result irecv(void* recv_comm, int n, void* const* data, const size_t* sizes, const int* tags,
                  void** request);
abi::Result iflush(void* recv_comm, void** request);
// sizes: one int per buffer of the request (n for a grouped receive), may be null.
abi::Result test(void* request, int* done, int* sizes);
abi::Result close_send(void* send_comm);
abi::Result close_recv(void* recv_comm);
abi::Result close_listen(void* listen_comm);

}  // namespace rumor::netplugin
