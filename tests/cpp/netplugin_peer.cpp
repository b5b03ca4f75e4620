// One side of a transfer through the NCCL net plugin, for tests and benchmarks across emulated
// hosts (network namespaces): loads libnccl-net-rumor.so as NCCL does and drives ncclNetPlugin_v12.
//
//   netplugin_peer [--plugin PATH] [--recv] [--send] [--bytes N] [--iters K] [--window W]
//                  [--verify] [--progress] [--start-marker] [--deadline S]
//
// --recv listens and prints "HANDLE <hex>"; --send reads the peer's handle (hex, one line) from
// stdin; both at once make a ring member (receive from the previous host, send to the next).
// Then K messages of N bytes go each way asked for, W in flight; "RESULT {json}" reports the
// time and throughput. Any failed request prints "ERROR: ..." and exits 1; past --deadline
// seconds the process exits 3, so a hang never outlives its caller.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "netplugin_driver.h"

namespace {

using namespace rumor::netplugin::testing;
namespace abi = rumor::netplugin::abi;  // hides <cxxabi.h>'s global `abi`
using Clock = std::chrono::steady_clock;

const char* result_name(abi::Result r) {
  switch (r) {
    case abi::kSuccess:
      return "success";
    case abi::kSystemError:
      return "system error";
    case abi::kInternalError:
      return "internal error";
    case abi::kInvalidArgument:
      return "invalid argument";
    case abi::kInvalidUsage:
      return "invalid usage";
    case abi::kRemoteError:
      return "remote error";
    default:
      return "unknown";
  }
}

[[noreturn]] void die(const std::string& what, abi::Result rc) {
  std::fprintf(stderr, "ERROR: %s: returned %d (%s)\n", what.c_str(), static_cast<int>(rc), result_name(rc));
  std::fflush(stderr);
  std::_Exit(1);
}

std::string to_hex(const char* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    auto b = static_cast<unsigned char>(p[i]);
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

bool from_hex(const std::string& s, char* out, size_t n) {
  if (s.size() != 2 * n) return false;
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>(std::stoi(s.substr(2 * i, 2), nullptr, 16));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string plugin = RUMOR_NETPLUGIN_PATH;
  bool do_send = false, do_recv = false, verify = false, progress = false, marker = false;
  size_t bytes = 1 << 20;
  long iters = 100, window = 4;
  double deadline_s = 60;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value after " + a, abi::kInvalidArgument);
      return argv[++i];
    };
    if (a == "--plugin")
      plugin = next();
    else if (a == "--send")
      do_send = true;
    else if (a == "--recv")
      do_recv = true;
    else if (a == "--bytes")
      bytes = std::stoull(next());
    else if (a == "--iters")
      iters = std::stol(next());
    else if (a == "--window")
      window = std::stol(next());
    else if (a == "--verify")
      verify = true;
    else if (a == "--start-marker")
      marker = true;
    else if (a == "--progress")
      progress = true;
    else if (a == "--deadline")
      deadline_s = std::stod(next());
    else
      die("unknown argument " + a, abi::kInvalidArgument);
  }
  if (!do_send && !do_recv) die("give --send, --recv or both", abi::kInvalidArgument);
  window = std::max(1L, std::min(window, 8L));

  std::thread([deadline_s] {
    std::this_thread::sleep_for(std::chrono::duration<double>(deadline_s));
    std::fprintf(stderr, "ERROR: deadline of %.0f s passed\n", deadline_s);
    std::fflush(stderr);
    std::_Exit(3);
  }).detach();

  Driver<abi::NetV12> d(find_table<abi::NetV12>(open_plugin(plugin)));
  if (abi::Result rc = d.init(); rc != abi::kSuccess) die("init", rc);

  void *listen_comm = nullptr, *send_comm = nullptr, *recv_comm = nullptr;
  char my_handle[abi::kHandleMaxSize] = {}, peer_handle[abi::kHandleMaxSize] = {};
  if (do_recv) {
    if (abi::Result rc = d.listen(0, my_handle, &listen_comm); rc != abi::kSuccess) die("listen", rc);
    std::printf("HANDLE %s\n", to_hex(my_handle, sizeof(my_handle)).c_str());
    std::fflush(stdout);
  }
  if (do_send) {
    std::string line;
    if (!std::getline(std::cin, line) || !from_hex(line, peer_handle, sizeof(peer_handle)))
      die("expected the peer's handle (hex) on stdin", abi::kInvalidArgument);
  }
  while ((do_send && send_comm == nullptr) || (do_recv && recv_comm == nullptr)) {
    if (do_send && send_comm == nullptr)
      if (abi::Result rc = d.connect(0, peer_handle, &send_comm); rc != abi::kSuccess) die("connect", rc);
    if (do_recv && recv_comm == nullptr)
      if (abi::Result rc = d.accept(listen_comm, &recv_comm); rc != abi::kSuccess) die("accept", rc);
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  std::printf("CONNECTED\n");
  std::fflush(stdout);

  // Window slots: each holds one message buffer per direction and its request.
  auto w = static_cast<size_t>(window);
  std::vector<std::vector<unsigned char>> sbuf(do_send ? w : 0, std::vector<unsigned char>(bytes + 1, 0x5a));
  std::vector<std::vector<unsigned char>> rbuf(do_recv ? w : 0, std::vector<unsigned char>(bytes + 1));
  std::vector<void*> sreq(w, nullptr), rreq(w, nullptr);
  long sent = 0, sent_done = 0, recvd = 0, recvd_done = 0, reported = 0;
  // --start-marker: message 0 is 1 byte, so the receiver's steady-state clock starts when the
  // sender starts, not after a first full message whose successors are already on their way.
  auto size_of = [&](long m) { return marker && m == 0 ? size_t{1} : bytes; };
  auto fill = [&](long m) {
    if (verify)
      for (size_t i = 0; i < bytes; ++i)
        sbuf[static_cast<size_t>(m % window)][i] = pattern(static_cast<uint64_t>(m), i);
  };
  auto check = [&](long m, int size) {
    if (size != static_cast<int>(size_of(m)))
      die("message " + std::to_string(m) + " has the wrong size", abi::kInternalError);
    if (!verify) return;
    const auto& b = rbuf[static_cast<size_t>(m % window)];
    for (size_t i = 0; i < size_of(m); ++i)
      if (b[i] != pattern(static_cast<uint64_t>(m), i))
        die("message " + std::to_string(m) + " differs at byte " + std::to_string(i), abi::kInternalError);
  };

  auto t0 = Clock::now();
  Clock::time_point first_recv{}, last_recv{};  // completions of the first and last receive
  while ((do_send && sent_done < iters) || (do_recv && recvd_done < iters)) {
    bool idle = true;
    if (do_send) {
      if (sent < iters && sent - sent_done < window) {
        fill(sent);
        auto slot = static_cast<size_t>(sent % window);
        if (abi::Result rc = d.isend(send_comm, sbuf[slot].data(), size_of(sent), 0, &sreq[slot]);
            rc != abi::kSuccess)
          die("isend", rc);
        ++sent;
        idle = false;
      }
      if (sent_done < sent) {
        int done = 0;
        if (abi::Result rc = d.test(sreq[static_cast<size_t>(sent_done % window)], &done, nullptr);
            rc != abi::kSuccess)
          die("send " + std::to_string(sent_done), rc);
        if (done) ++sent_done, idle = false;
      }
    }
    if (do_recv) {
      if (recvd < iters && recvd - recvd_done < window) {
        auto slot = static_cast<size_t>(recvd % window);
        void* data[1] = {rbuf[slot].data()};
        size_t caps[1] = {bytes};
        int tags[1] = {0};
        if (abi::Result rc = d.irecv(recv_comm, 1, data, caps, tags, &rreq[slot]); rc != abi::kSuccess)
          die("irecv", rc);
        ++recvd;
        idle = false;
      }
      if (recvd_done < recvd) {
        int done = 0, size = -1;
        if (abi::Result rc = d.test(rreq[static_cast<size_t>(recvd_done % window)], &done, &size);
            rc != abi::kSuccess)
          die("receive " + std::to_string(recvd_done), rc);
        if (done) {
          check(recvd_done, size);
          last_recv = Clock::now();
          if (recvd_done == 0) first_recv = last_recv;
          ++recvd_done;
          idle = false;
          // The first message, then every tenth of the run.
          if (progress && (recvd_done == 1 || recvd_done * 10 / iters > reported)) {
            reported = recvd_done * 10 / iters;
            std::printf("PROGRESS %ld\n", recvd_done);
            std::fflush(stdout);
          }
        }
      }
    }
    // NCCL's proxy thread polls test() the same way; the nap (short next to a 1 Gbit message
    // time) leaves the cores to the kernel's network path when four hosts share two cores.
    if (idle) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  double total = static_cast<double>(bytes) * static_cast<double>(iters);
  // Steady state: from the first receive's completion to the last one's, which leaves out the
  // connection skew between hosts and the bytes a sender buffered before this clock started
  // (unbiased with --start-marker).
  double steady_s = std::chrono::duration<double>(last_recv - first_recv).count();
  double steady =
      do_recv && iters > 1 && steady_s > 0 ? static_cast<double>(bytes) * (iters - 1) / steady_s / 1e6 : 0;
  std::printf(
      "RESULT {\"bytes\": %zu, \"iters\": %ld, \"seconds\": %.6f, \"MBps\": %.3f, \"steady_MBps\": %.3f}\n",
      bytes, iters, seconds, total / seconds / 1e6, steady);
  std::fflush(stdout);
  if (send_comm != nullptr) d.net()->close_send(send_comm);
  if (recv_comm != nullptr) d.net()->close_recv(recv_comm);
  if (listen_comm != nullptr) d.net()->close_listen(listen_comm);
  return 0;
}
