#include "comm/context.h"

#include <sched.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <exception>
#include <sstream>
#include <thread>

#include "core/log.h"
#include "net/dial.h"
#include "net/link.h"
#include "net/tcp_channel.h"

namespace rumor {

namespace {
std::string hex(const net::Token& t, size_t n) {
  std::string s;
  char b[3];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(b, sizeof(b), "%02x", t[i]);
    s += b;
  }
  return s;
}

// "<pid namespace>.<pid>.<64 random bits>": the first two let a sweep tell whether the owner is
// alive (python/rumor/_shm.py); the random part makes every shared-memory name of this process
// unpredictable, so another local user cannot create a name before its owner does (which would
// fail the job's init). Random once per process (every Context of a process shares it: tests run
// many ranks in one process), an immutable value after that.
std::string process_tag() {
  static const std::string random_part = [] {
    uint64_t r = 0;
    for (size_t got = 0; got < sizeof(r);) {
      ssize_t n = ::getrandom(reinterpret_cast<char*>(&r) + got, sizeof(r) - got, 0);
      if (n < 0 && errno != EINTR)
        throw Error(ErrorKind::kSystem, "getrandom for shared-memory names: " + net::errno_string(errno));
      if (n > 0) got += static_cast<size_t>(n);
    }
    char b[17];
    std::snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(r));
    return std::string(b);
  }();
  struct stat st{};
  unsigned long long ns =
      ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<unsigned long long>(st.st_ino) : 0;
  return std::to_string(ns) + "." + std::to_string(::getpid()) + "." + random_part;
}
}  // namespace

Context::Context(uint32_t rank, uint32_t size, const net::Token& token, Options options, int port,
                 std::optional<net::Key> key, const std::string& bind)
    : rank_(rank),
      size_(size),
      token_(token),
      key_(key ? *key : net::unauthenticated_key(token)),
      options_(options),
      timeout_s_(options.timeout_s),
      recorder_(rank, options.flight_records) {
  if (size == 0 || rank >= size)
    throw Error(ErrorKind::kInvalidArgument,
                "rank " + std::to_string(rank) + " is not in a world of size " + std::to_string(size));
  if (options_.streams < 1 || options_.streams > static_cast<int>(net::kMaxStreams))
    throw Error(ErrorKind::kInvalidArgument, "socket streams must be in [1, " +
                                                 std::to_string(net::kMaxStreams) + "], got " +
                                                 std::to_string(options_.streams));
  if (options_.timeout_s <= 0) throw Error(ErrorKind::kInvalidArgument, "timeout must be positive");
  if (options_.tls()) {
    std::string missing;
    for (auto [pem, name] : {std::pair{&options_.tls_cert_pem, "certificate (RUMOR_TLS_CERT)"},
                             std::pair{&options_.tls_key_pem, "private key (RUMOR_TLS_KEY)"},
                             std::pair{&options_.tls_ca_pem, "CA certificate (RUMOR_TLS_CA)"}})
      if (pem->empty()) missing += std::string(missing.empty() ? "" : ", ") + name;
    if (!missing.empty())
      throw Error(ErrorKind::kInvalidArgument,
                  "TLS needs this rank's certificate, its private key and the CA "
                  "certificate; missing: " +
                      missing);
    net::TlsConfig cfg;
    cfg.cert_pem = options_.tls_cert_pem;
    cfg.key_pem = options_.tls_key_pem;
    cfg.ca_pem = options_.tls_ca_pem;
    cfg.expected_peer_name = options_.tls_peer_name;
    tls_ = std::make_shared<const net::TlsContext>(cfg);
  }
  listener_ = std::make_unique<net::Listener>(key_, rank_, size_, port, bind);
  own_tag_ = process_tag();
  owner_tags_.assign(size_, own_tag_);
  if (options_.shm) {
    own_bell_seg_ = net::ShmSegment::create(
        owned_name(shm_prefix() + "-db-" + std::to_string(rank_), {rank_}), sizeof(net::Doorbell));
    own_bell_ = new (own_bell_seg_.data()) net::Doorbell{};  // lives in the segment
    own_bell_->pid = static_cast<int32_t>(::getpid());
    own_bell_->magic = net::kDoorbellMagic;
  }
}

void Context::set_timeout(double seconds) {
  if (!(seconds > 0))
    throw Error(ErrorKind::kInvalidArgument, "timeout must be positive, got " + std::to_string(seconds));
  timeout_s_.store(seconds, std::memory_order_relaxed);
}

Context::~Context() = default;

std::string Context::shm_prefix() const { return "/rumor-" + hex(token_, 8); }

std::string Context::owned_name(const std::string& base, std::initializer_list<uint32_t> owners) const {
  std::string name = base + "@";
  bool first = true;
  for (uint32_t r : owners) {
    if (!first) name += "+";
    name += owner_tags_.at(r);
    first = false;
  }
  return name;
}

void Context::set_sites(std::vector<std::string> site_ids) {
  if (!site_ids.empty() && site_ids.size() != size_)
    throw Error(ErrorKind::kInvalidArgument, "set_sites: expected " + std::to_string(size_) +
                                                 " site ids, got " + std::to_string(site_ids.size()));
  for (size_t r = 0; r < site_ids.size(); ++r)
    if (site_ids[r].empty())
      throw Error(ErrorKind::kInvalidArgument, "set_sites: rank " + std::to_string(r) + " has no site");
  site_ids_ = std::move(site_ids);
}

void Context::set_peers(std::vector<std::string> addresses, std::vector<std::string> host_ids,
                        std::vector<std::string> owner_tags) {
  if (addresses.size() != size_ || host_ids.size() != size_ ||
      (!owner_tags.empty() && owner_tags.size() != size_))
    throw Error(ErrorKind::kInvalidArgument,
                "set_peers: expected " + std::to_string(size_) + " addresses, host ids and owner tags, got " +
                    std::to_string(addresses.size()) + ", " + std::to_string(host_ids.size()) + " and " +
                    std::to_string(owner_tags.size()));
  if (!owner_tags.empty()) {
    if (owner_tags[rank_] != own_tag_)
      throw Error(ErrorKind::kInvalidArgument,
                  "set_peers: owner tag of this rank is " + owner_tags[rank_] + ", expected " + own_tag_);
    owner_tags_ = std::move(owner_tags);
  }
  addresses_ = std::move(addresses);
  host_ids_ = std::move(host_ids);
  if (options_.spin_us < 0 || options_.host_direct_min_bytes < 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    int cpus = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    uint32_t local = 0;
    for (uint32_t r = 0; r < size_; ++r) local += same_host(r, rank_) ? 1 : 0;
    const bool shared_cores = static_cast<int>(local) > cpus;
    if (options_.spin_us < 0) options_.spin_us = shared_cores ? 0 : Options::kDefaultSpinUs;
    if (options_.host_direct_min_bytes < 0)
      options_.host_direct_min_bytes = shared_cores ? Options::kSharedCoresDirectMinBytes : 0;
  }
  if (options_.shm) {
    Deadline deadline = Deadline::after(options_.timeout_s);
    for (uint32_t r = 0; r < size_; ++r)
      if (r != rank_ && same_host(r, rank_)) peer_doorbell(r, deadline);
  }
}

void Context::seal() { own_bell_seg_.unlink_name(); }

void Context::abort(const std::string& why) {
  std::lock_guard lk(abort_mu_);
  if (!aborted_.load(std::memory_order_relaxed)) abort_why_ = why;
  aborted_.store(true, std::memory_order_release);
}

net::Doorbell* Context::peer_doorbell(uint32_t peer, const Deadline& deadline) {
  std::lock_guard lk(bells_mu_);
  auto it = peer_bells_.find(peer);
  if (it == peer_bells_.end()) {
    const std::string what = "doorbell of rank " + std::to_string(peer);
    auto seg = net::ShmSegment::open(owned_name(shm_prefix() + "-db-" + std::to_string(peer), {peer}),
                                     sizeof(net::Doorbell), deadline, what, [&] {
                                       if (!aborted_.load(std::memory_order_acquire)) return;
                                       std::lock_guard alk(abort_mu_);
                                       throw Error(ErrorKind::kAborted, "set_peers: waiting for the " + what +
                                                                            " was aborted: " + abort_why_);
                                     });
    it = peer_bells_.emplace(peer, std::move(seg)).first;
  }
  return static_cast<net::Doorbell*>(it->second.data());
}

std::unique_ptr<net::Channel> Context::connect(uint64_t comm_id, uint32_t peer, const Deadline& deadline) {
  if (addresses_.empty())
    throw Error(ErrorKind::kInvalidArgument, "context has no peers yet (set_peers not called)");
  std::string desc = "rank " + std::to_string(peer);
  if (options_.shm && same_host(rank_, peer)) {
    uint32_t lo = std::min(rank_, peer), hi = std::max(rank_, peer);
    // Both owners in the name: a creator that exits first leaves it for its peer (see
    // ShmChannel), so a sweep must wait until both are gone.
    std::string name = owned_name(
        shm_prefix() + "-c" + std::to_string(comm_id) + "-" + std::to_string(lo) + "-" + std::to_string(hi),
        {lo, hi});
    RUMOR_LOG(kDebug, "comm " << comm_id << ": shared memory to " << desc);
    // The higher rank creates and the lower one waits, as for TCP (the higher rank dials): all
    // setup waits point from lower to higher ranks, so mixed TCP/shm rings cannot wait in a cycle.
    return std::make_unique<net::ShmChannel>(name, rank_ == hi, options_.shm_ring_bytes, own_bell_,
                                             peer_doorbell(peer, deadline), desc, deadline);
  }
  std::vector<net::Fd> streams = sized_tcp_streams(comm_id, peer, deadline);
  std::vector<std::unique_ptr<net::TlsSession>> sessions;
  if (tls_) {
    // Two proofs, both required: the HMAC handshake (net::dial / the listener) proved the job
    // secret before any TLS byte; TLS proves the peer's certificate against the job's CA and
    // encrypts and authenticates every byte after it. The channel runs the TLS handshakes inside
    // its progress (see TcpChannel for why not here); the stream count sized_tcp_streams sent is
    // the only payload byte outside TLS, behind the HMAC.
    for (size_t s = 0; s < streams.size(); ++s)
      sessions.push_back(tls_session(peer, "stream " + std::to_string(s)));
  }
  std::shared_ptr<net::PathMemory> path;
  {
    std::lock_guard lk(paths_mu_);
    auto& p = paths_[peer];
    if (!p) p = std::make_shared<net::PathMemory>();
    path = p;
  }
  return std::make_unique<net::TcpChannel>(
      std::move(streams), desc, options_.stripe_min, std::move(sessions), options_.stripe_steal,
      options_.stripe_adapt ? static_cast<size_t>(std::max(1, options_.streams)) : 0, std::move(path));
}

std::unique_ptr<net::TlsSession> Context::tls_session(uint32_t peer, const std::string& stream) const {
  if (!tls_) return nullptr;
  return std::make_unique<net::TlsSession>(
      tls_, rank_ > peer ? net::TlsRole::kClient : net::TlsRole::kServer,
      "rank " + std::to_string(peer) + " at " + addresses_.at(peer) + " " + stream);
}

// The dialer measures the pair's round trip on the first stream (the kernel's sample of the
// authentication handshake's exchanges), decides how many streams the pair needs and says so on
// that stream before dialing the rest: the two ends could measure different round trips.
std::vector<net::Fd> Context::sized_tcp_streams(uint64_t comm_id, uint32_t peer, const Deadline& deadline) {
  const std::string desc = "rank " + std::to_string(peer);
  std::vector<net::Fd> streams = tcp_streams(comm_id, peer, 1, deadline);
  const int fd0 = streams[0].get();
  const double rtt = net::measured_rtt_s(fd0);
  const bool long_link = rtt > net::kLongLinkRtt;
  const net::WindowLimits limits = long_link ? net::window_limits() : net::WindowLimits{};
  uint32_t count = static_cast<uint32_t>(options_.streams);
  const std::string what = "connection setup with " + desc + ": the stream count";
  if (rank_ > peer) {
    if (long_link)
      count =
          static_cast<uint32_t>(net::streams_for_link(rtt, options_.link_rate, limits.per_stream(),
                                                      options_.streams, static_cast<int>(net::kMaxStreams)));
    net::write_all(fd0, &count, sizeof(count), deadline, what);
  } else {
    net::read_all(fd0, &count, sizeof(count), deadline, what);
    if (count < 1 || count > net::kMaxStreams)
      throw Error(ErrorKind::kProtocol, what + " is " + std::to_string(count) + ", expected 1.." +
                                            std::to_string(net::kMaxStreams));
  }
  auto more = tcp_streams(comm_id, peer, static_cast<int>(count), deadline, 1);
  for (auto& fd : more) streams.push_back(std::move(fd));
  if (long_link) {
    for (auto& fd : streams) net::set_long_link_buffers(fd.get(), limits);
    const double carry = static_cast<double>(count) * static_cast<double>(limits.per_stream()) / rtt;
    const bool capped = carry < options_.link_rate;
    std::ostringstream msg;
    msg << "comm " << comm_id << ": " << desc << " is " << rtt * 1e3 << " ms away: " << count
        << " TCP streams, " << (limits.per_stream() >> 10) << " KiB in flight each";
    if (capped) {
      msg << " (bounded by " << (limits.send <= limits.recv ? limits.send_limit : limits.recv_limit)
          << "): they carry at most " << carry * 8e-9 << " Gbit/s of the " << options_.link_rate * 8e-9
          << " asked for (RUMOR_LINK_GBIT)";
      RUMOR_LOG(kInfo, msg.str());
    } else {
      msg << ": up to " << carry * 8e-9 << " Gbit/s";
      RUMOR_LOG(kDebug, msg.str());
    }
  } else {
    RUMOR_LOG(kDebug, "comm " << comm_id << ": " << count << " TCP streams to " << desc);
  }
  return streams;
}

std::vector<net::Fd> Context::tcp_streams(uint64_t comm_id, uint32_t peer, int count,
                                          const Deadline& deadline, int first) {
  if (addresses_.empty())
    throw Error(ErrorKind::kInvalidArgument, "context has no peers yet (set_peers not called)");
  std::string desc = "rank " + std::to_string(peer);
  std::vector<net::Fd> streams;
  if (count <= first) return streams;
  // The higher rank dials, the lower one accepts: each pair agrees without negotiation.
  if (rank_ <= peer) {
    // The listener's thread runs the handshakes as they come, in any order; take() waits for each.
    for (int s = first; s < count; ++s)
      streams.push_back(listener_->take(comm_id, peer, static_cast<uint32_t>(s), deadline));
    return streams;
  }
  const std::string what = "connecting to " + desc + " at " + addresses_[peer];
  const net::HostPort to = net::HostPort::parse(addresses_[peer]);
  auto dial = [&](int s) {
    net::DialRequest req{rank_, comm_id, static_cast<uint32_t>(s), peer};
    return net::dial(to, key_, req, deadline, what);
  };
  if (count - first == 1) {
    streams.push_back(dial(first));
    return streams;
  }
  // Each stream costs three round trips (TCP's, then the hello and the proof of the handshake):
  // one after the other, a long link's 8 streams at 100 ms took 2.4 s per peer, which every new
  // communicator paid before its first byte (DiLoCo's first average, a new group's first op).
  // All at once they take the three round trips of one.
  const size_t n = static_cast<size_t>(count - first);
  streams.resize(n);
  std::vector<std::exception_ptr> errors(n);
  {
    std::vector<std::jthread> dialers;
    dialers.reserve(n);
    for (size_t i = 0; i < n; ++i)
      dialers.emplace_back([&, i] {
        try {
          streams[i] = dial(first + static_cast<int>(i));
        } catch (...) {
          errors[i] = std::current_exception();
        }
      });
  }  // joined here: every dial ended, by success, error or the deadline
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return streams;
}

}  // namespace rumor
