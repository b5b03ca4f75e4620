#include "trace/recorder.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>

#include "core/log.h"
#include "core/types.h"

namespace rumor::trace {

namespace {

template <size_t N>
void copy_str(char (&dst)[N], std::string_view src) {
  size_t n = std::min(src.size(), N - 1);
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

void json_escape(std::string& out, std::string_view s) {
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\u%04x", c);
          out += b;
        } else {
          out += c;
        }
    }
  }
}

void append_num(std::string& out, double v) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.3f", v);
  out += b;
}

void append_int(std::string& out, int64_t v) { out += std::to_string(v); }

// Args are a JSON fragment: one that does not fit is left out rather than cut mid-token.
template <size_t N>
void copy_args(char (&dst)[N], const std::string& src) {
  if (src.size() < N) copy_str(dst, src);
}

}  // namespace

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

const char* category_name(Category c) {
  switch (c) {
    case Category::kComm:
      return "comm";
    case Category::kBucket:
      return "bucket";
    case Category::kPhase:
      return "phase";
    case Category::kUser:
      return "user";
    case Category::kCodec:
      return "codec";
    case Category::kWait:
      return "wait";
    case Category::kFlight:
      return "flight";
  }
  return "other";
}

const char* state_name(FlightState s) {
  switch (s) {
    case FlightState::kQueued:
      return "queued";
    case FlightState::kRunning:
      return "running";
    case FlightState::kDone:
      return "done";
    case FlightState::kFailed:
      return "failed";
  }
  return "?";
}

Recorder::Recorder(uint32_t rank, size_t flight_capacity) : rank_(rank), flight_(flight_capacity) {}

Recorder::~Recorder() { stop(); }

std::string Recorder::path() const {
  std::lock_guard lk(file_mu_);
  return path_;
}

Recorder::Ring* Recorder::ring_for_this_thread() {
  const auto me = static_cast<uint64_t>(::pthread_self());
  const size_t h = std::hash<uint64_t>{}(me);
  for (size_t i = 0; i < kMaxThreads; ++i) {
    Slot& s = slots_[(h + i) % kMaxThreads];
    uint64_t o = s.owner.load(std::memory_order_acquire);
    if (o == me) return s.ring.load(std::memory_order_acquire);
    if (o != 0) continue;
    if (!s.owner.compare_exchange_strong(o, me, std::memory_order_acq_rel)) {
      if (o == me) return s.ring.load(std::memory_order_acquire);
      continue;
    }
    // First event of this thread: the only allocation a producer ever makes.
    Ring* r;
    {
      std::lock_guard lk(rings_mu_);
      rings_.push_back(std::make_unique<Ring>());
      r = rings_.back().get();
    }
    r->tid = static_cast<int>(::syscall(SYS_gettid));
    char os_name[16] = {};
    if (::pthread_getname_np(::pthread_self(), os_name, sizeof(os_name)) == 0 && os_name[0] != '\0') {
      std::lock_guard lk(names_mu_);
      r->thread_name = std::string(os_name) + " " + std::to_string(r->tid);
    }
    s.ring.store(r, std::memory_order_release);
    return r;
  }
  return nullptr;
}

void Recorder::emit(const Event& e) {
  if (!active()) return;
  Ring* r = ring_for_this_thread();
  if (r == nullptr) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const uint64_t head = r->head.load(std::memory_order_relaxed);
  if (head - r->tail.load(std::memory_order_acquire) >= kRingEvents) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  r->events[head & (kRingEvents - 1)] = e;
  r->head.store(head + 1, std::memory_order_release);
}

void Recorder::name_thread(std::string_view name) {
  Ring* r = ring_for_this_thread();
  if (r == nullptr) return;
  std::lock_guard lk(names_mu_);
  r->thread_name = std::string(name);
  r->named_written = false;
}

void Recorder::write_event(std::string& out, const Event& e, int tid) {
  out += "{\"name\":\"";
  json_escape(out, e.name);
  out += "\",\"cat\":\"";
  out += category_name(e.cat);
  out += "\",\"ph\":\"";
  out += e.ph;
  out += "\",\"pid\":";
  append_int(out, rank_);
  out += ",\"tid\":";
  append_int(out, tid);
  out += ",\"ts\":";
  append_num(out, e.ts);
  if (e.ph == 'X') {
    out += ",\"dur\":";
    append_num(out, e.dur);
  } else if (e.ph == 'i') {
    out += ",\"s\":\"t\"";
  } else if (e.ph == 'b' || e.ph == 'e') {
    out += ",\"id\":\"0x";
    char b[24];
    std::snprintf(b, sizeof(b), "%llx", static_cast<unsigned long long>(e.id));
    out += b;
    out += "\"";
  }
  out += ",\"args\":{";
  bool any = false;
  auto sep = [&] {
    if (any) out += ",";
    any = true;
  };
  if (e.comm[0] != '\0') {
    sep();
    out += "\"comm\":\"";
    json_escape(out, e.comm);
    out += "\",\"tag\":";
    append_int(out, static_cast<int64_t>(e.tag));
  }
  if (e.bytes >= 0) {
    sep();
    out += "\"bytes\":";
    append_int(out, e.bytes);
  }
  if (e.ranks > 0) {
    sep();
    out += "\"ranks\":";
    append_int(out, e.ranks);
  }
  if (e.peer >= 0) {
    sep();
    out += "\"peer\":";
    append_int(out, e.peer);
  }
  if (e.algo != nullptr) {
    sep();
    out += "\"algorithm\":\"";
    out += e.algo;
    out += "\"";
  }
  if (e.transport != nullptr) {
    sep();
    out += "\"transport\":\"";
    out += e.transport;
    out += "\"";
  }
  if (e.args[0] != '\0') {
    sep();
    out += e.args;
  }
  out += "}}";
}

void Recorder::write_raw(const std::string& text) {
  if (file_ == nullptr || text.empty()) return;
  std::fwrite(text.data(), 1, text.size(), file_);
  std::fflush(file_);
}

size_t Recorder::drain(std::string& out) {
  size_t n = 0;
  auto next = [&] {
    // "[" first event (",\n" event)*: a file cut anywhere between writes misses only "]".
    if (!first_event_) out += ",\n";
    first_event_ = false;
  };
  for (Slot& s : slots_) {
    Ring* r = s.ring.load(std::memory_order_acquire);
    if (r == nullptr) continue;
    {
      std::lock_guard lk(names_mu_);
      if (!r->named_written) {
        r->named_written = true;
        next();
        out += "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":";
        append_int(out, rank_);
        out += ",\"tid\":";
        append_int(out, r->tid);
        out += ",\"args\":{\"name\":\"";
        json_escape(out, r->thread_name.empty() ? "thread " + std::to_string(r->tid) : r->thread_name);
        out += "\"}}";
      }
    }
    const uint64_t head = r->head.load(std::memory_order_acquire);
    uint64_t tail = r->tail.load(std::memory_order_relaxed);
    for (; tail < head; ++tail, ++n) {
      next();
      write_event(out, r->events[tail & (kRingEvents - 1)], r->tid);
    }
    r->tail.store(tail, std::memory_order_release);
  }
  return n;
}

void Recorder::start(const std::string& path, double clock_offset_us, double clock_rtt_us) {
  stop();
  std::lock_guard lk(file_mu_);
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr)
    throw Error(ErrorKind::kInvalidArgument,
                "timeline: cannot open " + path + " for writing: " + std::strerror(errno));
  file_ = f;
  path_ = path;
  first_event_ = true;
  stop_writer_ = false;
  // Events left from an earlier timeline (or emitted while none was active) are not this one's.
  for (Slot& s : slots_) {
    Ring* r = s.ring.load(std::memory_order_acquire);
    if (r == nullptr) continue;
    r->tail.store(r->head.load(std::memory_order_acquire), std::memory_order_release);
    std::lock_guard nl(names_mu_);
    r->named_written = false;
  }
  std::string out = "[\n";
  first_event_ = false;
  const std::string pid = std::to_string(rank_);
  out += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"args\":{\"name\":\"rank " + pid +
         "\"}},\n";
  out += "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" + pid + ",\"args\":{\"sort_index\":" + pid +
         "}},\n";
  // Not a Chrome metadata name (viewers ignore it): what rumor.timeline.merge() aligns by.
  out += "{\"name\":\"rumor_clock\",\"ph\":\"M\",\"pid\":" + pid + ",\"args\":{\"rank\":" + pid +
         ",\"offset_us\":";
  append_num(out, clock_offset_us);
  out += ",\"rtt_us\":";
  append_num(out, clock_rtt_us);
  out += "}}";
  write_raw(out);
  active_.store(true, std::memory_order_release);
  writer_ = std::thread([this] { writer_loop(); });
}

void Recorder::writer_loop() {
  std::unique_lock lk(file_mu_);
  while (true) {
    cv_.wait_for(lk, std::chrono::milliseconds(kFlushIntervalMs),
                 [&] { return stop_writer_ || flush_requests_ > flushes_done_; });
    const uint64_t req = flush_requests_;
    const bool last = stop_writer_;
    std::string out;
    drain(out);
    write_raw(out);
    flushes_done_ = req;
    cv_.notify_all();
    if (last) return;
  }
}

void Recorder::flush(int timeout_ms) {
  std::unique_lock lk(file_mu_);
  if (file_ == nullptr || !writer_.joinable()) return;
  const uint64_t want = ++flush_requests_;
  cv_.notify_all();
  cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms),
               [&] { return flushes_done_ >= want || file_ == nullptr; });
}

void Recorder::stop() {
  std::thread writer;
  {
    std::lock_guard lk(file_mu_);
    if (file_ == nullptr) return;
    active_.store(false, std::memory_order_release);
    stop_writer_ = true;
    cv_.notify_all();
    writer = std::move(writer_);
  }
  if (writer.joinable()) writer.join();
  std::lock_guard lk(file_mu_);
  std::string out;
  drain(out);
  if (dropped() > 0) {
    out += ",\n{\"name\":\"rumor_dropped_events\",\"ph\":\"M\",\"pid\":" + std::to_string(rank_) +
           ",\"args\":{\"count\":" + std::to_string(dropped()) + "}}";
  }
  out += "\n]\n";
  write_raw(out);
  std::fclose(file_);
  file_ = nullptr;
  flush_requests_ = flushes_done_ = 0;
}

// ---- flight recorder ---------------------------------------------------------------------------

uint64_t Recorder::flight_begin(const OpDesc& op, FlightState state, double t) {
  if (flight_.empty()) return 0;
  std::lock_guard lk(flight_mu_);
  const uint64_t seq = flight_next_++;
  FlightSlot& s = flight_[seq % flight_.size()];
  s.seq = seq;
  s.state = state;
  s.tag = op.tag;
  s.bytes = op.bytes;
  s.peer = op.peer;
  s.ranks = op.ranks;
  s.t_begin = t;
  s.t_start = state == FlightState::kRunning ? t : 0;
  s.t_end = 0;
  copy_str(s.name, op.name);
  copy_str(s.comm, op.comm);
  s.error[0] = '\0';
  return seq;
}

void Recorder::flight_update(uint64_t seq, FlightState state, double t, std::string_view error) {
  if (seq == 0 || flight_.empty()) return;
  std::lock_guard lk(flight_mu_);
  FlightSlot& s = flight_[seq % flight_.size()];
  if (s.seq != seq) return;  // already overwritten by a newer operation
  s.state = state;
  if (state == FlightState::kRunning)
    s.t_start = t;
  else if (state == FlightState::kDone || state == FlightState::kFailed)
    s.t_end = t;
  if (!error.empty()) copy_str(s.error, error);
}

std::vector<FlightEntry> Recorder::flight_records() const {
  std::vector<FlightEntry> out;
  std::lock_guard lk(flight_mu_);
  if (flight_.empty()) return out;
  const uint64_t n = flight_.size();
  const uint64_t first = flight_next_ > n ? flight_next_ - n : 1;
  for (uint64_t seq = first; seq < flight_next_; ++seq) {
    const FlightSlot& s = flight_[seq % n];
    if (s.seq != seq) continue;
    out.push_back(FlightEntry{s.seq, s.state, s.tag, s.bytes, s.peer, s.ranks, s.t_begin, s.t_start, s.t_end,
                              s.name, s.comm, s.error});
  }
  return out;
}

void Recorder::dump_flight(std::string_view why) {
  std::vector<FlightEntry> recs;
  {
    std::lock_guard lk(flight_mu_);
    if (flight_.empty() || flight_next_ - 1 <= flight_dumped_upto_) return;
    flight_dumped_upto_ = flight_next_ - 1;
  }
  recs = flight_records();
  const double now = now_us();
  RUMOR_LOG(kWarn, "flight recorder of rank " << rank_ << " (last " << recs.size()
                                              << " operations, oldest first) after: " << why);
  for (const FlightEntry& f : recs) {
    RUMOR_LOG(kWarn, "  rank " << rank_ << " #" << f.seq << " " << f.name << " (op #" << f.tag << ", "
                               << f.comm << ") " << state_name(f.state) << " bytes=" << f.bytes
                               << (f.peer >= 0 ? " peer=" + std::to_string(f.peer) : std::string())
                               << " ranks=" << f.ranks << " age_ms=" << (now - f.t_begin) / 1000.0
                               << (f.t_end > 0 ? " took_ms=" + std::to_string((f.t_end - f.t_start) / 1000.0)
                                               : std::string())
                               << (f.error.empty() ? std::string() : " error: " + f.error));
  }
  if (!active()) return;
  Event fail;
  fail.ph = 'i';
  fail.cat = Category::kFlight;
  fail.ts = now;
  copy_str(fail.name, "failure");
  std::string a = "\"why\":\"";
  json_escape(a, why.substr(0, 48));
  a += "\"";
  copy_args(fail.args, a);
  emit(fail);
  for (const FlightEntry& f : recs) {
    Event e;
    e.ph = 'i';
    e.cat = Category::kFlight;
    e.ts = f.t_begin;
    e.tag = f.tag;
    e.bytes = f.bytes;
    e.peer = f.peer;
    e.ranks = f.ranks;
    copy_str(e.name, "flight: " + f.name);
    copy_str(e.comm, f.comm);
    std::string args = "\"seq\":" + std::to_string(f.seq) + ",\"state\":\"" + state_name(f.state) + "\"";
    if (f.t_end > 0) {
      args += ",\"took_us\":";
      append_num(args, f.t_end - f.t_start);
    }
    copy_args(e.args, args);
    emit(e);
  }
  flush();
}

Recorder::OpToken Recorder::op_begin(const OpDesc& op) {
  OpToken tok;
  tok.timed = active();
  const bool want_time = tok.timed || !flight_.empty();
  tok.t0 = want_time ? now_us() : 0;
  tok.seq = flight_begin(op, FlightState::kRunning, tok.t0);
  return tok;
}

void Recorder::op_end(const OpToken& tok, const OpDesc& op, bool ok, std::string_view error) {
  if (tok.seq == 0 && !tok.timed) return;
  const double t = now_us();
  flight_update(tok.seq, ok ? FlightState::kDone : FlightState::kFailed, t, error);
  if (!tok.timed || !active()) return;
  Event e;
  e.ph = 'X';
  e.cat = Category::kComm;
  e.ts = tok.t0;
  e.dur = t - tok.t0;
  e.tag = op.tag;
  e.bytes = op.bytes;
  e.peer = op.peer;
  e.ranks = op.ranks;
  e.algo = op.algo;
  e.transport = op.transport;
  copy_str(e.name, op.name);
  copy_str(e.comm, op.comm);
  std::string a;
  if (op.blocked_us >= 0) {
    a = "\"blocked_us\":";
    append_num(a, op.blocked_us);
  }
  if (!ok) {
    a += a.empty() ? "\"error\":\"" : ",\"error\":\"";
    json_escape(a, error.substr(0, 48));
    a += "\"";
  }
  copy_args(e.args, a);
  emit(e);
}

Span::~Span() {
  if (t0_ <= 0 || !rec_.active()) return;
  Event e;
  e.cat = cat_;
  e.ts = t0_;
  e.dur = now_us() - t0_;
  e.bytes = bytes_;
  e.ranks = ranks_;
  copy_str(e.name, name_);
  // "comm" would also print a tag; a window's name goes into the args instead.
  if (!comm_.empty()) {
    std::string a = "\"window\":\"";
    json_escape(a, comm_.substr(0, 40));
    a += "\"";
    copy_args(e.args, a);
  }
  rec_.emit(e);
}

}  // namespace rumor::trace
