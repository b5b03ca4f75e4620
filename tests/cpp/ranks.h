// Test support: n ranks as threads of this process, each with its own Context, talking over
// loopback TCP or shared memory exactly as separate processes would.
#pragma once

#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/context.h"

namespace rumor::testing {

inline net::Token test_token(uint8_t seed = 7) {
  net::Token t{};
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint8_t>(seed + i * 13);
  return t;
}

inline Options quick_options(bool shm) {
  Options o;
  o.timeout_s = 20;
  o.shm = shm;
  o.shm_ring_bytes = 64 * 1024;  // small ring: messages wrap many times
  o.stripe_min = 256 * 1024;     // test-sized messages still exercise TCP striping
  // Test-sized messages take the host's direct path however many cores the machine has.
  o.host_direct_min_bytes = 0;
  return o;
}

struct World {
  std::vector<std::shared_ptr<Context>> ctx;
  World() = default;
  World(World&&) = default;
  World& operator=(World&&) = default;
  // Failure tests end with ranks that never mapped a segment a peer made for them; the library
  // leaves such names for the late peer, so the test removes what its job left behind.
  ~World() {
    if (ctx.empty()) return;
    const std::string prefix = ctx.front()->shm_prefix().substr(1);  // without the leading '/'
    ctx.clear();
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec))
      if (e.path().filename().string().rfind(prefix, 0) == 0) std::filesystem::remove(e.path(), ec);
  }
};

// host_of[r] gives each rank's host id; equal ids share memory when opts.shm is on.
// A fresh random token per world, so shared-memory names never collide between tests or
// with leftovers of an earlier crashed run.
inline net::Token random_token() {
  std::random_device rd;
  net::Token t{};
  for (auto& b : t) b = static_cast<uint8_t>(rd());
  return t;
}

// opts[r] for rank r: settings a rank reads only for itself may differ between ranks.
inline World make_world(const std::vector<std::string>& host_of, const std::vector<Options>& opts,
                        net::Token token = random_token()) {
  const uint32_t n = static_cast<uint32_t>(host_of.size());
  World w;
  std::vector<std::string> addrs;
  for (uint32_t r = 0; r < n; ++r) {
    w.ctx.push_back(std::make_shared<Context>(r, n, token, opts.at(r), 0));
    addrs.push_back("127.0.0.1:" + std::to_string(w.ctx.back()->port()));
  }
  for (auto& c : w.ctx) c->set_peers(addrs, host_of);
  for (auto& c : w.ctx) c->seal();
  return w;
}

inline World make_world(const std::vector<std::string>& host_of, const Options& opts,
                        net::Token token = random_token()) {
  return make_world(host_of, std::vector<Options>(host_of.size(), opts), token);
}

inline std::vector<std::string> one_host(uint32_t n) { return std::vector<std::string>(n, "h"); }

inline std::vector<std::string> hosts_of(uint32_t n, uint32_t per_host) {
  std::vector<std::string> h;
  // append, not operator+(const char*, string&&): GCC 12 at -O3 reports a false -Wrestrict there.
  for (uint32_t r = 0; r < n; ++r) h.push_back(std::string("h").append(std::to_string(r / per_host)));
  return h;
}

// Runs fn(comm, rank) on every rank in its own thread, with the world communicator held by a
// shared_ptr (as Python holds it); returns each rank's exception (or null).
inline std::vector<std::exception_ptr> run_ranks_shared(
    World& w, const std::function<void(std::shared_ptr<Communicator>, uint32_t)>& fn) {
  const uint32_t n = static_cast<uint32_t>(w.ctx.size());
  std::vector<std::exception_ptr> errs(n);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::vector<uint32_t> all(n);
        for (uint32_t i = 0; i < n; ++i) all[i] = i;
        fn(std::make_shared<Communicator>(w.ctx[r], 0, "world", all), r);
      } catch (...) {
        errs[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errs;
}

inline std::vector<std::exception_ptr> run_ranks(World& w,
                                                 const std::function<void(Communicator&, uint32_t)>& fn) {
  return run_ranks_shared(w, [&fn](std::shared_ptr<Communicator> c, uint32_t r) { fn(*c, r); });
}

inline std::string describe(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  }
  return "unknown";
}

inline void expect_all_ok(const std::vector<std::exception_ptr>& errs) {
  for (size_t r = 0; r < errs.size(); ++r)
    if (errs[r]) ADD_FAILURE() << "rank " << r << ": " << describe(errs[r]);
}

}  // namespace rumor::testing
