// Minimal leveled logging to stderr. RUMOR_LOG=error|warn|info|debug (default warn).
#pragma once

#include <sstream>
#include <string>

namespace rumor {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

bool log_enabled(LogLevel level);
void log_line(LogLevel level, const std::string& msg);

}  // namespace rumor

#define RUMOR_LOG(level, expr)                                          \
  do {                                                                  \
    if (::rumor::log_enabled(::rumor::LogLevel::level)) {               \
      std::ostringstream rumor_log_os_;                                 \
      rumor_log_os_ << expr;                                            \
      ::rumor::log_line(::rumor::LogLevel::level, rumor_log_os_.str()); \
    }                                                                   \
  } while (0)
