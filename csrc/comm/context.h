// The per-process root object: identity in the world, the job token, the listener, the
// doorbell, the peers' addresses, and the options every communicator reads. There is no other
// process-wide state; the Python module owns exactly one Context between init() and shutdown().
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/types.h"
#include "net/auth.h"
#include "net/channel.h"
#include "net/handshake.h"
#include "net/link.h"
#include "net/listener.h"
#include "net/shm.h"
#include "net/tls.h"
#include "trace/recorder.h"

namespace rumor {

struct Options {
  // The longest any wait may go with no byte moving (RUMOR_TIMEOUT); with adaptive_deadline off,
  // the longest a whole operation may take, as before issue 46.
  double timeout_s = 300.0;
  // Progress deadlines over TCP (net/stall.h; RUMOR_ADAPTIVE_DEADLINE=0 turns them off): a peer
  // that stops in the middle of a message is reported after stall_limit_s(), never sooner than
  // deadline_floor_s (RUMOR_DEADLINE_FLOOR), and an operation lasts as long as bytes keep moving.
  bool adaptive_deadline = true;
  double deadline_floor_s = 10.0;
  int streams = 2;  // TCP streams per peer pair, at least (RUMOR_SOCKET_STREAMS)
  // The rate (bytes/s) a long link's streams should be able to carry (RUMOR_LINK_GBIT): a pair
  // whose round trip is long gets enough streams for this rate times its round trip (net/link.h).
  double link_rate = 312.5e6;
  // Messages at least this big are striped over all streams (RUMOR_STRIPE_MIN_BYTES). Striping
  // the 0.25-4 MiB messages of the compressed allreduce's all-to-all over 2 streams made it 1.4-2x
  // slower through a 100 Mbit link (a message waits for its slowest stripe), and gained nothing
  // at 1 Gbit: only messages big enough to keep several streams busy are split.
  size_t stripe_min = 4 * 1024 * 1024;
  // Striped messages are cut into pieces the free streams take in turn (net/tcp_channel.h);
  // false: one fixed stripe per stream (RUMOR_STRIPE_STEAL=0).
  bool stripe_steal = true;
  // A long link's pair with more streams than `streams` adapts how many of them a striped message
  // uses (net/tcp_channel.h; RUMOR_STRIPE_ADAPT=0: all of them, always).
  bool stripe_adapt = true;
  bool shm = true;  // shared memory between ranks of one host (RUMOR_SHM)
  size_t shm_ring_bytes = 1 << 20;
  size_t small_allreduce_bytes = 64 * 1024;   // below: recursive doubling, above: ring
  size_t large_broadcast_bytes = 512 * 1024;  // at or above: scatter + ring allgather
  // One host: allreduce by reading and writing the peers' buffers in place (process_vm_readv;
  // RUMOR_HOST_DIRECT=0 turns it off). Where the kernel refuses, the ring is used.
  bool host_direct = true;
  // Bytes from which an op of a group all on this host takes the direct path (with host_direct).
  // -1, the default: past small_allreduce_bytes, or 8 MiB where this host has more ranks than
  // this process may run on. There a rank descheduled while it holds a chunk stalls every
  // other's copy-out, and the rings' one-step pipeline hides it better up to several MiB (4 ranks
  // on 2 cores, fraction of the memory bound, ring / direct: allreduce 1 MiB 0.49-0.53 / 0.32-0.34,
  // 4 MiB 0.42-0.46 / 0.34; reduce_scatter 1 MiB 0.34 / 0.26; from 16 MiB on, direct is as
  // fast or faster). Resolved in set_peers.
  int64_t host_direct_min_bytes = -1;
  // The direct path asks the kernel to back a buffer it sees again with 2 MiB pages
  // (core/huge_pages.h; RUMOR_HUGE_PAGES=0: never).
  bool huge_pages = true;
  // Two ranks take the direct path from here, and only with huge_pages (Communicator::use_direct).
  static constexpr int64_t kTwoRankDirectMinBytes = 16 << 20;
  // Two ranks, allreduce from here up to kTwoRankDirectMinBytes: rank 0 times the rings and the
  // direct path and every rank takes the one rank 0 names (PathChoice, comm/direct.h).
  static constexpr int64_t kTwoRankChoiceMinBytes = 1 << 20;
  // What rank 0 names there (RUMOR_TWO_RANK_PATH): -1 the faster of the two by its recent times,
  // 0 the rings, 1 the direct path. The other ranks' setting is not read: they follow rank 0.
  int two_rank_path = -1;
  static constexpr int64_t kSharedCoresDirectMinBytes = 8 << 20;
  // Sites of equal size: the 2-D allreduce overlaps its three phases piece by piece, the slow
  // cross-site ring on a thread of its own (RUMOR_SITE_OVERLAP=0 runs them one after the other).
  bool site_overlap = true;
  // Busy-poll this long before sleeping (latency vs. CPU). -1, the default: 20, or 0 where this
  // host has more ranks than this process may run on; there a spinning rank holds the core a
  // descheduled peer needs to arrive, and the op waits for the scheduler's time slice (4 ranks on
  // 2 cores: 4 KiB allreduce 132-200 us spinning, 63 us sleeping at once). Resolved in set_peers.
  int spin_us = -1;
  static constexpr int kDefaultSpinUs = 20;
  size_t flight_records = 64;  // operations the flight recorder keeps (RUMOR_FLIGHT_RECORDER)
  // TLS 1.3 on the TCP data channels between ranks (net/tls.h; RUMOR_TLS_CERT, RUMOR_TLS_KEY,
  // RUMOR_TLS_CA name the PEM files, RUMOR_TLS_PEER_NAME the name every peer's certificate must
  // carry). All three PEMs empty: TLS off. Shared memory within a host is not affected.
  std::string tls_cert_pem;
  std::string tls_key_pem;
  std::string tls_ca_pem;
  std::string tls_peer_name;
  bool tls() const { return !tls_ca_pem.empty() || !tls_cert_pem.empty() || !tls_key_pem.empty(); }
};

class Context {
 public:
  // token: the job's public session id (names shared memory). key: what every TCP connection
  // proves (net/handshake.h); nullopt derives it from the token (net::unauthenticated_key), which
  // keeps out mistakes, not attackers. bind: the address the listener binds ("" = every interface).
  Context(uint32_t rank, uint32_t size, const net::Token& token, Options options, int port,
          std::optional<net::Key> key = std::nullopt, const std::string& bind = "");
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  uint32_t rank() const { return rank_; }
  uint32_t size() const { return size_; }
  const Options& options() const { return options_; }
  // Every blocking wait's limit, read when the wait starts. It may change while the job runs
  // (rumor.set_timeout, a notebook cell's own deadline): options().timeout_s is only the
  // starting value.
  double timeout_s() const { return timeout_s_.load(std::memory_order_relaxed); }
  void set_timeout(double seconds);
  int port() const { return listener_->port(); }
  uint64_t rejected_connections() const { return listener_->rejected(); }
  size_t pending_connections() const { return listener_->pending(); }
  const net::Listener& listener() const { return *listener_; }

  // Called once after rendezvous: every rank's "host:port" and host identity. Maps the
  // doorbells of the ranks on this host, which must all have their Context by now.
  // owner_tags[r] is rank r's shm_tag() (empty: every rank is this process, as in tests).
  void set_peers(std::vector<std::string> addresses, std::vector<std::string> host_ids,
                 std::vector<std::string> owner_tags = {});
  // Removes this rank's doorbell name once every local peer has mapped it (the caller runs a
  // barrier after set_peers first), so that a crash later cannot leak it in /dev/shm.
  void seal();
  // Ends a set_peers still waiting for a local peer's doorbell (kAborted, with why): live
  // membership calls it when a member of the world being formed is gone. A member that gave up on
  // that world first has removed its doorbell already, so the wait could only end at the deadline.
  // Sticky: a set_peers that starts later fails at once.
  void abort(const std::string& why);
  const std::vector<std::string>& host_ids() const { return host_ids_; }
  bool same_host(uint32_t a, uint32_t b) const { return host_ids_.at(a) == host_ids_.at(b); }
  // Sites (RUMOR_SITE): groups of hosts joined by fast links and set apart by slow ones, e.g. two
  // datacenters. Where given, hierarchical collectives group ranks by site rather than by host,
  // so a slow link carries each byte once per site. Empty (the default): no sites.
  void set_sites(std::vector<std::string> site_ids);
  bool has_sites() const { return !site_ids_.empty(); }
  const std::vector<std::string>& site_ids() const { return site_ids_; }
  // What hierarchical collectives group rank r by: its site where sites are set, else its host.
  const std::string& group_key(uint32_t r) const {
    return site_ids_.empty() ? host_ids_.at(r) : site_ids_.at(r);
  }

  // Builds the channel of communicator `comm_id` to world rank `peer`, blocking until the
  // peer's side exists or the deadline passes.
  std::unique_ptr<net::Channel> connect(uint64_t comm_id, uint32_t peer, const Deadline& deadline);
  // Raw TCP streams first..count-1 to `peer` tagged with comm_id (the higher rank dials, the lower
  // accepts through the listener), blocking sockets after the handshake. connect() builds its
  // TcpChannel from these; the window hub (comm/window.h) uses one as its link.
  std::vector<net::Fd> tcp_streams(uint64_t comm_id, uint32_t peer, int count, const Deadline& deadline,
                                   int first = 0);
  // A TLS session for a stream to world rank `peer` (the dialer, the higher rank, is the client),
  // not yet shaken hands; null when TLS is off. `stream` names the stream in errors, after the
  // peer's rank and address. Every TCP stream between ranks runs one: channels and window links.
  std::unique_ptr<net::TlsSession> tls_session(uint32_t peer, const std::string& stream) const;
  net::Doorbell* doorbell() const { return own_bell_; }
  // Prefix of every shared-memory name of this job ("/rumor-<token bits>").
  std::string shm_prefix() const;
  // "<pid namespace inode>.<pid>" of this process: shared-memory names end with their owners'
  // tags, so a sweep (python/rumor/_shm.py) can remove the names of processes that died
  // before they could unlink them (a SIGKILL in init, say) and never those of a live one.
  const std::string& shm_tag() const { return own_tag_; }
  // `base` + "@" + the tags of `owners` (world ranks) joined by "+".
  std::string owned_name(const std::string& base, std::initializer_list<uint32_t> owners) const;
  // Timeline and flight recorder of this process (trace/recorder.h).
  trace::Recorder& recorder() { return recorder_; }

 private:
  // connect()'s streams: as many as the pair's measured round trip needs (net/link.h).
  std::vector<net::Fd> sized_tcp_streams(uint64_t comm_id, uint32_t peer, const Deadline& deadline);
  net::Doorbell* peer_doorbell(uint32_t peer, const Deadline& deadline);

  uint32_t rank_;
  uint32_t size_;
  net::Token token_;
  net::Key key_;
  Options options_;
  std::atomic<double> timeout_s_;
  std::unique_ptr<net::Listener> listener_;
  std::vector<std::string> addresses_;
  std::vector<std::string> host_ids_;
  std::vector<std::string> site_ids_;
  std::string own_tag_;
  std::vector<std::string> owner_tags_;
  net::ShmSegment own_bell_seg_;
  net::Doorbell* own_bell_ = nullptr;
  std::mutex bells_mu_;
  std::map<uint32_t, net::ShmSegment> peer_bells_;
  // Per peer, what its TCP channels (of every communicator) learned of the path (net/link.h).
  std::mutex paths_mu_;
  std::map<uint32_t, std::shared_ptr<net::PathMemory>> paths_;
  std::atomic<bool> aborted_{false};
  std::mutex abort_mu_;
  std::string abort_why_;  // under abort_mu_
  trace::Recorder recorder_;
  // Built once from options_ when TLS is on; every channel's sessions share it.
  std::shared_ptr<const net::TlsContext> tls_;
};

}  // namespace rumor
