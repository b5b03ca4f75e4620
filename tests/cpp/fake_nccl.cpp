// TEST DOUBLE, built only with the tests (libnccl-fake.so): a stand-in for libnccl that exports
// the C entry points rumor's loader resolves, so NcclLibrary and NcclCommunicator are tested on
// machines with no GPU and no NCCL. It is not NCCL and must never ship:
//   - "device" buffers are host memory and ranks are threads of one process; communicators of
//     one unique id meet in a process-wide registry (acceptable in a test double only);
//   - an operation runs when the last rank enqueues its part, on that rank's thread; a "stream"
//     is any pointer, and fakeNcclStreamIdle(stream) says whether everything queued on it ran
//     (the tests' stand-in for cudaEventQuery);
//   - reductions support int8/uint8/int32/uint32/int64/uint64/float32/float64/bfloat16 (not
//     float16); data movement takes every type.
// Behaviour is chosen by environment variables read when a communicator is created:
//   RUMOR_FAKE_NCCL_VERSION=<code>        what ncclGetVersion reports (default 22703, 2.27.3)
//   RUMOR_FAKE_NCCL_FAIL_INIT=sync|async  init returns an error / reports one asynchronously
//   RUMOR_FAKE_NCCL_HANG=<op>             that op (allreduce, broadcast, reduce, allgather,
//                                         reduce_scatter, send, recv) never completes
//   RUMOR_FAKE_NCCL_ASYNC_ERROR=<op>      after enqueuing that op the communicator reports
//                                         ncclRemoteError
//   RUMOR_FAKE_NCCL_SYNC=1                a call (in a group: ncclGroupEnd) returns once this
//                                         rank's parts ran: the "stream" then orders work on
//                                         host memory as a GPU stream would (host code reading
//                                         the result next sees it), so ops written for a stream
//                                         can run several ranks on CPU tensors, one a thread
// For nonblocking communicators, ncclGroupEnd and ncclCommFinalize answer ncclInProgress (as
// NCCL may), so the caller's polling path is exercised.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

namespace {

enum Result : int {
  kSuccess = 0,
  kSystemError = 2,
  kInternalError = 3,
  kInvalidArgument = 4,
  kInvalidUsage = 5,
  kRemoteError = 6,
  kInProgress = 7,
};

struct UniqueId {
  char internal[128];
};

// The v2.14 prefix of ncclConfig_t; newer callers pass a longer struct, which starts the same.
struct Config {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
};

size_t type_size(int t) {
  switch (t) {
    case 0:
    case 1:
      return 1;
    case 6:
    case 9:
      return 2;
    case 2:
    case 3:
    case 7:
      return 4;
    case 4:
    case 5:
    case 8:
      return 8;
    default:
      return 0;
  }
}

template <typename T>
void combine(T* acc, const T* in, size_t n, int op) {
  for (size_t i = 0; i < n; ++i) {
    switch (op) {
      case 0:
      case 4:
        acc[i] = static_cast<T>(acc[i] + in[i]);
        break;
      case 1:
        acc[i] = static_cast<T>(acc[i] * in[i]);
        break;
      case 2:
        acc[i] = std::max(acc[i], in[i]);
        break;
      case 3:
        acc[i] = std::min(acc[i], in[i]);
        break;
    }
  }
}

template <typename T>
void divide(T* acc, size_t n, int by) {
  for (size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] / static_cast<T>(by));
}

// bfloat16 through float, rounded to nearest even (what NCCL's bf16 reductions give per step).
float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

void combine_bf16(uint16_t* acc, const uint16_t* in, size_t n, int op) {
  for (size_t i = 0; i < n; ++i) {
    float a = from_bf16(acc[i]);
    const float b = from_bf16(in[i]);
    combine(&a, &b, 1, op);
    acc[i] = to_bf16(a);
  }
}

// acc op= in over n elements of NCCL type t; false for a type the fake does not reduce.
bool reduce_into(void* acc, const void* in, size_t n, int t, int op) {
  switch (t) {
    case 0:
      combine(static_cast<int8_t*>(acc), static_cast<const int8_t*>(in), n, op);
      return true;
    case 1:
      combine(static_cast<uint8_t*>(acc), static_cast<const uint8_t*>(in), n, op);
      return true;
    case 2:
      combine(static_cast<int32_t*>(acc), static_cast<const int32_t*>(in), n, op);
      return true;
    case 3:
      combine(static_cast<uint32_t*>(acc), static_cast<const uint32_t*>(in), n, op);
      return true;
    case 4:
      combine(static_cast<int64_t*>(acc), static_cast<const int64_t*>(in), n, op);
      return true;
    case 5:
      combine(static_cast<uint64_t*>(acc), static_cast<const uint64_t*>(in), n, op);
      return true;
    case 7:
      combine(static_cast<float*>(acc), static_cast<const float*>(in), n, op);
      return true;
    case 8:
      combine(static_cast<double*>(acc), static_cast<const double*>(in), n, op);
      return true;
    case 9:
      combine_bf16(static_cast<uint16_t*>(acc), static_cast<const uint16_t*>(in), n, op);
      return true;
    default:
      return false;
  }
}

void average(void* acc, size_t n, int t, int by) {
  switch (t) {
    case 0:
      return divide(static_cast<int8_t*>(acc), n, by);
    case 1:
      return divide(static_cast<uint8_t*>(acc), n, by);
    case 2:
      return divide(static_cast<int32_t*>(acc), n, by);
    case 3:
      return divide(static_cast<uint32_t*>(acc), n, by);
    case 4:
      return divide(static_cast<int64_t*>(acc), n, by);
    case 5:
      return divide(static_cast<uint64_t*>(acc), n, by);
    case 7:
      return divide(static_cast<float*>(acc), n, by);
    case 8:
      return divide(static_cast<double*>(acc), n, by);
    case 9:
      for (size_t i = 0; i < n; ++i) {
        auto* h = static_cast<uint16_t*>(acc) + i;
        *h = to_bf16(from_bf16(*h) / static_cast<float>(by));
      }
      return;
  }
}

enum class Kind { kAllReduce, kBroadcast, kReduce, kAllGather, kReduceScatter };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllReduce:
      return "allreduce";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kReduce:
      return "reduce";
    case Kind::kAllGather:
      return "allgather";
    case Kind::kReduceScatter:
      return "reduce_scatter";
  }
  return "?";
}

struct Comm;

// One rank's part of an operation.
struct Part {
  Comm* comm;
  const void* send;
  void* recv;
  size_t count;
  int dtype;
  int op;
  int root;
  void* stream;
  bool hang;
};

struct Group {
  int nranks;
  std::vector<Comm*> members;
  int joined = 0;
  bool broken = false;  // a member aborted: the others see ncclRemoteError
  std::map<uint64_t, std::pair<Kind, std::vector<Part>>> colls;  // by sequence number
  // Point-to-point: queues per (src, dst), matched in order.
  std::map<std::pair<int, int>, std::vector<Part>> sends, recvs;
};

struct Comm {
  std::shared_ptr<Group> group;
  std::string uid;
  int rank;
  bool blocking;
  bool sync = false;
  uint64_t coll_seq = 0;
  int async_error = kSuccess;
  bool init_failed = false;
  std::string hang_op, error_op;
  std::string last_error;
};

// Process-wide state of the double (see the header comment): one lock for everything.
std::mutex g_mu;
std::condition_variable g_cv;
std::map<std::string, std::shared_ptr<Group>> g_groups;
std::map<void*, std::pair<uint64_t, uint64_t>> g_streams;  // stream -> (queued, completed)
int g_live = 0;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

void queued(void* stream) { ++g_streams[stream].first; }
void completed(void* stream) {
  ++g_streams[stream].second;
  g_cv.notify_all();  // a rank in RUMOR_FAKE_NCCL_SYNC mode may wait for its parts
}

// Runs a collective once every rank queued its part (g_mu held); false if it stays queued.
bool run_coll(Group& g, Kind kind, std::vector<Part>& parts) {
  for (const Part& p : parts)
    if (p.hang) return false;  // never completes: the caller's deadline is what ends it
  const Part& a = parts[0];
  for (const Part& p : parts)
    if (p.count != a.count || p.dtype != a.dtype || p.op != a.op || p.root != a.root) {
      for (Comm* m : g.members)
        if (m != nullptr) {
          m->async_error = kInvalidUsage;
          m->last_error =
              std::string("fake NCCL: ranks called ") + kind_name(kind) + " with different arguments";
        }
      return false;
    }
  const size_t es = type_size(a.dtype);
  const size_t bytes = a.count * es;
  const int n = g.nranks;
  switch (kind) {
    case Kind::kAllReduce:
    case Kind::kReduce: {
      std::vector<unsigned char> acc(static_cast<const unsigned char*>(parts[0].send),
                                     static_cast<const unsigned char*>(parts[0].send) + bytes);
      for (int r = 1; r < n; ++r) reduce_into(acc.data(), parts[r].send, a.count, a.dtype, a.op);
      if (a.op == 4) average(acc.data(), a.count, a.dtype, n);
      for (int r = 0; r < n; ++r)
        if (kind == Kind::kAllReduce || r == a.root) std::memcpy(parts[r].recv, acc.data(), bytes);
      break;
    }
    case Kind::kBroadcast: {
      std::vector<unsigned char> v(static_cast<const unsigned char*>(parts[a.root].send),
                                   static_cast<const unsigned char*>(parts[a.root].send) + bytes);
      for (int r = 0; r < n; ++r) std::memcpy(parts[r].recv, v.data(), bytes);
      break;
    }
    case Kind::kAllGather: {
      std::vector<unsigned char> v(bytes * n);
      for (int r = 0; r < n; ++r) std::memcpy(v.data() + r * bytes, parts[r].send, bytes);
      for (int r = 0; r < n; ++r) std::memcpy(parts[r].recv, v.data(), v.size());
      break;
    }
    case Kind::kReduceScatter: {
      const size_t total = a.count * n;
      std::vector<unsigned char> acc(static_cast<const unsigned char*>(parts[0].send),
                                     static_cast<const unsigned char*>(parts[0].send) + total * es);
      for (int r = 1; r < n; ++r) reduce_into(acc.data(), parts[r].send, total, a.dtype, a.op);
      if (a.op == 4) average(acc.data(), total, a.dtype, n);
      for (int r = 0; r < n; ++r) std::memcpy(parts[r].recv, acc.data() + r * bytes, bytes);
      break;
    }
  }
  for (const Part& p : parts) completed(p.stream);
  return true;
}

// Matches queued sends and receives between src and dst (g_mu held).
void run_p2p(Group& g, int src, int dst) {
  auto& s = g.sends[{src, dst}];
  auto& r = g.recvs[{src, dst}];
  while (!s.empty() && !r.empty()) {
    if (s.front().hang || r.front().hang) return;
    const size_t sb = s.front().count * type_size(s.front().dtype);
    const size_t rb = r.front().count * type_size(r.front().dtype);
    if (sb != rb) {
      s.front().comm->async_error = r.front().comm->async_error = kInvalidUsage;
      s.front().comm->last_error = r.front().comm->last_error = "fake NCCL: send and recv sizes differ";
      return;
    }
    std::memcpy(r.front().recv, s.front().send, sb);
    completed(s.front().stream);
    completed(r.front().stream);
    s.erase(s.begin());
    r.erase(r.begin());
  }
}

// Drops every queued part of c (its stream counts them as done: the work is cancelled).
void cancel_parts(Group& g, Comm* c) {
  for (auto& [seq, entry] : g.colls) {
    auto& parts = entry.second;
    for (auto it = parts.begin(); it != parts.end();)
      if (it->comm == c) {
        completed(it->stream);
        it = parts.erase(it);
      } else {
        ++it;
      }
  }
  for (auto* queues : {&g.sends, &g.recvs})
    for (auto& [key, q] : *queues)
      for (auto it = q.begin(); it != q.end();)
        if (it->comm == c) {
          completed(it->stream);
          it = q.erase(it);
        } else {
          ++it;
        }
}

bool has_parts(const Group& g, const Comm* c) {
  for (const auto& [seq, entry] : g.colls)
    for (const Part& p : entry.second)
      if (p.comm == c) return true;
  for (const auto* queues : {&g.sends, &g.recvs})
    for (const auto& [key, q] : *queues)
      for (const Part& p : q)
        if (p.comm == c) return true;
  return false;
}

void leave(Comm* c) {
  Group& g = *c->group;
  cancel_parts(g, c);
  g.members[c->rank] = nullptr;
  if (std::none_of(g.members.begin(), g.members.end(), [](Comm* m) { return m != nullptr; }))
    g_groups.erase(c->uid);
  --g_live;
  delete c;
}

Result usable(Comm* c) {
  if (c == nullptr) return kInvalidArgument;
  if (c->group->joined < c->group->nranks || c->init_failed) return kInvalidUsage;
  if (c->group->broken) return kRemoteError;
  return kSuccess;
}

// Calls between ncclGroupStart and ncclGroupEnd on this thread, and whether one of them was on a
// nonblocking communicator (ncclGroupEnd then answers ncclInProgress, as NCCL may); the
// RUMOR_FAKE_NCCL_SYNC communicators called in the group, waited for at its end.
thread_local int t_group_depth = 0;
thread_local bool t_group_nonblocking = false;
thread_local std::vector<std::pair<Comm*, std::shared_ptr<Group>>> t_group_sync;

// Waits (g_mu held by lk) until c has no queued part left: they ran, or were cancelled by an
// abort. Only the group is read (c may be destroyed meanwhile by an abort on another thread).
Result wait_parts(std::unique_lock<std::mutex>& lk, const Comm* c, const std::shared_ptr<Group>& g) {
  if (g_cv.wait_for(lk, std::chrono::seconds(60), [&] { return !has_parts(*g, c); })) return kSuccess;
  return kInternalError;  // a broken test; the caller's deadline normally ends a hung op first
}

Result after_enqueue(std::unique_lock<std::mutex>& lk, Comm* c, const char* op) {
  if (c->error_op == op) {
    c->async_error = kRemoteError;
    c->last_error = std::string("fake NCCL: a remote rank went away during ") + op;
  }
  if (t_group_depth > 0) {
    t_group_nonblocking |= !c->blocking;
    if (c->sync) t_group_sync.emplace_back(c, c->group);
    return kSuccess;
  }
  if (!c->sync) return kSuccess;
  const std::shared_ptr<Group> g = c->group;  // an abort on another thread may destroy c
  return wait_parts(lk, c, g);
}

Result coll(Kind kind, const void* send, void* recv, size_t count, int dtype, int op, int root, Comm* c,
            void* stream) {
  std::unique_lock<std::mutex> lk(g_mu);
  if (Result u = usable(c); u != kSuccess) return u;
  if (type_size(dtype) == 0) return kInvalidArgument;
  const bool reduces = kind == Kind::kAllReduce || kind == Kind::kReduce || kind == Kind::kReduceScatter;
  if (reduces && (op < 0 || op > 4 || dtype == 6)) return kInvalidArgument;
  Group& g = *c->group;
  queued(stream);
  const uint64_t seq = c->coll_seq++;
  auto& entry = g.colls[seq];
  entry.first = kind;
  entry.second.push_back(Part{c, send, recv, count, dtype, op, root, stream, c->hang_op == kind_name(kind)});
  if (static_cast<int>(entry.second.size()) == g.nranks) {
    std::sort(entry.second.begin(), entry.second.end(),
              [](const Part& x, const Part& y) { return x.comm->rank < y.comm->rank; });
    if (run_coll(g, kind, entry.second)) g.colls.erase(seq);
  }
  return after_enqueue(lk, c, kind_name(kind));
}

Result p2p(bool is_send, const void* send, void* recv, size_t count, int dtype, int peer, Comm* c,
           void* stream) {
  std::unique_lock<std::mutex> lk(g_mu);
  if (Result u = usable(c); u != kSuccess) return u;
  if (type_size(dtype) == 0 || peer < 0 || peer >= c->group->nranks) return kInvalidArgument;
  Group& g = *c->group;
  const char* op = is_send ? "send" : "recv";
  queued(stream);
  const int src = is_send ? c->rank : peer, dst = is_send ? peer : c->rank;
  Part part{c, send, recv, count, dtype, 0, -1, stream, c->hang_op == op};
  (is_send ? g.sends : g.recvs)[{src, dst}].push_back(part);
  run_p2p(g, src, dst);
  return after_enqueue(lk, c, op);
}

}  // namespace

#define FAKE_API extern "C" __attribute__((visibility("default")))

FAKE_API Result ncclGetVersion(int* version) {
  const std::string v = env("RUMOR_FAKE_NCCL_VERSION");
  *version = v.empty() ? 22703 : std::atoi(v.c_str());
  return kSuccess;
}

FAKE_API Result ncclGetUniqueId(UniqueId* id) {
  std::memset(id->internal, 0, sizeof(id->internal));
  std::random_device rd;
  for (size_t i = 0; i < 16; ++i) id->internal[i] = static_cast<char>(rd());
  return kSuccess;
}

FAKE_API Result ncclCommInitRankConfig(Comm** out, int nranks, UniqueId id, int rank, Config* config) {
  if (out == nullptr || nranks < 1 || rank < 0 || rank >= nranks) return kInvalidArgument;
  *out = nullptr;
  if (config != nullptr && config->magic != 0xcafebeef) return kInvalidArgument;
  const bool blocking = config == nullptr || config->blocking != 0;
  const std::string fail = env("RUMOR_FAKE_NCCL_FAIL_INIT");
  if (fail == "sync") return kSystemError;
  std::unique_lock<std::mutex> lk(g_mu);
  const std::string uid(id.internal, sizeof(id.internal));
  auto& g = g_groups[uid];
  if (!g) {
    g = std::make_shared<Group>();
    g->nranks = nranks;
    g->members.assign(nranks, nullptr);
  }
  if (g->nranks != nranks || g->members[rank] != nullptr) return kInvalidUsage;
  auto* c = new Comm();
  c->group = g;
  c->uid = uid;
  c->rank = rank;
  c->blocking = blocking;
  c->hang_op = env("RUMOR_FAKE_NCCL_HANG");
  c->error_op = env("RUMOR_FAKE_NCCL_ASYNC_ERROR");
  c->sync = env("RUMOR_FAKE_NCCL_SYNC") == "1";
  if (fail == "async") {
    c->init_failed = true;
    c->async_error = kSystemError;
    c->last_error = "fake NCCL: init failed (RUMOR_FAKE_NCCL_FAIL_INIT=async)";
  }
  g->members[rank] = c;
  ++g->joined;
  ++g_live;
  *out = c;
  g_cv.notify_all();
  if (!blocking) return kInProgress;
  // Blocking init as NCCL does it (bounded here only so a broken test cannot hang forever).
  auto group = g;
  if (!g_cv.wait_for(lk, std::chrono::seconds(60), [&] { return group->joined == group->nranks; }))
    return kInternalError;
  return kSuccess;
}

FAKE_API Result ncclCommInitRank(Comm** out, int nranks, UniqueId id, int rank) {
  return ncclCommInitRankConfig(out, nranks, id, rank, nullptr);
}

FAKE_API Result ncclCommGetAsyncError(Comm* c, Result* state) {
  if (c == nullptr || state == nullptr) return kInvalidArgument;
  std::lock_guard<std::mutex> lk(g_mu);
  if (c->async_error != kSuccess)
    *state = static_cast<Result>(c->async_error);
  else if (c->group->broken)
    *state = kRemoteError;
  else if (c->group->joined < c->group->nranks)
    *state = kInProgress;
  else
    *state = kSuccess;
  return kSuccess;
}

FAKE_API Result ncclCommFinalize(Comm* c) {
  if (c == nullptr) return kInvalidArgument;
  std::lock_guard<std::mutex> lk(g_mu);
  // Finalize flushes outstanding work; here it only reports an unfinished op as an error.
  if (has_parts(*c->group, c)) return kInvalidUsage;
  return c->blocking ? kSuccess : kInProgress;
}

FAKE_API Result ncclCommDestroy(Comm* c) {
  if (c == nullptr) return kInvalidArgument;
  std::lock_guard<std::mutex> lk(g_mu);
  leave(c);
  return kSuccess;
}

FAKE_API Result ncclCommAbort(Comm* c) {
  if (c == nullptr) return kSuccess;
  std::lock_guard<std::mutex> lk(g_mu);
  c->group->broken = true;
  leave(c);
  return kSuccess;
}

FAKE_API const char* ncclGetErrorString(Result r) {
  switch (r) {
    case kSuccess:
      return "no error";
    case kSystemError:
      return "unhandled system error (fake)";
    case kInternalError:
      return "internal error (fake)";
    case kInvalidArgument:
      return "invalid argument (fake)";
    case kInvalidUsage:
      return "invalid usage (fake)";
    case kRemoteError:
      return "remote process exited or there was a network error (fake)";
    case kInProgress:
      return "NCCL operation in progress (fake)";
    default:
      return "unknown result code (fake)";
  }
}

FAKE_API const char* ncclGetLastError(Comm* c) {
  // The string lives in the communicator; rumor reads it before aborting.
  std::lock_guard<std::mutex> lk(g_mu);
  return c != nullptr ? c->last_error.c_str() : "";
}

FAKE_API Result ncclAllReduce(const void* s, void* r, size_t n, int t, int op, Comm* c, void* st) {
  return coll(Kind::kAllReduce, s, r, n, t, op, -1, c, st);
}
FAKE_API Result ncclBroadcast(const void* s, void* r, size_t n, int t, int root, Comm* c, void* st) {
  return coll(Kind::kBroadcast, s, r, n, t, -1, root, c, st);
}
FAKE_API Result ncclReduce(const void* s, void* r, size_t n, int t, int op, int root, Comm* c, void* st) {
  return coll(Kind::kReduce, s, r, n, t, op, root, c, st);
}
FAKE_API Result ncclAllGather(const void* s, void* r, size_t n, int t, Comm* c, void* st) {
  return coll(Kind::kAllGather, s, r, n, t, -1, -1, c, st);
}
FAKE_API Result ncclReduceScatter(const void* s, void* r, size_t n, int t, int op, Comm* c, void* st) {
  return coll(Kind::kReduceScatter, s, r, n, t, op, -1, c, st);
}
FAKE_API Result ncclSend(const void* s, size_t n, int t, int peer, Comm* c, void* st) {
  return p2p(true, s, nullptr, n, t, peer, c, st);
}
FAKE_API Result ncclRecv(void* r, size_t n, int t, int peer, Comm* c, void* st) {
  return p2p(false, nullptr, r, n, t, peer, c, st);
}
// Sends and receives are matched as they arrive, so grouping needs no other bookkeeping here.
FAKE_API Result ncclGroupStart() {
  if (t_group_depth++ == 0) {
    t_group_nonblocking = false;
    t_group_sync.clear();
  }
  return kSuccess;
}
FAKE_API Result ncclGroupEnd() {
  if (t_group_depth == 0) return kInvalidUsage;
  if (--t_group_depth > 0) return kSuccess;
  std::unique_lock<std::mutex> lk(g_mu);
  for (const auto& [c, g] : t_group_sync)
    if (Result r = wait_parts(lk, c, g); r != kSuccess) return r;
  t_group_sync.clear();
  return t_group_nonblocking ? kInProgress : kSuccess;
}

FAKE_API Result ncclCommCount(Comm* c, int* count) {
  if (c == nullptr || count == nullptr) return kInvalidArgument;
  *count = c->group->nranks;
  return kSuccess;
}

FAKE_API Result ncclCommUserRank(Comm* c, int* rank) {
  if (c == nullptr || rank == nullptr) return kInvalidArgument;
  *rank = c->rank;
  return kSuccess;
}

// Test hooks (not NCCL API).
FAKE_API int fakeNcclStreamIdle(void* stream) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_streams.find(stream);
  return it == g_streams.end() || it->second.first == it->second.second ? 1 : 0;
}

FAKE_API int fakeNcclLiveComms() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_live;
}
