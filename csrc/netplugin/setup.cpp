// Process-wide plugin state: settings from the environment, the interfaces offered as devices and
// NCCL's logger. Written once (std::call_once) before any comm exists, read-only afterwards, so
// the data path takes no global lock.
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <vector>

#include "net/tls.h"
#include "netplugin/plugin.h"

namespace rumor::netplugin {
namespace {

constexpr int kMaxDevices = 16;

struct State {
  Config cfg;
  std::vector<DeviceInfo> devices;
  std::string error;                           // why no device could be offered
  std::optional<wire::Key> key;                // the job key; none: unauthenticated
  std::shared_ptr<const net::TlsContext> tls;  // RUMOR_NET_PLUGIN_TLS=1: every stream's TLS; else null
  std::atomic<long> trace_spent{0};            // lines of RUMOR_NET_PLUGIN_TRACE's budget used
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

constexpr size_t kMinSecretChars = 16;
constexpr size_t kMaxSecretFileBytes = 4096;

std::string strip(std::string s) {
  const char* ws = " \t\r\n\v\f";
  size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

// RUMOR_JOB_SECRET_FILE: trusted only if it is a regular file of this user that nobody else may
// read or write; checked on the opened descriptor (O_NOFOLLOW: no symlink is followed), so the
// file checked is the file read.
std::string read_secret_file(const char* path, std::string* error) {
  const std::string what = std::string("RUMOR_JOB_SECRET_FILE=") + path;
  int fd = ::open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    *error = what + ": cannot open: " + std::strerror(errno) + (errno == ELOOP ? " (a symbolic link)" : "");
    return {};
  }
  std::unique_ptr<int, void (*)(int*)> guard(&fd, [](int* f) { ::close(*f); });
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    *error = what + ": fstat: " + std::strerror(errno);
    return {};
  }
  if (!S_ISREG(st.st_mode)) {
    *error = what + " is not a regular file";
    return {};
  }
  if (st.st_uid != ::geteuid()) {
    *error = what + " is owned by uid " + std::to_string(st.st_uid) + ", not by this process's uid " +
             std::to_string(::geteuid());
    return {};
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    *error = what + " has mode " + mode + ": group/other permission bits must be clear (chmod 600)";
    return {};
  }
  std::string text;
  char buf[512];
  while (text.size() <= kMaxSecretFileBytes) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *error = what + ": read: " + std::strerror(errno);
      return {};
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  if (text.size() > kMaxSecretFileBytes) {
    *error = what + " is larger than " + std::to_string(kMaxSecretFileBytes) + " bytes";
    return {};
  }
  return text;
}

// The key from the environment; *error set (and nullopt) when a secret is given but unusable,
// nullopt with no error when none is given.
std::optional<wire::Key> read_key(std::string* error) {
  std::string secret, from;
  const char* env = std::getenv("RUMOR_JOB_SECRET");
  const char* file = std::getenv("RUMOR_JOB_SECRET_FILE");
  if (env != nullptr && *env != '\0') {
    secret = strip(env);
    from = "RUMOR_JOB_SECRET";
  } else if (file != nullptr && *file != '\0') {
    secret = strip(read_secret_file(file, error));
    if (!error->empty()) return std::nullopt;
    from = std::string("RUMOR_JOB_SECRET_FILE=") + file;
  } else {
    return std::nullopt;
  }
  if (secret.size() < kMinSecretChars) {
    *error = from + ": the secret has " + std::to_string(secret.size()) + " characters, at least " +
             std::to_string(kMinSecretChars) + " are required";
    return std::nullopt;
  }
  return wire::derive_key(secret);
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

// RUMOR_NET_PLUGIN_TLS=1: the certificates rumor's own channels use (RUMOR_TLS_CERT, RUMOR_TLS_KEY,
// RUMOR_TLS_CA, RUMOR_TLS_PEER_NAME). Null when off; throws Error naming what is missing or bad.
std::shared_ptr<const net::TlsContext> read_tls() {
  // Strict, unlike the numbers above: a value that is not understood must not mean "in clear".
  const char* on = std::getenv("RUMOR_NET_PLUGIN_TLS");
  if (on == nullptr || *on == '\0' || std::strcmp(on, "0") == 0) return nullptr;
  if (std::strcmp(on, "1") != 0)
    throw Error(ErrorKind::kInvalidArgument,
                std::string("RUMOR_NET_PLUGIN_TLS=") + on + " (expected 0 or 1)");
  auto var = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v != nullptr ? v : "");
  };
  std::string missing;
  for (const char* name : {"RUMOR_TLS_CERT", "RUMOR_TLS_KEY", "RUMOR_TLS_CA"})
    if (var(name).empty()) missing += (missing.empty() ? "" : ", ") + std::string(name);
  if (!missing.empty())
    throw Error(ErrorKind::kInvalidArgument, "RUMOR_NET_PLUGIN_TLS=1 needs " + missing + " (PEM files)");
  return std::make_shared<const net::TlsContext>(net::TlsConfig::from_files(
      var("RUMOR_TLS_CERT"), var("RUMOR_TLS_KEY"), var("RUMOR_TLS_CA"), var("RUMOR_TLS_PEER_NAME")));
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
  st->cfg.hello_timeout_s =
      std::min(st->cfg.timeout_s,
               static_cast<double>(env_long("RUMOR_NET_PLUGIN_HELLO_TIMEOUT",
                                            static_cast<long>(defaults.hello_timeout_s), 1, 86400)));
  std::string key_error;
  st->key = read_key(&key_error);
  if (!key_error.empty()) {
    // A secret was meant to protect the job: running without it would be a silent downgrade.
    st->error = "refusing to start: " + key_error;
    g_state = std::move(st);
    log(abi::kLogWarn, "NET/rumor: " + g_state->error);
    return;
  }
  try {
    st->tls = read_tls();
  } catch (const Error& e) {
    // TLS was asked for: running in clear instead would be a silent downgrade.
    st->error = std::string("refusing to start: ") + e.what();
    g_state = std::move(st);
    log(abi::kLogWarn, "NET/rumor: " + g_state->error);
    return;
  }
  if (!st->key)
    log(abi::kLogWarn,
        "NET/rumor: no RUMOR_JOB_SECRET or RUMOR_JOB_SECRET_FILE: connections are NOT authenticated "
        "(anyone who can reach a listener and learns its id from NCCL's handle exchange can connect)");
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
                         std::to_string(static_cast<int>(g_state->cfg.timeout_s)) + " s, " +
                         (g_state->key ? "authenticated (job secret)" : "unauthenticated") +
                         (g_state->tls ? ", TLS 1.3" : ""));
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
  return g_state->devices.empty() || !g_state->error.empty() ? abi::kInternalError : abi::kSuccess;
}

const Config& config() { return g_state->cfg; }
const wire::Key* auth_key() { return g_state && g_state->key ? &*g_state->key : nullptr; }
std::shared_ptr<const net::TlsContext> tls_context() { return g_state ? g_state->tls : nullptr; }

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
