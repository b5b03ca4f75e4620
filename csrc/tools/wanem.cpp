// rumor-wanem: delay, jitter and loss between the emulated hosts of rumor.testing.netns.
//
// The kernels we run on have no netem, so the element lives in user space: each host namespace
// gets a TUN device (created here by entering the namespace with setns, the fd kept by this
// process, which itself stays in the namespace it was started in), the host routes its peers'
// addresses through it, and this process holds each packet until its departure time before
// writing it into the destination host's TUN, or drops it. A host's own rate stays with tc (a tbf
// on the TUN's egress inside the host), so a link can have both. Links whose rates differ per
// pair (two sites: fast inside, slow between) are --rate-bps: each pair is a wire of its own
// that sends one packet after the other at its rate, behind a queue of its own.
//
// Usage (rumor.testing.netns builds this command line):
//   rumor-wanem --host /run/netns/A=10.213.0.1 --host /run/netns/B=10.213.0.2 ...
//               --delay-us D00,D01,...   one-way delay per (src,dst), row-major, N*N values
//               [--jitter-us J00,...] [--loss P00,...] [--jitter-dist uniform|normal] [--reorder]
//               [--rate-bps R00,...]     per-pair link rate in bits/s (0: none), with a drop-tail
//               [--rate-queue-bytes Q00,...]  queue per pair (default: its bandwidth-delay product,
//                                        256 KiB at least)
//               [--wire-of W00,...]      per pair: the wire it goes over (default: its own); pairs
//                                        given one wire share its rate and queue, e.g. a host's
//                                        one uplink to every host of another site
//               [--ifname wan0] [--seed S] [--max-queue-bytes B] [--parent-pid PID] [--no-realtime]
//               [--spin-us US]
// Prints "ready" on stdout once every TUN exists; on SIGUSR1 prints one JSON line of counters;
// exits cleanly on SIGTERM/SIGINT/SIGHUP and when its parent process dies.
#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <queue>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "net/socket.h"

namespace {

using rumor::net::Fd;

constexpr size_t kPacketBuffer = 65536;  // a TUN never hands over more than its MTU (< 64 KiB)
constexpr int kWakeMs = 1000;            // epoll deadline: the parent check runs at least this often
constexpr int kBatch = 16;               // packets read from one TUN before due ones are released

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "rumor-wanem: %s\n", msg.c_str());
  std::exit(2);
}

std::string errno_text(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
}

int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

struct Options {
  std::vector<std::string> netns;  // namespace files, one per host
  std::vector<uint32_t> ips;       // host addresses, network byte order
  std::vector<int64_t> delay_ns, jitter_ns;
  std::vector<double> loss;
  std::vector<double> rate_bps;     // per pair; 0: no wire of its own
  std::vector<int64_t> rate_queue;  // per pair: bytes its wire may hold waiting
  std::vector<int64_t> wire_of;     // per pair: its wire (pairs may share one)
  bool normal = false;
  bool reorder = false;
  std::string ifname = "wan0";
  uint64_t seed = 1;
  size_t max_queue_bytes = size_t{512} << 20;
  long parent_pid = 0;
  bool realtime = true;
  int64_t spin_ns = 0;
};

template <class T, class Parse>
std::vector<T> parse_list(std::string_view flag, std::string_view text, Parse parse) {
  std::vector<T> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string item(text.substr(pos, end - pos));
    try {
      size_t used = 0;
      out.push_back(parse(item, &used));
      if (used != item.size()) throw std::invalid_argument("trailing characters");
    } catch (const std::exception&) {
      die(std::string(flag) + ": '" + item + "' is not a number");
    }
    pos = end + 1;
  }
  return out;
}

Options parse_args(int argc, char** argv) {
  Options o;
  std::vector<int64_t> delay_us, jitter_us;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) die(std::string(a) + " needs a value");
      return argv[++i];
    };
    auto to_i64 = [](const std::string& s, size_t* used) { return int64_t{std::stoll(s, used)}; };
    auto to_f64 = [](const std::string& s, size_t* used) { return std::stod(s, used); };
    if (a == "--host") {
      std::string_view v = value();
      size_t eq = v.rfind('=');
      if (eq == std::string_view::npos) die("--host wants NETNS_FILE=IPV4, got '" + std::string(v) + "'");
      in_addr addr{};
      std::string ip(v.substr(eq + 1));
      if (inet_pton(AF_INET, ip.c_str(), &addr) != 1) die("--host: '" + ip + "' is not an IPv4 address");
      o.netns.emplace_back(v.substr(0, eq));
      o.ips.push_back(addr.s_addr);
    } else if (a == "--delay-us") {
      delay_us = parse_list<int64_t>(a, value(), to_i64);
    } else if (a == "--jitter-us") {
      jitter_us = parse_list<int64_t>(a, value(), to_i64);
    } else if (a == "--rate-bps") {
      o.rate_bps = parse_list<double>(a, value(), to_f64);
    } else if (a == "--wire-of") {
      o.wire_of = parse_list<int64_t>(a, value(), to_i64);
    } else if (a == "--rate-queue-bytes") {
      o.rate_queue = parse_list<int64_t>(a, value(), to_i64);
    } else if (a == "--loss") {
      o.loss = parse_list<double>(a, value(), to_f64);
    } else if (a == "--jitter-dist") {
      std::string_view v = value();
      if (v != "uniform" && v != "normal")
        die("--jitter-dist is uniform or normal, got '" + std::string(v) + "'");
      o.normal = v == "normal";
    } else if (a == "--reorder") {
      o.reorder = true;
    } else if (a == "--spin-us") {
      o.spin_ns = parse_list<int64_t>(a, value(), to_i64).at(0) * 1000;
      if (o.spin_ns < 0 || o.spin_ns > 1000000) die("--spin-us must be in 0..1000000");
    } else if (a == "--no-realtime") {
      o.realtime = false;
    } else if (a == "--ifname") {
      o.ifname = value();
      if (o.ifname.empty() || o.ifname.size() >= IFNAMSIZ)
        die("--ifname: bad interface name '" + o.ifname + "'");
    } else if (a == "--seed") {
      o.seed = static_cast<uint64_t>(parse_list<int64_t>(a, value(), to_i64).at(0));
    } else if (a == "--max-queue-bytes") {
      o.max_queue_bytes = static_cast<size_t>(parse_list<int64_t>(a, value(), to_i64).at(0));
    } else if (a == "--parent-pid") {
      o.parent_pid = static_cast<long>(parse_list<int64_t>(a, value(), to_i64).at(0));
    } else {
      die("unknown argument '" + std::string(a) + "' (see the comment at the top of csrc/tools/wanem.cpp)");
    }
  }
  const size_t n = o.netns.size();
  if (n < 2) die("need at least two --host NETNS_FILE=IPV4");
  const size_t nn = n * n;
  if (delay_us.empty()) delay_us.assign(nn, 0);
  if (jitter_us.empty()) jitter_us.assign(nn, 0);
  if (o.loss.empty()) o.loss.assign(nn, 0.0);
  if (o.rate_bps.empty()) o.rate_bps.assign(nn, 0.0);
  auto check_size = [&](const char* flag, size_t got) {
    if (got != nn)
      die(std::string(flag) + ": expected " + std::to_string(nn) + " values (" + std::to_string(n) +
          " hosts squared), got " + std::to_string(got));
  };
  check_size("--delay-us", delay_us.size());
  check_size("--jitter-us", jitter_us.size());
  check_size("--loss", o.loss.size());
  check_size("--rate-bps", o.rate_bps.size());
  if (!o.rate_queue.empty()) check_size("--rate-queue-bytes", o.rate_queue.size());
  if (o.wire_of.empty())
    for (size_t k = 0; k < nn; ++k) o.wire_of.push_back(static_cast<int64_t>(k));
  check_size("--wire-of", o.wire_of.size());
  for (size_t k = 0; k < nn; ++k) {
    if (delay_us[k] < 0 || jitter_us[k] < 0) die("delays and jitters must be >= 0");
    if (!(o.loss[k] >= 0.0 && o.loss[k] <= 1.0)) die("--loss values must be in [0, 1]");
    if (!(o.rate_bps[k] >= 0.0)) die("--rate-bps values must be >= 0");
    o.delay_ns.push_back(delay_us[k] * 1000);
    o.jitter_ns.push_back(jitter_us[k] * 1000);
  }
  if (o.rate_queue.empty()) {
    // A router's buffer of one bandwidth-delay product (the round trip of the pair), and at least
    // four of the largest packets (the TUN's MTU may be 64 KiB: one packet must not fill it).
    for (size_t k = 0; k < nn; ++k) {
      const size_t back = (k % n) * n + k / n;
      const double rtt_s = static_cast<double>(o.delay_ns[k] + o.delay_ns[back]) * 1e-9;
      o.rate_queue.push_back(std::max<int64_t>(256 * 1024, static_cast<int64_t>(o.rate_bps[k] / 8 * rtt_s)));
    }
    // A shared wire has one queue: the largest its pairs would have had.
    for (size_t k = 0; k < nn; ++k)
      for (size_t j = 0; j < nn; ++j)
        if (o.wire_of[j] == o.wire_of[k]) o.rate_queue[k] = std::max(o.rate_queue[k], o.rate_queue[j]);
  }
  for (int64_t q : o.rate_queue)
    if (q <= 0) die("--rate-queue-bytes values must be > 0");
  for (size_t k = 0; k < nn; ++k) {
    if (o.wire_of[k] < 0 || o.wire_of[k] >= static_cast<int64_t>(nn))
      die("--wire-of values must be in 0..hosts^2-1");
    for (size_t j = 0; j < k; ++j)
      if (o.wire_of[j] == o.wire_of[k] &&
          (o.rate_bps[j] != o.rate_bps[k] || o.rate_queue[j] != o.rate_queue[k]))
        die("--wire-of: pairs " + std::to_string(j) + " and " + std::to_string(k) +
            " share a wire but not its rate and queue");
  }
  return o;
}

// Creates a TUN device named ifname inside the namespace behind netns_file and returns its fd;
// the calling thread is back in its own namespace afterwards.
Fd open_tun_in(const std::string& netns_file, const std::string& ifname, int home_ns) {
  Fd target(::open(netns_file.c_str(), O_RDONLY | O_CLOEXEC));
  if (target.get() < 0) die("open namespace " + netns_file + ": " + errno_text(errno));
  if (setns(target.get(), CLONE_NEWNET) != 0) die("setns into " + netns_file + ": " + errno_text(errno));
  Fd tun(::open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC));
  const int open_err = errno;
  ifreq ifr{};
  int ioctl_err = 0;
  if (tun.get() >= 0) {
    // No packet-info header and no virtio-net header: reads and writes are bare IP packets, and
    // without TUNSETOFFLOAD the kernel segments GSO packets to the MTU before handing them over.
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    std::snprintf(ifr.ifr_name, IFNAMSIZ, "%s", ifname.c_str());
    if (ioctl(tun.get(), TUNSETIFF, &ifr) != 0) ioctl_err = errno;
  }
  if (setns(home_ns, CLONE_NEWNET) != 0) die("setns back to the starting namespace: " + errno_text(errno));
  if (tun.get() < 0) die("open /dev/net/tun (for " + netns_file + "): " + errno_text(open_err));
  if (ioctl_err != 0) die("TUNSETIFF " + ifname + " in " + netns_file + ": " + errno_text(ioctl_err));
  return tun;
}

struct Packet {
  int64_t due_ns = 0;
  uint64_t seq = 0;  // ties keep arrival order
  int src = 0, dst = 0;
  size_t len = 0;
  std::vector<uint8_t> data;
};

struct Later {
  bool operator()(const Packet& a, const Packet& b) const {
    return a.due_ns != b.due_ns ? a.due_ns > b.due_ns : a.seq > b.seq;
  }
};

class Forwarder {
 public:
  Forwarder(Options opt, std::vector<Fd> tuns)
      : o_(std::move(opt)),
        n_(static_cast<int>(o_.ips.size())),
        tuns_(std::move(tuns)),
        rng_(o_.seed),
        last_due_(static_cast<size_t>(n_) * n_, 0),
        wire_free_(last_due_.size(), 0),
        forwarded_(last_due_.size(), 0),
        lost_(last_due_.size(), 0),
        rate_drops_(last_due_.size(), 0) {}

  // Reads up to kBatch packets waiting on host src's TUN and queues (or drops) them. Bounded:
  // a sender that keeps the TUN busy must not hold back the release of due packets.
  void drain(int src) {
    for (int k = 0; k < kBatch; ++k) {
      std::vector<uint8_t> buf = take_buffer();
      ssize_t got = ::read(tuns_[src].get(), buf.data(), buf.size());
      if (got < 0) {
        give_buffer(std::move(buf));
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        die("read from the TUN of host " + std::to_string(src) + ": " + errno_text(errno));
      }
      const size_t len = static_cast<size_t>(got);
      const int dst = route(buf.data(), len);
      if (dst < 0 || dst == src) {
        ++unroutable_;
        give_buffer(std::move(buf));
        continue;
      }
      const size_t pair = static_cast<size_t>(src) * n_ + dst;
      if (o_.loss[pair] > 0.0 && uniform_(rng_) < o_.loss[pair]) {
        ++lost_[pair];
        give_buffer(std::move(buf));
        continue;
      }
      if (queued_bytes_ + len > o_.max_queue_bytes) {
        ++overflow_;  // like a router's full buffer: tail drop
        give_buffer(std::move(buf));
        continue;
      }
      const int64_t now = now_ns();
      int64_t sent = now;  // when its last bit has left (the pair's wire, if it has one)
      if (o_.rate_bps[pair] > 0.0) {
        const double bps = o_.rate_bps[pair];
        int64_t& wire_free = wire_free_[static_cast<size_t>(o_.wire_of[pair])];
        const int64_t backlog_ns = std::max<int64_t>(0, wire_free - now);
        if (static_cast<double>(backlog_ns) * 1e-9 * bps / 8 + static_cast<double>(len) >
            static_cast<double>(o_.rate_queue[pair])) {
          ++rate_drops_[pair];  // the pair's queue is full: tail drop, as its router would
          give_buffer(std::move(buf));
          continue;
        }
        sent = std::max(now, wire_free) + static_cast<int64_t>(static_cast<double>(len) * 8e9 / bps);
        wire_free = sent;
      }
      int64_t due = sent + delay_of(pair);
      // Without --reorder a packet never overtakes an earlier one of the same pair (jitter then
      // delays a burst's tail instead of shuffling it, as TCP would see on a real path).
      if (!o_.reorder) due = std::max(due, last_due_[pair]);
      last_due_[pair] = due;
      queued_bytes_ += len;
      queue_.push(Packet{due, seq_++, src, dst, len, std::move(buf)});
    }
  }

  // Writes every packet whose time has come; returns the departure time of the next one (or -1).
  int64_t release() {
    while (!queue_.empty()) {
      int64_t now = now_ns();
      const int64_t due = queue_.top().due_ns;
      // A timer wake-up lands tens of microseconds late on a busy machine: the timer is set
      // spin_ns early and the last stretch is waited out here.
      if (due > now + o_.spin_ns) return due - o_.spin_ns;
      while (due > now) now = now_ns();
      // priority_queue::top() is const: the packet is copied out by moving its buffer.
      Packet p = std::move(const_cast<Packet&>(queue_.top()));
      queue_.pop();
      queued_bytes_ -= p.len;
      const int64_t late = now - p.due_ns;
      late_sum_ns_ += late;
      late_max_ns_ = std::max(late_max_ns_, late);
      ssize_t put;
      do {
        put = ::write(tuns_[p.dst].get(), p.data.data(), p.len);
      } while (put < 0 && errno == EINTR);
      if (put < 0) {
        if (write_errors_++ == 0)
          std::fprintf(stderr,
                       "rumor-wanem: write to the TUN of host %d failed: %s (counted in write_errors)\n",
                       p.dst, errno_text(errno).c_str());
      } else {
        ++forwarded_[static_cast<size_t>(p.src) * n_ + p.dst];
      }
      ++released_;
      give_buffer(std::move(p.data));
    }
    return -1;
  }

  void print_stats() const {
    std::string s = "{\"hosts\": " + std::to_string(n_) + ", \"forwarded\": " + matrix(forwarded_) +
                    ", \"lost\": " + matrix(lost_) + ", \"rate_drops\": " + matrix(rate_drops_) +
                    ", \"overflow\": " + std::to_string(overflow_) +
                    ", \"unroutable\": " + std::to_string(unroutable_) +
                    ", \"write_errors\": " + std::to_string(write_errors_) +
                    ", \"queued\": " + std::to_string(queue_.size()) +
                    ", \"released\": " + std::to_string(released_) + ", \"late_mean_us\": " +
                    std::to_string(released_ ? static_cast<double>(late_sum_ns_) / released_ / 1e3 : 0.0) +
                    ", \"late_max_us\": " + std::to_string(static_cast<double>(late_max_ns_) / 1e3) + "}\n";
    std::fputs(s.c_str(), stdout);
    std::fflush(stdout);
  }

 private:
  int route(const uint8_t* pkt, size_t len) const {
    if (len < 20 || (pkt[0] >> 4) != 4) return -1;  // IPv4 only: the cluster's addresses are IPv4
    uint32_t dst;
    std::memcpy(&dst, pkt + 16, sizeof dst);
    for (int h = 0; h < n_; ++h)
      if (o_.ips[h] == dst) return h;
    return -1;
  }

  int64_t delay_of(size_t pair) {
    const int64_t d = o_.delay_ns[pair], j = o_.jitter_ns[pair];
    if (j == 0) return d;
    double x = o_.normal ? std::normal_distribution<double>(0.0, static_cast<double>(j))(rng_)
                         : std::uniform_real_distribution<double>(-static_cast<double>(j),
                                                                  static_cast<double>(j))(rng_);
    return std::max<int64_t>(0, d + static_cast<int64_t>(x));
  }

  std::vector<uint8_t> take_buffer() {
    if (pool_.empty()) return std::vector<uint8_t>(kPacketBuffer);
    std::vector<uint8_t> b = std::move(pool_.back());
    pool_.pop_back();
    return b;
  }
  void give_buffer(std::vector<uint8_t> b) {
    if (pool_.size() < 4096) pool_.push_back(std::move(b));
  }

  std::string matrix(const std::vector<uint64_t>& v) const {
    std::string s = "[";
    for (int i = 0; i < n_; ++i) {
      s += i ? ", [" : "[";
      for (int j = 0; j < n_; ++j) s += (j ? ", " : "") + std::to_string(v[static_cast<size_t>(i) * n_ + j]);
      s += "]";
    }
    return s + "]";
  }

  Options o_;
  int n_;
  std::vector<Fd> tuns_;
  std::mt19937_64 rng_;
  std::uniform_real_distribution<double> uniform_{0.0, 1.0};
  std::priority_queue<Packet, std::vector<Packet>, Later> queue_;
  std::vector<std::vector<uint8_t>> pool_;
  std::vector<int64_t> last_due_;
  std::vector<int64_t> wire_free_;  // per wire: when it has sent everything queued on it
  std::vector<uint64_t> forwarded_, lost_, rate_drops_;
  uint64_t seq_ = 0, overflow_ = 0, unroutable_ = 0, write_errors_ = 0, released_ = 0;
  size_t queued_bytes_ = 0;
  int64_t late_sum_ns_ = 0, late_max_ns_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Options opt = parse_args(argc, argv);
  const long parent = opt.parent_pid ? opt.parent_pid : static_cast<long>(getppid());

  // Signals arrive through a signalfd so the loop handles them between packets, never inside one.
  sigset_t sigs;
  sigemptyset(&sigs);
  for (int s : {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2}) sigaddset(&sigs, s);
  if (sigprocmask(SIG_BLOCK, &sigs, nullptr) != 0) die("sigprocmask: " + errno_text(errno));
  // The death signal comes when the *thread* that started us exits, which may be a helper thread
  // of a parent that lives on: SIGUSR2 then only makes the loop look at getppid().
  if (prctl(PR_SET_PDEATHSIG, SIGUSR2) != 0) die("prctl(PR_SET_PDEATHSIG): " + errno_text(errno));
  if (getppid() != parent) return 0;  // the parent died before PDEATHSIG was armed
  // Timer slack is 50 us by default; packets should leave within microseconds of their time.
  (void)prctl(PR_SET_TIMERSLACK, 1UL);
  // netem runs in the kernel's softirq; this runs among the emulated hosts' own processes and,
  // starved on a busy machine, would add its scheduling delay to every packet (and drop on the
  // TUN's full queue). It sleeps in epoll between packets, and the kernel's RT throttling bounds
  // it anyway.
  if (opt.realtime) {
    sched_param sp{};
    sp.sched_priority = 10;
    if (sched_setscheduler(0, SCHED_FIFO, &sp) != 0) {
      const int err = errno;
      if (setpriority(PRIO_PROCESS, 0, -20) != 0)
        std::fprintf(stderr,
                     "rumor-wanem: warning: neither SCHED_FIFO (%s) nor nice -20 (%s): delays may run late "
                     "on a busy machine\n",
                     errno_text(err).c_str(), errno_text(errno).c_str());
    }
  }

  Fd home(::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC));
  if (home.get() < 0) die("open /proc/self/ns/net: " + errno_text(errno));
  std::vector<Fd> tuns;
  for (const std::string& ns : opt.netns) tuns.push_back(open_tun_in(ns, opt.ifname, home.get()));

  Fd ep(epoll_create1(EPOLL_CLOEXEC));
  Fd sfd(signalfd(-1, &sigs, SFD_NONBLOCK | SFD_CLOEXEC));
  Fd tfd(timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
  if (ep.get() < 0 || sfd.get() < 0 || tfd.get() < 0) die("epoll/signalfd/timerfd: " + errno_text(errno));
  const int n = static_cast<int>(tuns.size());
  auto watch = [&](int fd, uint64_t tag) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = tag;
    if (epoll_ctl(ep.get(), EPOLL_CTL_ADD, fd, &ev) != 0) die("epoll_ctl: " + errno_text(errno));
  };
  for (int h = 0; h < n; ++h) watch(tuns[h].get(), static_cast<uint64_t>(h));
  constexpr uint64_t kSignalTag = 1u << 20, kTimerTag = kSignalTag + 1;
  watch(sfd.get(), kSignalTag);
  watch(tfd.get(), kTimerTag);

  Forwarder fw(std::move(opt), std::move(tuns));
  std::fputs("ready\n", stdout);
  std::fflush(stdout);

  int64_t armed = -1;
  epoll_event events[64];
  for (;;) {
    const int k = epoll_wait(ep.get(), events, 64, kWakeMs);
    if (k < 0 && errno != EINTR) die("epoll_wait: " + errno_text(errno));
    if (getppid() != parent) break;
    bool stop = false;
    for (int e = 0; e < std::max(k, 0); ++e) {
      const uint64_t tag = events[e].data.u64;
      if (tag == kSignalTag) {
        signalfd_siginfo si{};
        while (::read(sfd.get(), &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
          if (si.ssi_signo == SIGUSR1)
            fw.print_stats();
          else if (si.ssi_signo != SIGUSR2)
            stop = true;
        }
      } else if (tag == kTimerTag) {
        uint64_t expirations;
        (void)!::read(tfd.get(), &expirations, sizeof expirations);
        armed = -1;
      } else {
        fw.drain(static_cast<int>(tag));
      }
    }
    if (stop) break;
    const int64_t next = fw.release();
    if (next >= 0 && next != armed) {
      itimerspec its{};
      its.it_value.tv_sec = next / 1000000000;
      its.it_value.tv_nsec = next % 1000000000;
      if (timerfd_settime(tfd.get(), TFD_TIMER_ABSTIME, &its, nullptr) != 0)
        die("timerfd_settime: " + errno_text(errno));
      armed = next;
    }
  }
  return 0;
}
