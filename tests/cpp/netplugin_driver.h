// Loads libnccl-net-rumor.so the way NCCL does (dlopen + dlsym of ncclNetPlugin_vN) and drives any
// exported version through that version's own signatures. Shared by test_netplugin.cpp and the
// two-host harness netplugin_peer.cpp.
#pragma once

#include <dlfcn.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "netplugin/nccl_net_api.h"

namespace rumor::netplugin::testing {

namespace abi = rumor::netplugin::abi;

// What Driver::wait() returns when its deadline passed (not a plugin result code).
constexpr abi::Result kTimedOut = static_cast<abi::Result>(-1);

inline void* open_plugin(const std::string& path) {
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) throw std::runtime_error("dlopen " + path + ": " + ::dlerror());
  return lib;
}

template <typename Net>
const char* symbol_name() {
  if constexpr (std::is_same_v<Net, abi::NetV8>) return "ncclNetPlugin_v8";
  if constexpr (std::is_same_v<Net, abi::NetV9>) return "ncclNetPlugin_v9";
  if constexpr (std::is_same_v<Net, abi::NetV10>) return "ncclNetPlugin_v10";
  if constexpr (std::is_same_v<Net, abi::NetV11>) return "ncclNetPlugin_v11";
  if constexpr (std::is_same_v<Net, abi::NetV12>) return "ncclNetPlugin_v12";
}

template <typename Net>
Net* find_table(void* lib) {
  return static_cast<Net*>(::dlsym(lib, symbol_name<Net>()));
}

// Everything the plugin logs, for assertions; printed to stderr when `echo` is set.
struct LogSink {
  std::mutex mu;
  std::vector<std::string> lines;
  bool echo = false;
  bool contains(const std::string& s) {
    std::lock_guard<std::mutex> lk(mu);
    for (const auto& l : lines)
      if (l.find(s) != std::string::npos) return true;
    return false;
  }
};
inline LogSink& log_sink() {
  static LogSink sink;
  return sink;
}
inline void capture_log(abi::LogLevel level, unsigned long, const char*, int, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  LogSink& s = log_sink();
  std::lock_guard<std::mutex> lk(s.mu);
  s.lines.emplace_back(buf);
  if (s.echo || level == abi::kLogWarn)
    std::fprintf(stderr, "[plugin %s] %s\n", level == abi::kLogWarn ? "WARN" : "INFO", buf);
}

// One exported table seen through uniform calls; each call uses that version's own signature
// (int sizes in v8, profiler arguments from v10, a context from v11).
template <typename Net>
class Driver {
 public:
  static constexpr bool kHasCtx = std::is_same_v<Net, abi::NetV11> || std::is_same_v<Net, abi::NetV12>;
  static constexpr bool kIntSizes = std::is_same_v<Net, abi::NetV8>;
  static constexpr bool kProfiler = std::is_same_v<Net, abi::NetV10> || kHasCtx;

  explicit Driver(Net* net) : net_(net) {}
  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;
  ~Driver() {
    if constexpr (kHasCtx)
      if (ctx_ != nullptr) net_->finalize(ctx_);
  }

  abi::Result init() {
    if constexpr (kHasCtx) {
      abi::CommConfig cfg{-1};
      return net_->init(&ctx_, 42, &cfg, capture_log, nullptr);
    } else if constexpr (kProfiler) {
      return net_->init(capture_log, nullptr);
    } else {
      return net_->init(capture_log);
    }
  }
  Net* net() { return net_; }

  abi::Result listen(int dev, void* handle, void** comm) {
    if constexpr (kHasCtx)
      return net_->listen(ctx_, dev, handle, comm);
    else
      return net_->listen(dev, handle, comm);
  }
  abi::Result connect(int dev, void* handle, void** comm) {
    abi::DeviceHandle* dh = nullptr;
    if constexpr (kHasCtx) {
      return net_->connect(ctx_, dev, handle, comm, &dh);
    } else if constexpr (kProfiler) {
      abi::CommConfig cfg{-1};
      return net_->connect(dev, &cfg, handle, comm, &dh);
    } else {
      return net_->connect(dev, handle, comm, &dh);
    }
  }
  abi::Result accept(void* listen_comm, void** comm) {
    abi::DeviceHandle* dh = nullptr;
    return net_->accept(listen_comm, comm, &dh);
  }
  abi::Result isend(void* comm, void* data, size_t size, int tag, void** req) {
    if constexpr (kIntSizes)
      return net_->isend(comm, data, static_cast<int>(size), tag, nullptr, req);
    else if constexpr (kProfiler)
      return net_->isend(comm, data, size, tag, nullptr, nullptr, req);
    else
      return net_->isend(comm, data, size, tag, nullptr, req);
  }
  abi::Result irecv(void* comm, int n, void** data, const size_t* sizes, int* tags, void** req) {
    void* mh[8] = {};
    if constexpr (kIntSizes) {
      int isz[8];
      for (int i = 0; i < n; ++i) isz[i] = static_cast<int>(sizes[i]);
      return net_->irecv(comm, n, data, isz, tags, mh, req);
    } else {
      std::vector<size_t> sz(sizes, sizes + n);
      if constexpr (kProfiler) {
        void* ph[8] = {};
        return net_->irecv(comm, n, data, sz.data(), tags, mh, ph, req);
      } else {
        return net_->irecv(comm, n, data, sz.data(), tags, mh, req);
      }
    }
  }
  abi::Result test(void* req, int* done, int* sizes) { return net_->test(req, done, sizes); }

  // What NCCL does once the GPU has consumed a completed receive (versions that have the call).
  abi::Result consumed(void* recv_comm, int n, void* req) {
    if constexpr (requires { net_->irecv_consumed; }) {
      if (net_->irecv_consumed != nullptr) return net_->irecv_consumed(recv_comm, n, req);
    }
    return abi::kSuccess;
  }

  // Loops connect() and accept() (neither blocks) until both ends exist or `seconds` pass.
  bool connect_pair(int dev, void** send_comm, void** recv_comm, void** listen_comm, double seconds = 20) {
    char handle[abi::kHandleMaxSize] = {};
    if (listen(dev, handle, listen_comm) != abi::kSuccess) return false;
    *send_comm = *recv_comm = nullptr;
    auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (*send_comm == nullptr || *recv_comm == nullptr) {
      if (*send_comm == nullptr && connect(dev, handle, send_comm) != abi::kSuccess) return false;
      if (*recv_comm == nullptr && accept(*listen_comm, recv_comm) != abi::kSuccess) return false;
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return true;
  }

  // Polls test() until done or error; returns the error, or kTimedOut on the deadline.
  abi::Result wait(void* req, int* sizes, double seconds = 30) {
    auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (true) {
      int done = 0;
      abi::Result rc = test(req, &done, sizes);
      if (rc != abi::kSuccess || done) return rc;
      if (std::chrono::steady_clock::now() > end) return kTimedOut;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  Net* net_;
  void* ctx_ = nullptr;
};

// Deterministic bytes: message m, byte i.
inline unsigned char pattern(uint64_t m, uint64_t i) {
  return static_cast<unsigned char>((i * 131u + m * 7u + (i >> 12)) & 0xff);
}

}  // namespace rumor::netplugin::testing
