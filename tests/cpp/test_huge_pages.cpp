// core/huge_pages.h: which pages a buffer's collapse covers, when it is asked for, and (where the
// kernel allows it) that the buffer ends up on 2 MiB pages with its contents unchanged.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/huge_pages.h"
#include "ranks.h"

namespace rumor {
namespace {

using namespace testing;

constexpr size_t kMiB = size_t{1} << 20;

TEST(HugeBacking, InteriorIsTheWholeHugePagesInsideTheBuffer) {
  const auto at = [](uintptr_t a) { return reinterpret_cast<const void*>(a); };
  constexpr uintptr_t base = uintptr_t{1} << 30;  // 2 MiB aligned
  EXPECT_EQ(HugeBacking::interior(at(base), 4 * kMiB), std::make_pair(base, 4 * kMiB));
  EXPECT_EQ(HugeBacking::interior(at(base + 4096), 4 * kMiB), std::make_pair(base + 2 * kMiB, 2 * kMiB));
  EXPECT_EQ(HugeBacking::interior(at(base + 4096), 4 * kMiB - 8192).second, 0u);  // no whole page
  EXPECT_EQ(HugeBacking::interior(at(base), 2 * kMiB - 1).second, 0u);
  EXPECT_EQ(HugeBacking::interior(at(base + 1), 6 * kMiB).second, 4 * kMiB);
}

// An anonymous mapping that unmaps itself.
struct Mapping {
  explicit Mapping(size_t n)
      : len(n), p(::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)) {}
  ~Mapping() {
    if (p != MAP_FAILED) ::munmap(p, len);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  size_t len;
  void* p;
};

TEST(HugeBacking, CollapsesOnlyARangeSeenBefore) {
  Mapping m(16 * kMiB), other(16 * kMiB);
  ASSERT_NE(m.p, MAP_FAILED);
  ASSERT_NE(other.p, MAP_FAILED);
  std::memset(m.p, 1, m.len);
  HugeBacking h;
  EXPECT_FALSE(h.prepare(m.p, m.len));  // first sighting: remembered only
  EXPECT_FALSE(h.prepare(other.p, other.len));
  EXPECT_FALSE(h.prepare(m.p, m.len - 4096));  // another length is another buffer
  EXPECT_EQ(h.collapses(), 0u);
  EXPECT_EQ(h.prepare(m.p, m.len), h.refused() == 0);  // huge now, unless the kernel cannot
  EXPECT_EQ(h.collapses(), 1u);
  EXPECT_FALSE(h.prepare(m.p, kMiB));  // too small to hold a huge page: never asked
  HugeBacking off(false);
  EXPECT_FALSE(off.prepare(m.p, m.len));
  EXPECT_FALSE(off.prepare(m.p, m.len));
  EXPECT_EQ(off.collapses(), 0u);
}

// The policy over what each collapse call did (a fake kernel): a buffer that stays in place is
// collapsed once for real and then costs only no-op calls, for good, even if now and then it
// comes back on fresh pages; one allocated afresh at the same place every time is left alone
// after its pages had to be moved kMaxMoves times; refusals.
TEST(HugeBacking, LeavesAloneABufferAllocatedAfreshEveryTime) {
  std::vector<HugeBacking::Outcome> script;
  size_t calls = 0;
  // A fresh tracker per case: buffers that keep coming back fresh stop collapsing altogether.
  auto tracker = [&] {
    calls = 0;
    return HugeBacking(true, [&](void*, size_t bytes) {
      EXPECT_EQ(bytes, 8 * kMiB);
      return calls < script.size() ? script[calls++] : HugeBacking::Outcome{};
    });
  };
  HugeBacking h = tracker();
  const double moved = 0.004, noop = 2e-6;                             // seconds for 4 huge pages
  const auto* at = reinterpret_cast<const void*>(uintptr_t{1} << 32);  // 2 MiB aligned, never touched
  // Used again and again, freed and allocated again at the same place twice in between.
  script = {{0, moved}, {0, noop}, {0, noop},  {0, noop}, {0, moved},
            {0, noop},  {0, noop}, {0, moved}, {0, noop}};
  EXPECT_FALSE(h.prepare(at, 8 * kMiB));
  for (size_t i = 0; i < script.size(); ++i) EXPECT_TRUE(h.prepare(at, 8 * kMiB)) << "call " << i;
  EXPECT_EQ(calls, script.size());

  // Fresh every time: moved twice, never found huge: left alone.
  const auto* fresh = reinterpret_cast<const void*>((uintptr_t{1} << 32) + 192 * kMiB);
  script = {{0, moved}, {0, moved}};
  h = tracker();
  EXPECT_FALSE(h.prepare(fresh, 8 * kMiB));
  EXPECT_TRUE(h.prepare(fresh, 8 * kMiB));
  EXPECT_TRUE(h.prepare(fresh, 8 * kMiB));
  EXPECT_FALSE(h.prepare(fresh, 8 * kMiB));
  EXPECT_EQ(calls, 2u);

  const auto* other = reinterpret_cast<const void*>((uintptr_t{1} << 32) + 64 * kMiB);
  script = {{EAGAIN, 0}, {EAGAIN, 0}};
  h = tracker();
  h.prepare(other, 8 * kMiB);
  EXPECT_FALSE(h.prepare(other, 8 * kMiB));  // asked, refused: not on huge pages
  EXPECT_FALSE(h.prepare(other, 8 * kMiB));
  EXPECT_EQ(calls, 2u);
  EXPECT_FALSE(h.prepare(other, 8 * kMiB));  // refused twice for want of a huge page: not asked
  EXPECT_EQ(calls, 2u);
  EXPECT_EQ(h.refused(), 2u);

  const auto* third = reinterpret_cast<const void*>((uintptr_t{1} << 32) + 128 * kMiB);
  script = {{EINVAL, 0}};
  h = tracker();
  h.prepare(third, 8 * kMiB);
  EXPECT_FALSE(h.prepare(third, 8 * kMiB));
  EXPECT_FALSE(h.prepare(third, 8 * kMiB));  // the kernel cannot: once is enough
  EXPECT_EQ(calls, 1u);

  // Where the kernel has collapsed before, EINVAL is a buffer not written yet (a new one at a
  // known place, before its first operation): asked again, and a success forgets the refusals.
  script = {{0, moved}, {0, noop}, {0, noop}, {EINVAL, 0}, {0, moved}, {0, noop}, {EINVAL, 0}, {EINVAL, 0}};
  h = tracker();
  EXPECT_FALSE(h.prepare(third, 8 * kMiB));
  EXPECT_TRUE(h.prepare(third, 8 * kMiB));
  EXPECT_TRUE(h.prepare(third, 8 * kMiB));
  EXPECT_TRUE(h.prepare(third, 8 * kMiB));
  EXPECT_FALSE(h.prepare(third, 8 * kMiB));  // refused
  EXPECT_TRUE(h.prepare(third, 8 * kMiB));   // written now: moved
  EXPECT_TRUE(h.prepare(third, 8 * kMiB));
  EXPECT_FALSE(h.prepare(third, 8 * kMiB));
  EXPECT_FALSE(h.prepare(third, 8 * kMiB));  // twice in a row: not asked again
  EXPECT_FALSE(h.prepare(third, 8 * kMiB));
  EXPECT_EQ(calls, 8u);
  EXPECT_EQ(h.refused(), 3u);
}

// Where buffers keep coming back on fresh pages (FSDP's gathers at several places of one size),
// collapsing stops altogether after kMaxRemoves of them, for every range.
TEST(HugeBacking, StopsWhereBuffersKeepComingBackOnFreshPages) {
  size_t calls = 0;
  HugeBacking h(true, [&](void*, size_t) {
    ++calls;
    return HugeBacking::Outcome{0, 0.004};  // every call moves pages
  });
  auto at = [](int i) { return reinterpret_cast<const void*>((uintptr_t{1} << 32) + i * 64 * kMiB); };
  for (int i = 0; i < HugeBacking::kMaxRemoves; ++i) {
    EXPECT_FALSE(h.prepare(at(i), 8 * kMiB));  // seen
    EXPECT_TRUE(h.prepare(at(i), 8 * kMiB));   // moved
    EXPECT_TRUE(h.prepare(at(i), 8 * kMiB));   // moved again
  }
  EXPECT_EQ(calls, 2u * HugeBacking::kMaxRemoves);
  EXPECT_FALSE(h.prepare(at(9), 8 * kMiB));
  EXPECT_FALSE(h.prepare(at(9), 8 * kMiB));  // a new range is not asked about either
  EXPECT_EQ(calls, 2u * HugeBacking::kMaxRemoves);
}

TEST(HugeBacking, ForgetsTheOldestOfMoreRangesThanItKeeps) {
  Mapping m(64 * kMiB);
  ASSERT_NE(m.p, MAP_FAILED);
  HugeBacking h;
  auto* base = static_cast<std::byte*>(m.p);
  for (size_t i = 0; i <= HugeBacking::kRecent; ++i) EXPECT_FALSE(h.prepare(base + i * 4096, 4 * kMiB));
  EXPECT_FALSE(h.prepare(base, 4 * kMiB));  // the first was forgotten: seen "first" again
  EXPECT_EQ(h.collapses(), 0u);
}

// AnonHugePages of the mapping that holds `p`, in kB (/proc/self/smaps).
long anon_huge_kb(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  const auto a = reinterpret_cast<uintptr_t>(p);
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= a && a < hi;
      continue;
    }
    if (inside && line.rfind("AnonHugePages:", 0) == 0) return std::stol(line.substr(14));
  }
  return -1;
}

TEST(HugeBacking, TheBufferEndsOnHugePagesWithTheSameBytes) {
  Mapping m(16 * kMiB);
  ASSERT_NE(m.p, MAP_FAILED);
  auto* bytes = static_cast<uint8_t*>(m.p);
  for (size_t i = 0; i < m.len; ++i) bytes[i] = static_cast<uint8_t>(i * 7 + (i >> 12));
  ASSERT_EQ(anon_huge_kb(m.p), 0) << "the kernel gave this mapping huge pages already (THP \"always\"?)";
  HugeBacking h;
  h.prepare(m.p, m.len);
  const bool huge = h.prepare(m.p, m.len);
  if (h.refused() != 0)
    GTEST_SKIP() << "the kernel refused MADV_COLLAPSE (before Linux 6.1, or THP \"never\")";
  EXPECT_TRUE(huge);
  const auto [start, len] = HugeBacking::interior(m.p, m.len);
  EXPECT_EQ(anon_huge_kb(m.p), static_cast<long>(len / 1024));
  EXPECT_GE(len, 14 * kMiB);
  for (size_t i = 0; i < m.len; ++i)
    ASSERT_EQ(bytes[i], static_cast<uint8_t>(i * 7 + (i >> 12))) << "byte " << i;
}

// The direct path on one host (comm/direct.h), on a buffer used again and again as DDP's buckets
// are: from its second operation the buffer lies on 2 MiB pages, and every result stays exact.
// Two ranks take the direct path from 16 MiB on (Options::kTwoRankDirectMinBytes).
TEST(HugeBacking, ARepeatedDirectAllreduceRunsOnHugePagesExactly) {
  {
    Mapping probe(8 * kMiB);
    ASSERT_NE(probe.p, MAP_FAILED);
    std::memset(probe.p, 1, probe.len);
    HugeBacking h;
    h.prepare(probe.p, probe.len);
    h.prepare(probe.p, probe.len);
    if (h.refused() != 0)
      GTEST_SKIP() << "the kernel refused MADV_COLLAPSE (before Linux 6.1, or THP \"never\")";
  }
  for (uint32_t n : {2u, 4u}) {
    auto w = make_world(one_host(n), quick_options(true));
    const size_t count = (Options::kTwoRankDirectMinBytes + 3 * kMiB) / sizeof(float) + 5;
    std::vector<long> huge_kb(n, -1);
    auto errs = run_ranks(w, [&, n](Communicator& c, uint32_t r) {
      ASSERT_TRUE(c.use_direct(count * sizeof(float)));
      std::vector<float> v(count);
      for (int op = 0; op < 3; ++op) {
        for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>((r + 1) * (op + 1) + i % 7);
        c.allreduce(v.data(), count, DType::F32, ReduceOp::SUM);
        const float ranks = static_cast<float>(n * (n + 1) / 2 * (op + 1));
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(v[i], ranks + static_cast<float>(n * (i % 7))) << "op " << op << " i " << i;
      }
      c.barrier();
      huge_kb[r] = anon_huge_kb(v.data());
    });
    expect_all_ok(errs);
    for (uint32_t r = 0; r < n; ++r)
      EXPECT_GE(huge_kb[r], static_cast<long>(Options::kTwoRankDirectMinBytes / 1024))
          << n << " ranks: rank " << r << "'s buffer is not on huge pages";
  }
}

}  // namespace
}  // namespace rumor
