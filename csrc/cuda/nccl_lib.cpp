#include "cuda/nccl_lib.h"

#include <dlfcn.h>
#include <link.h>
#include <sys/stat.h>

#include <cstring>

#include "core/log.h"
#include "core/types.h"

namespace rumor::nccl {

namespace {

// Closes a handle unless released: a candidate rejected half-way must not stay mapped.
struct DlHandle {
  void* h = nullptr;
  explicit DlHandle(void* handle) : h(handle) {}
  ~DlHandle() {
    if (h != nullptr) ::dlclose(h);
  }
  DlHandle(const DlHandle&) = delete;
  DlHandle& operator=(const DlHandle&) = delete;
  void* release() {
    void* r = h;
    h = nullptr;
    return r;
  }
};

template <typename Fn>
Fn lookup(void* handle, const char* name) {
  return reinterpret_cast<Fn>(::dlsym(handle, name));
}

std::string last_dl_error() {
  const char* e = ::dlerror();
  return e != nullptr ? std::string(e) : std::string("unknown dlopen error");
}

// Resolves every entry point; returns the names of the required ones that are missing.
std::vector<std::string> resolve(void* h, Api& api) {
  std::vector<std::string> missing;
  auto need = [&]<typename Fn>(Fn& slot, const char* name) {
    slot = lookup<Fn>(h, name);
    if (slot == nullptr) missing.emplace_back(name);
  };
  need(api.get_version, "ncclGetVersion");
  need(api.get_unique_id, "ncclGetUniqueId");
  need(api.comm_init_rank_config, "ncclCommInitRankConfig");
  need(api.comm_get_async_error, "ncclCommGetAsyncError");
  need(api.comm_abort, "ncclCommAbort");
  need(api.comm_destroy, "ncclCommDestroy");
  need(api.get_error_string, "ncclGetErrorString");
  need(api.all_reduce, "ncclAllReduce");
  need(api.broadcast, "ncclBroadcast");
  need(api.reduce, "ncclReduce");
  need(api.all_gather, "ncclAllGather");
  need(api.reduce_scatter, "ncclReduceScatter");
  need(api.send, "ncclSend");
  need(api.recv, "ncclRecv");
  need(api.group_start, "ncclGroupStart");
  need(api.group_end, "ncclGroupEnd");
  need(api.comm_count, "ncclCommCount");
  need(api.comm_user_rank, "ncclCommUserRank");
  // Optional: the communicator falls back to destroy without finalize, and to the result
  // code's generic text.
  api.comm_finalize = lookup<abi::CommFinalizeFn>(h, "ncclCommFinalize");
  api.get_last_error = lookup<abi::GetLastErrorFn>(h, "ncclGetLastError");
  return missing;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s.append(s.empty() ? "" : ", ").append(x);
  return s;
}

}  // namespace

std::string NcclLibrary::version_string(int code) {
  // NCCL_VERSION(): x*1000 + y*100 + z up to 2.8, x*10000 + y*100 + z from 2.9 on.
  const bool wide = code >= 10000;
  const int major = wide ? code / 10000 : code / 1000;
  const int minor = wide ? (code % 10000) / 100 : (code % 1000) / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

NcclLibrary::NcclLibrary(const std::vector<std::string>& candidates) {
  if (candidates.empty())
    throw Error(ErrorKind::kInvalidArgument, "NCCL library: no candidate files or names given");
  std::vector<std::string> tried;
  for (const auto& c : candidates) {
    const bool is_path = c.find('/') != std::string::npos;
    struct stat st{};
    if (is_path && ::stat(c.c_str(), &st) != 0) {
      tried.push_back(c + " (file not found)");
      continue;
    }
    ::dlerror();  // clear a stale message so the one read below is this call's
    // RTLD_LOCAL: NCCL's symbols stay out of the global namespace, where they could resolve
    // another library's references to a different NCCL.
    DlHandle h(::dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL));
    if (h.h == nullptr) {
      tried.push_back(c + (is_path ? " (could not be loaded: " : " (not found by the dynamic loader: ") +
                      last_dl_error() + ")");
      continue;
    }
    Api api;
    std::vector<std::string> missing = resolve(h.h, api);
    if (api.get_version == nullptr) {
      tried.push_back(c + " (not an NCCL library: missing symbol ncclGetVersion)");
      continue;
    }
    int code = 0;
    if (abi::Result r = api.get_version(&code); r != abi::kSuccess) {
      tried.push_back(c + " (ncclGetVersion failed with result " + std::to_string(r) + ")");
      continue;
    }
    // Checked before the missing symbols: an old NCCL lacks ncclCommInitRankConfig, and "too
    // old" is the useful thing to tell its user.
    if (code < kMinVersionCode) {
      tried.push_back(c + " (too old: NCCL " + version_string(code) + " < " +
                      version_string(kMinVersionCode) +
                      ", the first with nonblocking communicator creation)");
      continue;
    }
    if (!missing.empty()) {
      tried.push_back(c + " (not a usable NCCL library: missing symbol" + (missing.size() > 1 ? "s " : " ") +
                      join(missing) + ")");
      continue;
    }
    // The loader's own record gives the file actually mapped (a bare name resolves somewhere on
    // the search path, or to a copy torch already loaded).
    link_map* lm = nullptr;
    path_ =
        (::dlinfo(h.h, RTLD_DI_LINKMAP, &lm) == 0 && lm != nullptr && lm->l_name != nullptr && *lm->l_name)
            ? std::string(lm->l_name)
            : c;
    handle_ = h.release();
    api_ = api;
    version_code_ = code;
    version_ = version_string(code);
    RUMOR_LOG(kInfo, "nccl: loaded NCCL " << version_ << " from " << path_);
    return;
  }
  throw Error(ErrorKind::kSystem, "no usable NCCL library; tried: " + join(tried) +
                                      ". Set RUMOR_NCCL_LIBRARY to the path of libnccl.so.2, or install the "
                                      "nvidia-nccl wheel that matches your CUDA (e.g. nvidia-nccl-cu12)");
}

NcclLibrary::~NcclLibrary() {
  // Communicators hold a shared_ptr to their library, so none is alive here.
  if (handle_ != nullptr) ::dlclose(handle_);
}

UniqueIdBytes NcclLibrary::unique_id() const {
  abi::UniqueId id{};
  if (abi::Result r = api_.get_unique_id(&id); r != abi::kSuccess)
    throw Error(ErrorKind::kSystem,
                "ncclGetUniqueId failed: " + error_string(r) + " (NCCL " + version_ + ", " + path_ + ")");
  UniqueIdBytes out;
  std::memcpy(out.data(), id.internal, out.size());
  return out;
}

std::string NcclLibrary::error_string(abi::Result r) const {
  const char* s = api_.get_error_string != nullptr ? api_.get_error_string(r) : nullptr;
  std::string text = s != nullptr && *s ? s : "unknown NCCL result";
  return text + " (result " + std::to_string(static_cast<int>(r)) + ")";
}

}  // namespace rumor::nccl
