// Process-wide plugin state: settings from the environment, the interfaces offered as devices and
// NCCL's logger. Written once (std::call_once) before any comm exists, read-only afterwards, so
// the data path takes no global lock.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <vector>

#include "netplugin/plugin.h"

namespace rumor::netplugin {
namespace {

constexpr int kMaxDevices = 16;

struct State {
  Config cfg;
  std::vector<DeviceInfo> devices;
  std::string error;                 // why no device could be offered
  std::atomic<long> trace_spent{0};  // lines of RUMOR_NET_PLUGIN_TRACE's budget used
};

std::atomic<abi::Logger> g_logger{nullptr};
std::once_flag g_once;
// Built once inside call_once; a unique_ptr so nothing runs at library load.
std::unique_ptr<State> g_state;

long env_long(const char* name, long fallback, long lo, long hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < lo || x > hi) {
    log(abi::kLogWarn, std::string("NET/rumor: ignoring ") + name + "=" + v + " (expected an integer in [" +
                           std::to_string(lo) + ", " + std::to_string(hi) + "])");
    return fallback;
  }
  return x;
}

// NCCL_SOCKET_IFNAME syntax: comma-separated prefixes; a leading '^' excludes them, a leading
// '=' asks for exact names.
bool name_selected(const std::string& name, std::string spec) {
  bool exclude = false, exact = false;
  if (!spec.empty() && spec[0] == '^') exclude = true, spec.erase(0, 1);
  if (!spec.empty() && spec[0] == '=') exact = true, spec.erase(0, 1);
  bool hit = false;
  std::stringstream ss(spec);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.empty()) continue;
    if (exact ? name == item : name.rfind(item, 0) == 0) hit = true;
  }
  return exclude ? !hit : hit;
}

int read_speed(const std::string& ifname) {
  std::ifstream f("/sys/class/net/" + ifname + "/speed");
  int mbps = 0;
  // Virtual interfaces report nothing or -1: assume 10 Gbit/s as NCCL's socket transport does.
  if (!(f >> mbps) || mbps <= 0) mbps = 10000;
  return mbps;
}

std::string read_pci_path(const std::string& ifname) {
  std::error_code ec;
  auto p = std::filesystem::canonical("/sys/class/net/" + ifname + "/device", ec);
  return ec ? std::string() : p.string();
}

// One device per selected interface, IPv4 address preferred, link-local IPv6 skipped (it would
// need a scope id in the handle).
std::vector<DeviceInfo> discover(const char* spec, bool want_loopback) {
  std::vector<DeviceInfo> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  std::unique_ptr<ifaddrs, decltype(&::freeifaddrs)> guard(list, &::freeifaddrs);
  for (int family : {AF_INET, AF_INET6}) {
    for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
      if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != family || !(a->ifa_flags & IFF_UP)) continue;
      std::string name = a->ifa_name;
      bool loop = (a->ifa_flags & IFF_LOOPBACK) != 0;
      if (spec != nullptr ? !name_selected(name, spec) : loop != want_loopback) continue;
      char buf[INET6_ADDRSTRLEN] = {};
      if (family == AF_INET) {
        ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof(buf));
      } else {
        auto* in6 = &reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr;
        if (IN6_IS_ADDR_LINKLOCAL(in6)) continue;
        ::inet_ntop(AF_INET6, in6, buf, sizeof(buf));
      }
      bool seen = false;
      for (const auto& d : out) seen |= d.name == name;
      if (seen || static_cast<int>(out.size()) >= kMaxDevices) continue;
      out.push_back({name, buf, read_pci_path(name), read_speed(name)});
    }
  }
  return out;
}

void setup_once() {
  auto st = std::make_unique<State>();
  const Config defaults;
  st->cfg.streams = static_cast<int>(env_long("RUMOR_NET_PLUGIN_STREAMS", defaults.streams, 1, 16));
  st->cfg.chunk = static_cast<size_t>(env_long("RUMOR_NET_PLUGIN_CHUNK_KB",
                                               static_cast<long>(defaults.chunk >> 10), 4, 16384))
                  << 10;
  st->cfg.timeout_s = static_cast<double>(
      env_long("RUMOR_NET_PLUGIN_TIMEOUT", static_cast<long>(defaults.timeout_s), 1, 86400));
  st->cfg.trace_lines = env_long("RUMOR_NET_PLUGIN_TRACE", 0, 0, 1000000);
  const char* spec = std::getenv("RUMOR_NET_PLUGIN_IFNAME");
  const char* spec_from = "RUMOR_NET_PLUGIN_IFNAME";
  if (spec == nullptr || *spec == '\0')
    spec = std::getenv("NCCL_SOCKET_IFNAME"), spec_from = "NCCL_SOCKET_IFNAME";
  if (spec != nullptr && *spec == '\0') spec = nullptr;
  if (spec != nullptr) {
    st->devices = discover(spec, false);
    if (st->devices.empty()) st->error = std::string("no up interface matches ") + spec_from + "=" + spec;
  } else {
    // Default: the first non-loopback interface that is up, else loopback (one-host jobs).
    st->devices = discover(nullptr, false);
    if (st->devices.size() > 1) st->devices.resize(1);
    if (st->devices.empty()) st->devices = discover(nullptr, true);
    if (st->devices.size() > 1) st->devices.resize(1);
    if (st->devices.empty()) st->error = "no network interface is up";
  }
  std::string names;
  for (const auto& d : st->devices) names += (names.empty() ? "" : " ") + d.name + "/" + d.ip;
  g_state = std::move(st);
  if (g_state->devices.empty()) {
    log(abi::kLogWarn, "NET/rumor: " + g_state->error);
    return;
  }
  log(abi::kLogInfo, "NET/rumor: rumor TCP net plugin (NCCL net API v8-v12), interfaces " + names + ", " +
                         std::to_string(g_state->cfg.streams) + " streams per connection, " +
                         std::to_string(g_state->cfg.chunk >> 10) + " KiB chunks, setup timeout " +
                         std::to_string(static_cast<int>(g_state->cfg.timeout_s)) + " s");
}

}  // namespace

void log(abi::LogLevel level, const std::string& msg) {
  abi::Logger logger = g_logger.load(std::memory_order_acquire);
  if (logger != nullptr) {
    logger(level, abi::kLogSubsysInit | abi::kLogSubsysNet, __FILE__, __LINE__, "%s", msg.c_str());
  } else if (level == abi::kLogWarn) {
    std::fprintf(stderr, "%s\n", msg.c_str());
  }
}

abi::Result init(abi::Logger logger) {
  if (logger != nullptr) g_logger.store(logger, std::memory_order_release);
  std::call_once(g_once, setup_once);
  return g_state->devices.empty() ? abi::kInternalError : abi::kSuccess;
}

const Config& config() { return g_state->cfg; }

bool tracing() {
  if (!g_state || g_state->cfg.trace_lines <= 0) return false;
  return g_state->trace_spent.fetch_add(1, std::memory_order_relaxed) < g_state->cfg.trace_lines;
}
int device_count() { return g_state ? static_cast<int>(g_state->devices.size()) : 0; }
const DeviceInfo& device(int dev) { return g_state->devices.at(static_cast<size_t>(dev)); }
char* device_name_cstr(int dev) { return g_state->devices.at(static_cast<size_t>(dev)).name.data(); }
char* device_pci_cstr(int dev) {
  auto& d = g_state->devices.at(static_cast<size_t>(dev));
  return d.pci_path.empty() ? nullptr : d.pci_path.data();
}

}  // namespace rumor::netplugin
