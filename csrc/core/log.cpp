#include "core/log.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace rumor {

namespace {
LogLevel level_from_env() {
  const char* v = std::getenv("RUMOR_LOG");
  if (v == nullptr) return LogLevel::kWarn;
  if (std::strcmp(v, "error") == 0) return LogLevel::kError;
  if (std::strcmp(v, "info") == 0) return LogLevel::kInfo;
  if (std::strcmp(v, "debug") == 0) return LogLevel::kDebug;
  return LogLevel::kWarn;
}
}  // namespace

bool log_enabled(LogLevel level) {
  static const LogLevel configured = level_from_env();
  return static_cast<int>(level) <= static_cast<int>(configured);
}

void log_line(LogLevel level, const std::string& msg) {
  static const char* names[] = {"E", "W", "I", "D"};
  // One fprintf per line so lines from several threads do not interleave mid-line.
  std::fprintf(stderr, "[rumor %s pid %d] %s\n", names[static_cast<int>(level)], static_cast<int>(getpid()),
               msg.c_str());
}

}  // namespace rumor
