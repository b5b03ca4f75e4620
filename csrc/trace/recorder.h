// Timeline (Chrome trace JSON, read by Perfetto and chrome://tracing) and flight recorder.
//
// Timeline: each producing thread owns a single-producer ring of fixed-size events; a
// background writer drains every ring into the trace file and flushes it every
// kFlushInterval, so a killed process leaves everything up to its last flush. The file is a
// JSON array written as "[" event (",\n" event)* and closed with "\n]" at stop: a file cut short
// lacks only the closing bracket (Perfetto and chrome://tracing accept that; a strict JSON parser
// needs "]" appended). When no timeline is active, emitting costs one relaxed atomic load.
//
// Flight recorder: the last N operations of this process (name, tag, bytes, peers, state,
// times), kept at all times and dumped to the log (and to the trace, if one is active) when
// an operation fails.
//
// Core-level: no dependency on the communication layer; the communicator describes its
// operations with OpDesc.
#pragma once

#include <pthread.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace rumor::trace {

// Microseconds on the steady clock (CLOCK_MONOTONIC, the clock of Python's time.monotonic()).
double now_us();

enum class Category : uint8_t { kComm = 0, kBucket, kPhase, kUser, kCodec, kWait, kFlight };
const char* category_name(Category c);

// One trace event, fixed size so that rings never allocate. Strings are truncated to fit.
struct Event {
  char ph = 'X';  // 'X' complete, 'i' instant, 'b'/'e' async begin/end
  Category cat = Category::kComm;
  int32_t peer = -1;
  uint32_t ranks = 0;  // members of the communicator, 0 when not an operation
  double ts = 0, dur = 0;
  uint64_t id = 0;  // async id ('b'/'e')
  uint64_t tag = 0;
  int64_t bytes = -1;
  const char* algo = nullptr;       // static strings only
  const char* transport = nullptr;  // static strings only
  char name[48] = {};
  char comm[24] = {};
  char args[112] = {};  // extra "key": value pairs as a JSON object body (already escaped)
};

// What the communicator says about an operation it starts.
struct OpDesc {
  std::string_view name;
  std::string_view comm;
  uint64_t tag = 0;
  int64_t bytes = -1;
  int32_t peer = -1;  // world rank of the one peer (send/recv), -1 for collectives
  uint32_t ranks = 0;
  const char* algo = nullptr;
  const char* transport = nullptr;
  double blocked_us = -1;  // time spent asleep waiting for peers, when measured
};

enum class FlightState : uint8_t { kQueued = 0, kRunning, kDone, kFailed };
const char* state_name(FlightState s);

struct FlightEntry {
  uint64_t seq = 0;  // 1, 2, ... in the order operations began on this process
  FlightState state = FlightState::kQueued;
  uint64_t tag = 0;
  int64_t bytes = -1;
  int32_t peer = -1;
  uint32_t ranks = 0;
  double t_begin = 0, t_start = 0, t_end = 0;  // microseconds, steady clock; 0 = not yet
  std::string name, comm, error;
};

class Recorder {
 public:
  static constexpr size_t kRingEvents = 4096;  // per thread, power of two
  static constexpr size_t kMaxThreads = 256;
  static constexpr int kFlushIntervalMs = 50;

  Recorder(uint32_t rank, size_t flight_capacity);
  ~Recorder();
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  uint32_t rank() const { return rank_; }
  bool active() const { return active_.load(std::memory_order_relaxed); }

  // Opens `path` (truncating it) and starts the writer. clock_offset_us is this process's
  // steady clock minus rank 0's (measured by the caller), stored in the file for merging.
  void start(const std::string& path, double clock_offset_us, double clock_rtt_us);
  // Drains every ring, closes the array and the file. Idempotent.
  void stop();
  // Asks the writer to write what it has now and waits (at most timeout_ms) until it did.
  void flush(int timeout_ms = 1000);
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  std::string path() const;

  // Records an event from the calling thread (dropped if no timeline is active or its ring is
  // full). The writer gives it this thread's id.
  void emit(const Event& e);
  // Names the calling thread in the trace (thread_name metadata).
  void name_thread(std::string_view name);

  // Flight recorder. Returns the entry's sequence number (0 when the recorder is off).
  uint64_t flight_begin(const OpDesc& op, FlightState state, double t);
  void flight_update(uint64_t seq, FlightState state, double t, std::string_view error = {});
  std::vector<FlightEntry> flight_records() const;
  size_t flight_capacity() const { return flight_.size(); }
  // Writes the ring to the log at warn level and, with a timeline active, into the trace, then
  // flushes it. Does nothing if no operation began since the last dump (one failure aborts
  // several communicators).
  void dump_flight(std::string_view why);

  // Helpers for operation spans: the communicator calls op_begin when an operation starts and
  // op_end when it returns or fails.
  struct OpToken {
    uint64_t seq = 0;
    double t0 = 0;
    bool timed = false;
  };
  OpToken op_begin(const OpDesc& op);
  void op_end(const OpToken& tok, const OpDesc& op, bool ok, std::string_view error = {});

 private:
  struct Ring {
    std::array<Event, kRingEvents> events;
    alignas(64) std::atomic<uint64_t> head{0};  // written by the producer
    alignas(64) std::atomic<uint64_t> tail{0};  // written by the consumer
    int tid = 0;
    std::string thread_name;  // guarded by names_mu_
    bool named_written = false;
  };
  struct Slot {
    std::atomic<uint64_t> owner{0};  // pthread_self() of the producer, 0 = free
    std::atomic<Ring*> ring{nullptr};
  };
  Ring* ring_for_this_thread();
  void writer_loop();
  // Moves every ring's events into out (JSON text). Caller is the only consumer.
  size_t drain(std::string& out);
  void write_event(std::string& out, const Event& e, int tid);
  void write_raw(const std::string& text);

  const uint32_t rank_;
  std::atomic<bool> active_{false};
  std::atomic<uint64_t> dropped_{0};
  std::array<Slot, kMaxThreads> slots_;
  std::mutex rings_mu_;  // owns the rings (allocation only)
  std::vector<std::unique_ptr<Ring>> rings_;
  std::mutex names_mu_;

  // Writer state. file_mu_ serialises start/stop/flush against the writer thread.
  mutable std::mutex file_mu_;
  std::condition_variable cv_;
  std::FILE* file_ = nullptr;
  std::string path_;
  bool first_event_ = true;
  bool stop_writer_ = false;
  uint64_t flush_requests_ = 0, flushes_done_ = 0;
  std::thread writer_;

  // Flight recorder: a fixed ring, guarded by flight_mu_ (operations are microseconds or more;
  // an uncontended lock is small beside them).
  struct FlightSlot {
    uint64_t seq = 0;
    FlightState state = FlightState::kQueued;
    uint64_t tag = 0;
    int64_t bytes = -1;
    int32_t peer = -1;
    uint32_t ranks = 0;
    double t_begin = 0, t_start = 0, t_end = 0;
    char name[48] = {}, comm[24] = {}, error[160] = {};
  };
  mutable std::mutex flight_mu_;
  std::vector<FlightSlot> flight_;
  uint64_t flight_next_ = 1;
  uint64_t flight_dumped_upto_ = 0;
};

// A complete event around a scope on the calling thread (operations that do not go through a
// communicator, e.g. one-sided windows). Costs one relaxed atomic load when no timeline is on.
class Span {
 public:
  Span(Recorder& rec, const char* name, Category cat, int64_t bytes = -1, uint32_t ranks = 0,
       std::string_view comm = {})
      : rec_(rec),
        t0_(rec.active() ? now_us() : 0),
        name_(name),
        cat_(cat),
        bytes_(bytes),
        ranks_(ranks),
        comm_(comm) {}
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  Recorder& rec_;
  double t0_;
  const char* name_;
  Category cat_;
  int64_t bytes_;
  uint32_t ranks_;
  std::string_view comm_;
};

}  // namespace rumor::trace
