// Timeline writer and flight recorder (trace/recorder.h).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "ranks.h"
#include "trace/recorder.h"

namespace rumor {
namespace {

using trace::Event;
using trace::FlightState;
using trace::OpDesc;
using trace::Recorder;

std::string temp_path(const std::string& stem) {
  return (std::filesystem::temp_directory_path() / (stem + "-" + std::to_string(::getpid()) + ".json"))
      .string();
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Every line after "[" is one event (each written as one line); returns (tid, ts, name) of X events.
struct Parsed {
  int tid;
  double ts, dur;
  std::string name;
};
std::vector<Parsed> x_events(const std::string& text) {
  std::vector<Parsed> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("\"ph\":\"X\"") == std::string::npos) continue;
    Parsed p{};
    auto num = [&](const char* key) {
      size_t at = line.find(key);
      EXPECT_NE(at, std::string::npos) << line;
      return std::stod(line.substr(at + std::strlen(key)));
    };
    p.tid = static_cast<int>(num("\"tid\":"));
    p.ts = num("\"ts\":");
    p.dur = num("\"dur\":");
    size_t n0 = line.find("\"name\":\"") + 8;
    p.name = line.substr(n0, line.find('"', n0) - n0);
    out.push_back(p);
  }
  return out;
}

TEST(Timeline, ThreadsWriteOrderedEventsAndTheArrayIsClosed) {
  const std::string path = temp_path("rumor-trace-threads");
  Recorder rec(3, 0);
  rec.start(path, 1.5, 2.0);
  constexpr int kThreads = 4, kEach = 3000;  // more than one ring's worth: the writer drains meanwhile
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&rec, t] {
      rec.name_thread("producer " + std::to_string(t));
      for (int i = 0; i < kEach; ++i) {
        Event e;
        e.ts = 1000.0 * i;
        e.dur = 10;
        std::snprintf(e.name, sizeof(e.name), "t%d-%d", t, i);
        rec.emit(e);
        if (i % 512 == 511)
          std::this_thread::sleep_for(std::chrono::milliseconds(2 * Recorder::kFlushIntervalMs));
      }
    });
  }
  for (auto& t : ts) t.join();
  rec.stop();
  const std::string text = slurp(path);
  ASSERT_EQ(text.rfind("[\n", 0), 0u);
  ASSERT_EQ(text.substr(text.size() - 3), "\n]\n");
  EXPECT_NE(text.find("\"rumor_clock\""), std::string::npos);
  EXPECT_NE(text.find("\"offset_us\":1.500"), std::string::npos);
  EXPECT_NE(text.find("producer 2"), std::string::npos);
  auto events = x_events(text);
  EXPECT_EQ(events.size() + rec.dropped(), static_cast<size_t>(kThreads * kEach));
  // Per thread, events appear in the order that thread emitted them.
  std::map<int, double> last;
  std::map<int, int> count;
  for (const auto& e : events) {
    EXPECT_EQ(e.name.rfind('t', 0), 0u);
    auto it = last.find(e.tid);
    if (it != last.end()) {
      EXPECT_GT(e.ts, it->second) << "tid " << e.tid;
    }
    last[e.tid] = e.ts;
    ++count[e.tid];
  }
  EXPECT_EQ(count.size(), static_cast<size_t>(kThreads));
  std::filesystem::remove(path);
}

TEST(Timeline, OffEmitsNothingAndFlushWritesWithoutStopping) {
  const std::string path = temp_path("rumor-trace-flush");
  Recorder rec(0, 0);
  Event e;
  std::snprintf(e.name, sizeof(e.name), "before");
  rec.emit(e);  // no timeline: dropped silently, not counted
  EXPECT_FALSE(rec.active());
  rec.start(path, 0, 0);
  std::snprintf(e.name, sizeof(e.name), "during");
  rec.emit(e);
  rec.flush();
  // The file is readable while recording: everything but the closing bracket.
  const std::string partial = slurp(path);
  EXPECT_NE(partial.find("\"during\""), std::string::npos);
  EXPECT_EQ(partial.find("\"before\""), std::string::npos);
  EXPECT_EQ(partial.find(']', partial.rfind('}')), std::string::npos);
  rec.stop();
  rec.stop();  // idempotent
  EXPECT_EQ(rec.dropped(), 0u);
  std::filesystem::remove(path);
}

TEST(FlightRecorder, KeepsTheLastNInOrder) {
  Recorder rec(0, 4);
  std::vector<uint64_t> seqs;
  for (int i = 0; i < 10; ++i) {
    std::string name = "op" + std::to_string(i);
    seqs.push_back(
        rec.flight_begin(OpDesc{name, "world", static_cast<uint64_t>(i), 100 * i, -1, 2, nullptr, nullptr},
                         FlightState::kQueued, 1.0 * i));
  }
  rec.flight_update(seqs[0], FlightState::kDone, 99);  // overwritten long ago: ignored
  rec.flight_update(seqs[8], FlightState::kRunning, 20);
  rec.flight_update(seqs[9], FlightState::kFailed, 30, "boom");
  auto recs = rec.flight_records();
  ASSERT_EQ(recs.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(recs[i].name, "op" + std::to_string(6 + i));
    EXPECT_EQ(recs[i].seq, seqs[6 + i]);
    EXPECT_EQ(recs[i].bytes, 100 * (6 + i));
  }
  EXPECT_EQ(recs[0].state, FlightState::kQueued);
  EXPECT_EQ(recs[2].state, FlightState::kRunning);
  EXPECT_EQ(recs[2].t_start, 20);
  EXPECT_EQ(recs[3].state, FlightState::kFailed);
  EXPECT_EQ(recs[3].error, "boom");
  Recorder off(0, 0);
  EXPECT_EQ(off.flight_begin(OpDesc{"x", "world"}, FlightState::kRunning, 0), 0u);
  EXPECT_TRUE(off.flight_records().empty());
}

TEST(FlightRecorder, CommunicatorRecordsOpsAndFailures) {
  auto w = testing::make_world(testing::one_host(2), testing::quick_options(true));
  const std::string path = temp_path("rumor-trace-comm");
  w.ctx[0]->recorder().start(path, 0, 0);
  testing::expect_all_ok(testing::run_ranks(w, [](Communicator& c, uint32_t) {
    std::vector<float> v(1000, 1.0f);
    c.allreduce(v.data(), v.size(), DType::F32, ReduceOp::SUM);
    c.barrier();
  }));
  w.ctx[0]->recorder().stop();
  for (uint32_t r = 0; r < 2; ++r) {
    auto recs = w.ctx[r]->recorder().flight_records();
    ASSERT_EQ(recs.size(), 2u);
    EXPECT_EQ(recs[0].name, "allreduce");
    EXPECT_EQ(recs[0].bytes, 4000);
    EXPECT_EQ(recs[0].state, FlightState::kDone);
    EXPECT_EQ(recs[1].name, "barrier");
    EXPECT_EQ(recs[1].tag, 1u);
  }
  auto events = x_events(slurp(path));
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].name, "allreduce");
  const std::string text = slurp(path);
  EXPECT_NE(text.find("\"algorithm\":\"shared slots\""), std::string::npos);
  EXPECT_NE(text.find("\"transport\":\"shm\""), std::string::npos);
  std::filesystem::remove(path);

  // A rank that never joins: the other times out, and its ring says which op failed.
  Options o = testing::quick_options(false);
  o.timeout_s = 0.3;
  auto w2 = testing::make_world(testing::one_host(2), o);
  auto errs = testing::run_ranks(w2, [](Communicator& c, uint32_t r) {
    if (r == 0) c.barrier();
  });
  ASSERT_TRUE(errs[0]);
  auto recs = w2.ctx[0]->recorder().flight_records();
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_EQ(recs[0].name, "barrier");
  EXPECT_EQ(recs[0].state, FlightState::kFailed);
  EXPECT_NE(recs[0].error.find("barrier (op #0, world)"), std::string::npos) << recs[0].error;
}

}  // namespace
}  // namespace rumor
