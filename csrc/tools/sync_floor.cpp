// rumor-syncfloor: what one synchronization of P processes costs on this machine, with no data
// and no library around it: the floor under any small collective among P ranks of one host.
//
// Every small collective ends with each rank knowing that every other rank has arrived, so each
// rank must run at least once after the last arrival. With more ranks than cores that means
// descheduled ranks being woken and run, and nothing a design does about data (copies, reductions)
// removes it. This tool forks P processes that only do that: each operation every process adds
// one to a shared counter; the last to arrive wakes the sleepers with one FUTEX_WAKE; the others
// spin for --spin-us, with --yield 1 then hand the core over with a few sched_yield calls
// (YieldBudget, core/futex.h), then sleep on the counter (the protocol of HostSmall::arrive in
// csrc/comm/direct.h, without the slots). Process 0 times --samples batches of --batch operations
// after --warmup ones and prints one JSON line: {"procs", "spin_us", "yield", "per_op_us": [per batch]}.
//
// Usage: rumor-syncfloor --procs P [--spin-us S] [--yield 0|1] [--samples N] [--batch K] [--warmup W]
// Every process exits within --deadline-s (default 60) whatever happens (SIGALRM), so a caller
// never waits on a stuck child.
#include <sched.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/futex.h"

namespace {

struct alignas(64) Shared {
  std::atomic<uint32_t> arrived{0};
  alignas(64) std::atomic<uint32_t> sleepers{0};
};

using Clock = std::chrono::steady_clock;

// One operation: arrive, and return once all `procs` have arrived at operation `op` (0-based).
void arrive(Shared& s, uint32_t procs, uint64_t op, int spin_us, rumor::YieldBudget* budget) {
  const auto target = static_cast<uint32_t>(procs * (op + 1));
  // seq_cst on both words here and in the sleeper: either the sleeper sees this arrival before it
  // sleeps, or the last arrival sees the sleeper and wakes it.
  if (s.arrived.fetch_add(1, std::memory_order_seq_cst) + 1 == target) {
    if (s.sleepers.load(std::memory_order_seq_cst) != 0) rumor::futex_wake_all(&s.arrived);
    return;
  }
  const auto spin_until = Clock::now() + std::chrono::microseconds(spin_us);
  int yields = budget != nullptr ? budget->begin_wait() : 0;
  while (true) {
    const uint32_t now = s.arrived.load(std::memory_order_acquire);
    if (static_cast<int32_t>(now - target) >= 0) return;
    if (Clock::now() < spin_until) {
      rumor::cpu_relax();
      continue;
    }
    if (yields > 0) {
      --yields;
      const auto y0 = Clock::now();
      ::sched_yield();
      if (!budget->after_yield(Clock::now() - y0)) yields = 0;
      continue;
    }
    s.sleepers.fetch_add(1, std::memory_order_seq_cst);
    // bounded: a lost wake-up would cost 20 ms, never a hang
    if (s.arrived.load(std::memory_order_seq_cst) == now) rumor::futex_wait(&s.arrived, now, 20 * 1000);
    s.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

long arg(int argc, char** argv, const char* name, long fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::strtol(argv[i + 1], nullptr, 10);
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if ((a != "--procs" && a != "--spin-us" && a != "--yield" && a != "--samples" && a != "--batch" &&
         a != "--warmup" && a != "--deadline-s") ||
        i + 1 >= argc) {
      std::fprintf(stderr,
                   "usage: rumor-syncfloor --procs P [--spin-us S] [--yield 0|1] [--samples N] [--batch K] "
                   "[--warmup W] "
                   "[--deadline-s D]\n");
      return 2;
    }
  }
  const long procs = arg(argc, argv, "--procs", 0), spin_us = arg(argc, argv, "--spin-us", 0);
  const long samples = arg(argc, argv, "--samples", 10), batch = arg(argc, argv, "--batch", 1000);
  const long warmup = arg(argc, argv, "--warmup", 1000), deadline_s = arg(argc, argv, "--deadline-s", 60);
  const long yield = arg(argc, argv, "--yield", 0);
  if (procs < 2 || procs > 256 || spin_us < 0 || samples < 1 || batch < 1 || warmup < 0 || deadline_s < 1 ||
      (yield != 0 && yield != 1)) {
    std::fprintf(stderr,
                 "rumor-syncfloor: need --procs in 2..256, --samples and --batch >= 1, --yield 0 or 1, "
                 "the rest >= 0\n");
    return 2;
  }
  void* mem = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::perror("rumor-syncfloor: mmap");
    return 1;
  }
  Shared* s = std::construct_at(static_cast<Shared*>(mem));
  rumor::YieldBudget budget;  // each process its own copy (after the fork), as each rank has its own
  rumor::YieldBudget* budget_or_null = yield != 0 ? &budget : nullptr;
  const uint64_t ops = static_cast<uint64_t>(warmup) + static_cast<uint64_t>(samples) * batch;
  ::alarm(static_cast<unsigned>(deadline_s));  // a fork does not inherit it: each child sets its own
  std::vector<pid_t> children;
  for (long p = 1; p < procs; ++p) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("rumor-syncfloor: fork");
      for (pid_t c : children) ::kill(c, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      ::alarm(static_cast<unsigned>(deadline_s));
      for (uint64_t op = 0; op < ops; ++op)
        arrive(*s, static_cast<uint32_t>(procs), op, static_cast<int>(spin_us), budget_or_null);
      ::_exit(0);
    }
    children.push_back(pid);
  }
  std::vector<double> per_op_us;
  uint64_t op = 0;
  for (; op < static_cast<uint64_t>(warmup); ++op)
    arrive(*s, static_cast<uint32_t>(procs), op, static_cast<int>(spin_us), budget_or_null);
  for (long k = 0; k < samples; ++k) {
    const auto t0 = Clock::now();
    for (long b = 0; b < batch; ++b, ++op)
      arrive(*s, static_cast<uint32_t>(procs), op, static_cast<int>(spin_us), budget_or_null);
    per_op_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / batch);
  }
  int failed = 0;
  for (pid_t c : children) {
    int status = 0;
    if (::waitpid(c, &status, 0) != c || !WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  if (failed != 0) {
    std::fprintf(stderr, "rumor-syncfloor: %d of %ld children did not finish\n", failed, procs - 1);
    return 1;
  }
  std::printf("{\"procs\": %ld, \"spin_us\": %ld, \"yield\": %ld, \"batch\": %ld, \"per_op_us\": [", procs,
              spin_us, yield, batch);
  for (size_t i = 0; i < per_op_us.size(); ++i) std::printf("%s%.3f", i ? ", " : "", per_op_us[i]);
  std::printf("]}\n");
  return 0;
}
