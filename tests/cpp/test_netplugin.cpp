// The NCCL net plugin (libnccl-net-rumor.so) loaded as NCCL loads it: dlopen, dlsym of each
// exported ncclNetPlugin_vN, calls through that version's function pointers. Both ends of every
// connection live in this process on loopback; senders run on their own threads. Every wait
// has a deadline (Driver::wait), so a hang fails the test instead of stalling the suite.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "netplugin/wire.h"
#include "netplugin_driver.h"

extern char** environ;

namespace {

using namespace rumor::netplugin::testing;
namespace abi = rumor::netplugin::abi;  // hides <cxxabi.h>'s global `abi`
using Clock = std::chrono::steady_clock;

constexpr const char* kTestSecret = "test-secret-of-the-netplugin-suite";
bool authenticated() { return std::getenv("RUMOR_TEST_NETPLUGIN_NO_SECRET") == nullptr; }

// Settings are read once per process at the first init(): loopback, a short setup deadline (the
// deadline tests wait it out) and small chunks so a few MiB already make many chunks to steal.
void* plugin_lib() {
  static void* lib = [] {
    ::setenv("RUMOR_NET_PLUGIN_IFNAME", "lo", 1);
    ::setenv("RUMOR_NET_PLUGIN_TIMEOUT", "3", 1);
    ::setenv("RUMOR_NET_PLUGIN_CHUNK_KB", "16", 1);
    ::unsetenv("RUMOR_NET_PLUGIN_STREAMS");  // the default: 4 streams
    ::setenv("RUMOR_NET_PLUGIN_HELLO_TIMEOUT", "1", 1);
    // Authenticated unless RUMOR_TEST_NETPLUGIN_NO_SECRET is set: the suite runs both ways.
    ::unsetenv("RUMOR_JOB_SECRET_FILE");
    if (std::getenv("RUMOR_TEST_NETPLUGIN_NO_SECRET") != nullptr)
      ::unsetenv("RUMOR_JOB_SECRET");
    else
      ::setenv("RUMOR_JOB_SECRET", kTestSecret, 1);
    return open_plugin(RUMOR_NETPLUGIN_PATH);
  }();
  return lib;
}

template <typename Net>
Net* table() {
  Net* t = find_table<Net>(plugin_lib());
  if (t == nullptr) throw std::runtime_error(std::string("missing symbol ") + symbol_name<Net>());
  return t;
}

// A connected send/recv pair and its listener, closed in the destructor.
template <typename Net>
struct Pair {
  Driver<Net> d{table<Net>()};
  void* send = nullptr;
  void* recv = nullptr;
  void* listen = nullptr;
  Pair() {
    // Thrown errors fail the test (GoogleTest catches them) instead of running on null comms.
    if (d.init() != abi::kSuccess) throw std::runtime_error("init failed");
    if (!d.connect_pair(0, &send, &recv, &listen))
      throw std::runtime_error("connect/accept did not complete");
  }
  ~Pair() {
    if (send != nullptr) d.net()->close_send(send);
    if (recv != nullptr) d.net()->close_recv(recv);
    if (listen != nullptr) d.net()->close_listen(listen);
  }
};

std::vector<unsigned char> make_message(uint64_t m, size_t size) {
  std::vector<unsigned char> v(size);
  for (size_t i = 0; i < size; ++i) v[i] = pattern(m, i);
  return v;
}

// Sends `size` bytes from another thread into a buffer `slack` bytes larger; checks the bytes and
// that test() reports the sender's size.
template <typename Net>
void exchange(Pair<Net>& p, uint64_t m, size_t size, int tag, size_t slack = 0) {
  std::vector<unsigned char> out = make_message(m, size);
  std::vector<unsigned char> in(size + slack + 1, 0xee);  // +1: never a null buffer
  abi::Result send_rc = abi::kInternalError;
  std::thread sender([&] {
    void* req = nullptr;
    send_rc = p.d.isend(p.send, out.data(), size, tag, &req);
    if (send_rc == abi::kSuccess) send_rc = p.d.wait(req, nullptr);
  });
  void* data[1] = {in.data()};
  size_t caps[1] = {size + slack};
  int tags[1] = {tag};
  void* req = nullptr;
  ASSERT_EQ(p.d.irecv(p.recv, 1, data, caps, tags, &req), abi::kSuccess);
  int got[1] = {-1};
  abi::Result rc = p.d.wait(req, got);
  sender.join();
  ASSERT_EQ(rc, abi::kSuccess) << "size " << size;
  // NCCL then tells the plugin the GPU consumed the receive; an error there fails its job.
  ASSERT_EQ(p.d.consumed(p.recv, 1, req), abi::kSuccess) << "size " << size;
  ASSERT_EQ(send_rc, abi::kSuccess) << "size " << size;
  ASSERT_EQ(got[0], static_cast<int>(size));
  ASSERT_TRUE(size == 0 || std::memcmp(in.data(), out.data(), size) == 0) << "size " << size;
  ASSERT_EQ(in[size], 0xee) << "wrote past the message";
}

TEST(NetPlugin, ExportsEveryVersionAndNothingElse) {
  void* lib = plugin_lib();
  auto common = [](auto* t) {
    ASSERT_NE(t, nullptr);
    EXPECT_STREQ(t->name, "rumor");
    for (void* fn :
         {(void*)t->init, (void*)t->devices, (void*)t->get_properties, (void*)t->listen, (void*)t->connect,
          (void*)t->accept, (void*)t->reg_mr, (void*)t->reg_mr_dmabuf, (void*)t->dereg_mr, (void*)t->isend,
          (void*)t->irecv, (void*)t->iflush, (void*)t->test, (void*)t->close_send, (void*)t->close_recv,
          (void*)t->close_listen, (void*)t->get_device_mr, (void*)t->irecv_consumed})
      EXPECT_NE(fn, nullptr);
  };
  common(find_table<abi::NetV8>(lib));
  common(find_table<abi::NetV9>(lib));
  common(find_table<abi::NetV10>(lib));
  common(find_table<abi::NetV11>(lib));
  common(find_table<abi::NetV12>(lib));
  // No vNIC fusion (NCCL then uses the physical devices); v11+ have finalize and setNetAttr.
  EXPECT_EQ(find_table<abi::NetV9>(lib)->make_vdevice, nullptr);
  EXPECT_EQ(find_table<abi::NetV12>(lib)->make_vdevice, nullptr);
  EXPECT_NE(find_table<abi::NetV11>(lib)->finalize, nullptr);
  EXPECT_NE(find_table<abi::NetV12>(lib)->set_net_attr, nullptr);
  // The net layer compiled into the plugin stays private (rumor::net::listen_tcp(int)).
  EXPECT_EQ(::dlsym(lib, "_ZN5rumor3net10listen_tcpEi"), nullptr);
  EXPECT_EQ(::dlsym(lib, "ncclNetPlugin_v7"), nullptr);
}

TEST(NetPlugin, InitLogsAndReportsHostProperties) {
  Driver<abi::NetV12> d(table<abi::NetV12>());
  ASSERT_EQ(d.init(), abi::kSuccess);
  EXPECT_TRUE(log_sink().contains("streams per connection"));
  EXPECT_TRUE(log_sink().contains("lo/"));
  int n = 0;
  ASSERT_EQ(d.net()->devices(&n), abi::kSuccess);
  ASSERT_EQ(n, 1);  // RUMOR_NET_PLUGIN_IFNAME=lo
  abi::PropertiesV12 p{};
  ASSERT_EQ(d.net()->get_properties(0, &p), abi::kSuccess);
  EXPECT_STREQ(p.name, "lo");
  EXPECT_EQ(p.ptr_support, abi::kPtrHost);
  EXPECT_EQ(p.max_recvs, 8);
  EXPECT_GT(p.speed_mbps, 0);
  EXPECT_EQ(p.device_type, abi::kDeviceHost);
  EXPECT_EQ(p.vprops.ndevs, 1);
  EXPECT_EQ(p.vprops.devs[0], 0);
  EXPECT_GE(p.max_p2p_bytes, size_t{1} << 30);
  EXPECT_EQ(p.max_multi_request_size, 1);
  EXPECT_EQ(p.rail_id, -1);
  EXPECT_EQ(p.plane_id, -1);
  EXPECT_EQ(d.net()->get_properties(1, &p), abi::kInvalidArgument);

  abi::PropertiesV8 p8{};
  ASSERT_EQ(table<abi::NetV8>()->get_properties(0, &p8), abi::kSuccess);
  EXPECT_STREQ(p8.name, "lo");
  EXPECT_EQ(p8.max_recvs, 8);
  abi::PropertiesV9 p9{};
  ASSERT_EQ(table<abi::NetV10>()->get_properties(0, &p9), abi::kSuccess);
  EXPECT_EQ(p9.max_recvs, 8);
  EXPECT_EQ(p9.vprops.ndevs, 1);
  abi::PropertiesV11 p11{};
  ASSERT_EQ(table<abi::NetV11>()->get_properties(0, &p11), abi::kSuccess);
  EXPECT_EQ(p11.max_multi_request_size, 1);
}

TEST(NetPlugin, RegistrationFlushAndUnsupportedEntryPoints) {
  Pair<abi::NetV12> p;
  auto* net = p.d.net();
  char buf[64];
  void* mh = nullptr;
  EXPECT_EQ(net->reg_mr(p.send, buf, sizeof(buf), abi::kPtrHost, &mh), abi::kSuccess);
  EXPECT_EQ(net->dereg_mr(p.send, mh), abi::kSuccess);
  EXPECT_EQ(net->reg_mr(p.recv, buf, sizeof(buf), abi::kPtrCuda, &mh), abi::kInternalError);
  EXPECT_EQ(net->reg_mr_dmabuf(p.recv, buf, sizeof(buf), abi::kPtrCuda, 0, -1, &mh), abi::kInternalError);
  EXPECT_EQ(net->get_device_mr(p.recv, mh, &mh), abi::kInternalError);
  // NCCL calls it after every receive, with the (already freed) request: a no-op that succeeds.
  EXPECT_EQ(net->irecv_consumed(p.recv, 1, nullptr), abi::kSuccess);
  abi::NetAttr attr{};
  EXPECT_EQ(net->set_net_attr(nullptr, &attr), abi::kSuccess);
  void* data[1] = {buf};
  int sizes[1] = {sizeof(buf)};
  void* req = nullptr;
  ASSERT_EQ(net->iflush(p.recv, 1, data, sizes, &mh, &req), abi::kSuccess);
  int done = 0;
  EXPECT_EQ(net->test(req, &done, nullptr), abi::kSuccess);
  EXPECT_EQ(done, 1);
  // Bad arguments are errors, not crashes.
  EXPECT_EQ(net->isend(p.send, nullptr, 10, 0, nullptr, nullptr, &req), abi::kInvalidArgument);
  size_t big[1] = {10};
  int tags[1] = {0};
  EXPECT_EQ(net->irecv(p.recv, 0, data, big, tags, nullptr, nullptr, &req), abi::kInvalidArgument);
  EXPECT_EQ(net->irecv(p.recv, 9, data, big, tags, nullptr, nullptr, &req), abi::kInvalidArgument);
  char bad_handle[abi::kHandleMaxSize] = {};
  void* comm = nullptr;
  abi::DeviceHandle* dh = nullptr;
  EXPECT_EQ(net->connect(nullptr, 0, bad_handle, &comm, &dh), abi::kInvalidArgument);
}

// Every exported version moves exact bytes through its own signatures: empty, tiny, odd, chunk
// boundaries and several MiB striped over the streams.
template <typename Net>
class NetPluginVersion : public ::testing::Test {};
using Versions = ::testing::Types<abi::NetV8, abi::NetV9, abi::NetV10, abi::NetV11, abi::NetV12>;
TYPED_TEST_SUITE(NetPluginVersion, Versions);

TYPED_TEST(NetPluginVersion, ExchangesExactBytes) {
  Pair<TypeParam> p;
  uint64_t m = 0;
  for (size_t size : {size_t{0}, size_t{1}, size_t{3}, size_t{4097}, size_t{16384}, size_t{16385},
                      (size_t{1} << 20) + 13, (size_t{5} << 20) + 7}) {
    exchange(p, m++, size, 1);
  }
  exchange(p, m++, 1000, 2, /*slack=*/24);  // smaller than the buffer: test() reports 1000
}

TEST(NetPlugin, ThousandsOfSmallMessagesArriveInOrder) {
  Pair<abi::NetV12> p;
  constexpr int kMessages = 3000, kWindow = 16;
  auto size_of = [](int m) { return static_cast<size_t>(1 + m % 61); };
  std::thread sender([&] {
    std::vector<std::vector<unsigned char>> bufs(kWindow);
    std::vector<void*> reqs(kWindow, nullptr);
    for (int m = 0; m < kMessages; ++m) {
      int slot = m % kWindow;
      if (reqs[slot] != nullptr) {
        ASSERT_EQ(p.d.wait(reqs[slot], nullptr), abi::kSuccess);
      }
      bufs[slot] = make_message(static_cast<uint64_t>(m), size_of(m));
      ASSERT_EQ(p.d.isend(p.send, bufs[slot].data(), bufs[slot].size(), 9, &reqs[slot]), abi::kSuccess);
    }
    for (void* r : reqs) {
      if (r != nullptr) {
        ASSERT_EQ(p.d.wait(r, nullptr), abi::kSuccess);
      }
    }
  });
  std::vector<std::vector<unsigned char>> bufs(kWindow, std::vector<unsigned char>(64));
  std::vector<void*> reqs(kWindow, nullptr);
  auto check = [&](int m) {
    int slot = m % kWindow;
    int got = -1;
    ASSERT_EQ(p.d.wait(reqs[slot], &got), abi::kSuccess);
    ASSERT_EQ(got, static_cast<int>(size_of(m))) << "message " << m;
    auto want = make_message(static_cast<uint64_t>(m), size_of(m));
    ASSERT_EQ(std::memcmp(bufs[slot].data(), want.data(), want.size()), 0) << "message " << m;
  };
  for (int m = 0; m < kMessages; ++m) {
    int slot = m % kWindow;
    if (m >= kWindow) check(m - kWindow);
    void* data[1] = {bufs[slot].data()};
    size_t caps[1] = {64};
    int tags[1] = {9};
    ASSERT_EQ(p.d.irecv(p.recv, 1, data, caps, tags, &reqs[slot]), abi::kSuccess);
  }
  for (int m = kMessages - kWindow; m < kMessages; ++m) check(m);
  sender.join();
}

// Comms share no lock: three connections, each carrying traffic both ways from its own threads
// at once (run under TSan too), every byte checked.
TEST(NetPlugin, ConnectionsRunConcurrentlyBothWays) {
  constexpr int kPairs = 3, kMessages = 20;
  std::vector<std::unique_ptr<Pair<abi::NetV12>>> there, back;
  for (int i = 0; i < kPairs; ++i) {
    there.push_back(std::make_unique<Pair<abi::NetV12>>());
    back.push_back(std::make_unique<Pair<abi::NetV12>>());
  }
  std::atomic<int> failures{0};
  auto stream = [&](Pair<abi::NetV12>& p, uint64_t base, bool sending) {
    for (int m = 0; m < kMessages; ++m) {
      size_t size = (size_t{1} << 18) + static_cast<size_t>(m) * 4099;
      void* req = nullptr;
      if (sending) {
        auto msg = make_message(base + static_cast<uint64_t>(m), size);
        if (p.d.isend(p.send, msg.data(), size, 3, &req) != abi::kSuccess ||
            p.d.wait(req, nullptr) != abi::kSuccess)
          ++failures;
      } else {
        std::vector<unsigned char> in(size);
        void* data[1] = {in.data()};
        size_t caps[1] = {size};
        int tags[1] = {3};
        int got = -1;
        if (p.d.irecv(p.recv, 1, data, caps, tags, &req) != abi::kSuccess ||
            p.d.wait(req, &got) != abi::kSuccess || got != static_cast<int>(size) ||
            in != make_message(base + static_cast<uint64_t>(m), size))
          ++failures;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kPairs; ++i) {
    for (bool sending : {true, false}) {
      threads.emplace_back(stream, std::ref(*there[static_cast<size_t>(i)]), 1000u * i, sending);
      threads.emplace_back(stream, std::ref(*back[static_cast<size_t>(i)]), 1000u * i + 500, sending);
    }
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(NetPlugin, GroupedReceiveMatchesBuffersByTag) {
  Pair<abi::NetV12> p;
  // Buffers posted in the order tag 30, 10, 20; the sender sends 10, 20, 30.
  std::vector<unsigned char> a = make_message(1, 4000), b = make_message(2, 700000), c = make_message(3, 50);
  std::vector<unsigned char> r30(100), r10(5000), r20(1 << 20);
  void* data[3] = {r30.data(), r10.data(), r20.data()};
  size_t caps[3] = {r30.size(), r10.size(), r20.size()};
  int tags[3] = {30, 10, 20};
  void* req = nullptr;
  ASSERT_EQ(p.d.irecv(p.recv, 3, data, caps, tags, &req), abi::kSuccess);
  void* s[3];
  ASSERT_EQ(p.d.isend(p.send, a.data(), a.size(), 10, &s[0]), abi::kSuccess);
  ASSERT_EQ(p.d.isend(p.send, b.data(), b.size(), 20, &s[1]), abi::kSuccess);
  ASSERT_EQ(p.d.isend(p.send, c.data(), c.size(), 30, &s[2]), abi::kSuccess);
  int got[3] = {-1, -1, -1};
  ASSERT_EQ(p.d.wait(req, got), abi::kSuccess);
  for (void* r : s) ASSERT_EQ(p.d.wait(r, nullptr), abi::kSuccess);
  EXPECT_EQ(got[0], 50);
  EXPECT_EQ(got[1], 4000);
  EXPECT_EQ(got[2], 700000);
  EXPECT_EQ(std::memcmp(r30.data(), c.data(), c.size()), 0);
  EXPECT_EQ(std::memcmp(r10.data(), a.data(), a.size()), 0);
  EXPECT_EQ(std::memcmp(r20.data(), b.data(), b.size()), 0);

  // Equal tags go in the sender's order; two groups posted back to back fill in order too.
  std::vector<unsigned char> x0(300), x1(300), y0(300);
  void* g1[2] = {x0.data(), x1.data()};
  void* g2[1] = {y0.data()};
  size_t c2[2] = {300, 300};
  int t2[2] = {5, 5};
  void *req1 = nullptr, *req2 = nullptr;
  ASSERT_EQ(p.d.irecv(p.recv, 2, g1, c2, t2, &req1), abi::kSuccess);
  ASSERT_EQ(p.d.irecv(p.recv, 1, g2, c2, t2, &req2), abi::kSuccess);
  std::vector<std::vector<unsigned char>> msgs = {make_message(10, 100), make_message(11, 200),
                                                  make_message(12, 300)};
  for (auto& msg : msgs) {
    void* r = nullptr;
    ASSERT_EQ(p.d.isend(p.send, msg.data(), msg.size(), 5, &r), abi::kSuccess);
    ASSERT_EQ(p.d.wait(r, nullptr), abi::kSuccess);
  }
  int got1[2] = {-1, -1}, got2[1] = {-1};
  ASSERT_EQ(p.d.wait(req1, got1), abi::kSuccess);
  ASSERT_EQ(p.d.wait(req2, got2), abi::kSuccess);
  EXPECT_EQ(got1[0], 100);
  EXPECT_EQ(got1[1], 200);
  EXPECT_EQ(got2[0], 300);
  EXPECT_EQ(std::memcmp(x0.data(), msgs[0].data(), 100), 0);
  EXPECT_EQ(std::memcmp(x1.data(), msgs[1].data(), 200), 0);
  EXPECT_EQ(std::memcmp(y0.data(), msgs[2].data(), 300), 0);
}

TEST(NetPlugin, TruncatedMessageFailsItsRequestAndTheConnectionGoesOn) {
  Pair<abi::NetV12> p;
  std::vector<unsigned char> big = make_message(7, 300000);  // many chunks, all drained
  std::vector<unsigned char> small(1000, 0xee);
  void* data[1] = {small.data()};
  size_t caps[1] = {small.size()};
  int tags[1] = {4};
  void *rreq = nullptr, *sreq = nullptr;
  ASSERT_EQ(p.d.irecv(p.recv, 1, data, caps, tags, &rreq), abi::kSuccess);
  ASSERT_EQ(p.d.isend(p.send, big.data(), big.size(), 4, &sreq), abi::kSuccess);
  EXPECT_EQ(p.d.wait(rreq, nullptr), abi::kInvalidUsage);
  EXPECT_EQ(p.d.wait(sreq, nullptr), abi::kSuccess);
  EXPECT_TRUE(log_sink().contains("message truncated: 300000 bytes"));
  EXPECT_EQ(small[0], 0xee) << "a truncated message must not be written into the short buffer";
  exchange(p, 8, (size_t{2} << 20) + 5, 4);
}

TEST(NetPlugin, PeerClosedMidTransferFailsReceives) {
  Pair<abi::NetV12> p;
  constexpr size_t kSize = size_t{32} << 20;
  std::vector<unsigned char> out(kSize, 1), in(kSize);
  void* data[1] = {in.data()};
  size_t caps[1] = {kSize};
  int tags[1] = {0};
  void *rreq = nullptr, *sreq = nullptr;
  ASSERT_EQ(p.d.irecv(p.recv, 1, data, caps, tags, &rreq), abi::kSuccess);
  ASSERT_EQ(p.d.isend(p.send, out.data(), kSize, 0, &sreq), abi::kSuccess);
  // The sender goes away (as a killed process would) long before 32 MiB could have left.
  p.d.net()->close_send(p.send);
  p.send = nullptr;
  auto t0 = Clock::now();
  EXPECT_EQ(p.d.wait(rreq, nullptr, 10), abi::kRemoteError);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 5.0);
  // Later receives fail too.
  ASSERT_EQ(p.d.irecv(p.recv, 1, data, caps, tags, &rreq), abi::kSuccess);
  EXPECT_EQ(p.d.wait(rreq, nullptr, 10), abi::kRemoteError);
}

TEST(NetPlugin, PeerClosedMidTransferFailsSends) {
  Pair<abi::NetV12> p;
  // More than the four streams' socket buffers can absorb while nobody reads.
  constexpr size_t kSize = size_t{128} << 20;
  std::vector<unsigned char> out(kSize, 1);
  void* sreq = nullptr;
  ASSERT_EQ(p.d.isend(p.send, out.data(), kSize, 0, &sreq), abi::kSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  p.d.net()->close_recv(p.recv);
  p.recv = nullptr;
  abi::Result rc = p.d.wait(sreq, nullptr, 10);
  EXPECT_TRUE(rc == abi::kRemoteError || rc == abi::kSystemError) << rc;
  void* later = nullptr;
  ASSERT_EQ(p.d.isend(p.send, out.data(), 10, 0, &later), abi::kSuccess);
  rc = p.d.wait(later, nullptr, 10);
  EXPECT_TRUE(rc == abi::kRemoteError || rc == abi::kSystemError) << rc;
}

TEST(NetPlugin, SetupStepsFailByTheirDeadline) {
  Driver<abi::NetV12> d(table<abi::NetV12>());
  ASSERT_EQ(d.init(), abi::kSuccess);
  // A handle whose listener is gone: connection refused, retried until RUMOR_NET_PLUGIN_TIMEOUT (3 s).
  char dead[abi::kHandleMaxSize] = {};
  void* gone = nullptr;
  ASSERT_EQ(d.listen(0, dead, &gone), abi::kSuccess);
  d.net()->close_listen(gone);
  // A listener nobody connects to.
  char handle[abi::kHandleMaxSize] = {};
  void* lc = nullptr;
  ASSERT_EQ(d.listen(0, handle, &lc), abi::kSuccess);
  // A stranger that connects and sends garbage is dropped, not mistaken for a stream.
  int raw = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  uint16_t port = 0;
  std::memcpy(&port, handle + 6, 2);  // our handle: magic(4) family(2) port(2, host order)
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(raw, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  char junk[64];
  std::memset(junk, 'x', sizeof(junk));
  ASSERT_EQ(::send(raw, junk, sizeof(junk), 0), static_cast<ssize_t>(sizeof(junk)));

  auto t0 = Clock::now();
  abi::Result connect_rc = abi::kSuccess, accept_rc = abi::kSuccess;
  void *sc = nullptr, *rc = nullptr;
  while ((connect_rc == abi::kSuccess || accept_rc == abi::kSuccess) &&
         std::chrono::duration<double>(Clock::now() - t0).count() < 15) {
    if (connect_rc == abi::kSuccess) connect_rc = d.connect(0, dead, &sc);
    if (accept_rc == abi::kSuccess) accept_rc = d.accept(lc, &rc);
    ASSERT_EQ(sc, nullptr);
    ASSERT_EQ(rc, nullptr);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(connect_rc, abi::kSystemError);
  EXPECT_EQ(accept_rc, abi::kSystemError);
  EXPECT_GT(waited, 2.5);
  EXPECT_LT(waited, 10.0);
  EXPECT_TRUE(log_sink().contains("did not greet"));
  ::close(raw);
  d.net()->close_listen(lc);
}

// ---- security: strangers, half-open connections, hostile chunk headers ----

namespace wire = rumor::netplugin::wire;

// A loopback socket to the listener of `handle` (our layout: magic(4) family(2) port(2)).
int dial(const char* handle) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  uint16_t port = 0;
  std::memcpy(&port, handle + 6, 2);
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) throw std::runtime_error("dial failed");
  timeval tv{5, 0};  // every blocking read below has a deadline
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

wire::Id listen_id_of(const char* handle) {
  wire::Id id{};
  std::memcpy(id.data(), handle + 24, id.size());  // after magic, family, port, addr[16]
  return id;
}

bool read_exact(int fd, void* p, size_t n) {
  return ::recv(fd, p, n, MSG_WAITALL) == static_cast<ssize_t>(n);
}

// Polls accept() (which never blocks) until `done` or the deadline; fails on a comm appearing.
template <typename Net, typename Pred>
bool accept_until(Driver<Net>& d, void* lc, Pred done, double seconds, void** got = nullptr) {
  auto end = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
    void* rc = nullptr;
    if (d.accept(lc, &rc) != abi::kSuccess) return false;
    if (rc != nullptr) {
      if (got == nullptr) {
        d.net()->close_recv(rc);
        ADD_FAILURE() << "a connection was accepted";
        return false;
      }
      *got = rc;
    }
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

// Calls accept() (which never blocks) on its own thread, so that hand-played handshakes, which
// block on the listener's answer, can run on the test's thread.
class AcceptPump {
 public:
  AcceptPump(Driver<abi::NetV12>& d, void* lc)
      : thread_([this, &d, lc] {
          while (!stop_.load()) {
            void* rc = nullptr;
            if (d.accept(lc, &rc) == abi::kSuccess && rc != nullptr) comm_.store(rc);
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
          }
        }) {}
  ~AcceptPump() { stop(); }
  void stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  void* comm() const { return comm_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<void*> comm_{nullptr};
  std::thread thread_;
};

// True if the peer has closed `fd` (EOF or reset) by now.
bool closed_by_peer(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 0) != 1) return false;
  char c;
  ssize_t n = ::recv(fd, &c, 1, MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN);
}

// Plays the connecting side of one stream by hand: hello, the listener's challenge, a proof (a
// right one unless `wrong_proof`). Returns the socket, handshake done.
int handshake(const char* handle, uint64_t conn_id, uint16_t stream, uint16_t nstreams,
              bool wrong_proof = false) {
  int fd = dial(handle);
  wire::Hello h{};
  h.magic = wire::kHelloMagic;
  h.version = wire::kProtocolVersion;
  h.stream = stream;
  h.nstreams = nstreams;
  h.flags = authenticated() ? wire::kFlagAuth : 0;
  h.conn_id = conn_id;
  h.listen_id = listen_id_of(handle);
  h.nonce.fill(static_cast<uint8_t>(stream + 1));
  if (::send(fd, &h, sizeof(h), MSG_NOSIGNAL) != sizeof(h)) throw std::runtime_error("send hello");
  wire::Challenge c{};
  if (!read_exact(fd, &c, sizeof(c))) throw std::runtime_error("no challenge");
  wire::Proof pr{};
  pr.magic = wire::kProofMagic;
  if (authenticated()) {
    wire::Key key = wire::derive_key(kTestSecret);
    if (!wire::mac_equal(c.mac, wire::hello_mac(key, 'A', h, c.nonce)))
      throw std::runtime_error("the listener's proof is wrong");
    const wire::Key used = wrong_proof ? wire::derive_key("some-other-secret-entirely") : key;
    pr.mac = wire::hello_mac(used, 'C', h, c.nonce);
  } else if (wrong_proof) {
    pr.magic = 0;
  }
  if (::send(fd, &pr, sizeof(pr), MSG_NOSIGNAL) != sizeof(pr)) throw std::runtime_error("send proof");
  return fd;
}

// Runs netplugin_peer --send (a separate process, so its own plugin state) with another secret
// against our listener; returns its exit status.
int run_peer_with_secret(const char* handle, const char* secret, Driver<abi::NetV12>& d, void* lc) {
  std::string hex;
  for (size_t i = 0; i < abi::kHandleMaxSize; ++i) {
    char b[3];
    std::snprintf(b, sizeof(b), "%02x", static_cast<unsigned char>(handle[i]));
    hex += b;
  }
  int in[2];
  if (::pipe(in) != 0) throw std::runtime_error("pipe");
  std::vector<std::string> env_s;
  for (char** e = environ; *e != nullptr; ++e)
    if (std::strncmp(*e, "RUMOR_JOB_SECRET", 16) != 0) env_s.emplace_back(*e);
  env_s.push_back(std::string("RUMOR_JOB_SECRET=") + secret);
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_addclose(&fa, in[1]);
  std::string exe = RUMOR_NETPLUGIN_PEER_PATH;
  std::vector<std::string> args_s = {exe, "--send", "--bytes", "100", "--iters", "1", "--deadline", "20"};
  std::vector<char*> argv;
  for (auto& a : args_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  ::close(in[0]);
  if (rc != 0) throw std::runtime_error("posix_spawn netplugin_peer failed");
  hex += "\n";
  [[maybe_unused]] ssize_t n = ::write(in[1], hex.data(), hex.size());
  ::close(in[1]);
  int status = 0;
  bool exited = accept_until(d, lc, [&] { return ::waitpid(pid, &status, WNOHANG) == pid; }, 25);
  if (!exited) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(NetPluginSecurity, ConnectionWithWrongKeyIsRefusedAndOtherCommsGoOn) {
  if (!authenticated()) GTEST_SKIP() << "runs with a job secret only";
  Pair<abi::NetV12> p;  // a live connection that must be unaffected
  char handle[abi::kHandleMaxSize] = {};
  void* lc = nullptr;
  ASSERT_EQ(p.d.listen(0, handle, &lc), abi::kSuccess);
  // Another process with another secret: it refuses the listener's proof and exits 1; the
  // listener never hands out a comm for it.
  EXPECT_EQ(run_peer_with_secret(handle, "a-different-secret-0123456789", p.d, lc), 1);
  EXPECT_TRUE(accept_until(p.d, lc, [] { return log_sink().contains("closed during the handshake"); }, 5));
  // A connector that sends a wrong proof is dropped by the listener itself.
  {
    AcceptPump pump(p.d, lc);
    int bad = handshake(handle, 77, 0, 1, /*wrong_proof=*/true);
    pollfd pf{bad, POLLIN, 0};
    EXPECT_EQ(::poll(&pf, 1, 5000), 1);
    EXPECT_TRUE(closed_by_peer(bad));
    pump.stop();
    EXPECT_EQ(pump.comm(), nullptr);
    EXPECT_TRUE(log_sink().contains("did not prove the job key"));
    ::close(bad);
  }
  p.d.net()->close_listen(lc);
  exchange(p, 21, 100000, 3);
  Pair<abi::NetV12> q;  // and new ones still connect
  exchange(q, 22, 1000, 1);
}

TEST(NetPluginSecurity, HalfOpenConnectionIsDroppedAfterTheHelloDeadline) {
  Driver<abi::NetV12> d(table<abi::NetV12>());
  ASSERT_EQ(d.init(), abi::kSuccess);
  char handle[abi::kHandleMaxSize] = {};
  void* lc = nullptr;
  ASSERT_EQ(d.listen(0, handle, &lc), abi::kSuccess);
  int half = dial(handle);
  char part[10] = {};
  ASSERT_EQ(::send(half, part, sizeof(part), 0), 10);  // a hello that never completes
  auto t0 = Clock::now();
  EXPECT_TRUE(accept_until(d, lc, [&] { return closed_by_peer(half); }, 2.5));
  double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_GT(waited, 0.8);  // RUMOR_NET_PLUGIN_HELLO_TIMEOUT=1
  EXPECT_TRUE(log_sink().contains("did not complete its handshake within 1 s"));
  ::close(half);
  // More connections than the cap: the oldest are dropped at once, not kept.
  std::vector<int> flood;
  for (int i = 0; i < 140; ++i) flood.push_back(dial(handle));
  EXPECT_TRUE(accept_until(d, lc, [&] { return closed_by_peer(flood[0]); }, 0.5));
  EXPECT_TRUE(log_sink().contains("more than 128 were pending"));
  for (int fd : flood) ::close(fd);
  d.net()->close_listen(lc);
}

// A receive comm fed by hand-written chunk headers.
struct FakeSender {
  Driver<abi::NetV12> d{table<abi::NetV12>()};
  void* lc = nullptr;
  void* recv = nullptr;
  std::vector<int> fds;
  explicit FakeSender(uint16_t nstreams) {
    if (d.init() != abi::kSuccess) throw std::runtime_error("init");
    char handle[abi::kHandleMaxSize] = {};
    if (d.listen(0, handle, &lc) != abi::kSuccess) throw std::runtime_error("listen");
    AcceptPump pump(d, lc);
    for (uint16_t s = 0; s < nstreams; ++s) fds.push_back(handshake(handle, 1234, s, nstreams));
    for (auto end = Clock::now() + std::chrono::seconds(5); pump.comm() == nullptr && Clock::now() < end;)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    pump.stop();
    recv = pump.comm();
    if (recv == nullptr) throw std::runtime_error("accept");
  }
  ~FakeSender() {
    for (int fd : fds) ::close(fd);
    if (recv != nullptr) d.net()->close_recv(recv);
    d.net()->close_listen(lc);
  }
  bool try_send(size_t stream, const void* p, size_t n) {
    return ::send(fds.at(stream), p, n, MSG_NOSIGNAL) == static_cast<ssize_t>(n);
  }
  void send(size_t stream, const void* p, size_t n) {
    if (!try_send(stream, p, n)) throw std::runtime_error("send");
  }
  void header(size_t stream, uint64_t seq, uint64_t total, uint64_t offset, uint64_t len, int tag = 0) {
    wire::ChunkHeader h{wire::kChunkMagic, tag, seq, total, offset, len};
    send(stream, &h, sizeof(h));
  }
  void* post(std::vector<unsigned char>& buf, int tag = 0) {
    void* data[1] = {buf.data()};
    size_t caps[1] = {buf.size()};
    int tags[1] = {tag};
    void* req = nullptr;
    if (d.irecv(recv, 1, data, caps, tags, &req) != abi::kSuccess) throw std::runtime_error("irecv");
    return req;
  }
};

// The old receiver let a duplicate chunk complete a message while its twin was still arriving,
// then looked the finished message up again and dereferenced end() (memory corruption in NCCL's
// proxy thread). Now the duplicate is refused when its header arrives.
TEST(NetPluginSecurity, DuplicateChunkIsAnErrorNotACrash) {
  FakeSender f(2);
  std::vector<unsigned char> buf(10, 0);
  void* req = f.post(buf);
  unsigned char payload[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  f.header(0, 0, 10, 0, 10);
  f.send(0, payload, 9);  // all but the last byte: the message stays in flight
  f.header(1, 0, 10, 0, 10);
  f.send(1, payload, 10);
  // Usually stream 0's header is taken first: the duplicate on stream 1 is refused at its header.
  // If stream 1's thread happens to be first, its chunk is the message and stream 0's becomes the
  // stray one, refused as a chunk of a message no longer in flight. Either way no crash, and the
  // connection is failed with the reason.
  abi::Result rc = f.d.wait(req, nullptr, 10);
  f.try_send(0, payload + 9, 1);  // with stream 0 first, the old receiver crashed here
  std::vector<unsigned char> more(10, 0);
  EXPECT_EQ(f.d.wait(f.post(more), nullptr, 10), abi::kSystemError) << "the connection went on";
  if (rc == abi::kSuccess) {
    EXPECT_TRUE(log_sink().contains("which is not in flight"));
  } else {
    EXPECT_EQ(rc, abi::kSystemError);
    EXPECT_TRUE(log_sink().contains("duplicated or overlapping chunk"));
  }
}

TEST(NetPluginSecurity, HostileChunkHeadersAreErrors) {
  struct Case {
    uint64_t seq, total, offset, len;
    const char* expect;
  };
  const Case cases[] = {
      {0, uint64_t{1} << 40, 0, 16, "exceeds"},                     // a 1 TiB message
      {0, 100, 96, 8, "outside a 100-byte message"},                // past the end
      {0, 100, ~uint64_t{0} - 2, 8, "outside a 100-byte message"},  // offset + len wraps
  };
  for (const Case& c : cases) {
    FakeSender f(1);
    std::vector<unsigned char> buf(100, 0);
    void* req = f.post(buf);
    f.header(0, c.seq, c.total, c.offset, c.len);
    EXPECT_EQ(f.d.wait(req, nullptr, 10), abi::kSystemError) << c.expect;
    EXPECT_TRUE(log_sink().contains(c.expect)) << c.expect;
  }
  {  // a chunk whose total disagrees with its message's first chunk
    FakeSender f(2);
    std::vector<unsigned char> buf(100, 0);
    void* req = f.post(buf);
    unsigned char payload[50] = {};
    f.header(0, 0, 100, 0, 50);
    f.send(0, payload, 50);
    f.header(1, 0, 60, 50, 10);
    EXPECT_EQ(f.d.wait(req, nullptr, 10), abi::kSystemError);
    // Whichever stream is read first sets the message; the other is refused.
    EXPECT_TRUE(log_sink().contains("its first chunk said"));
  }
}

}  // namespace
