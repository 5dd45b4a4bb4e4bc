// The migrator's log: one line per event on stderr, with a UTC timestamp
// and the thread's id, so that interleaved migrations stay readable.
// Safe to call from any thread.
#ifndef RDMAVIRT_MIGRATOR_HOST_LOG_H_
#define RDMAVIRT_MIGRATOR_HOST_LOG_H_

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace rdmavirt::migrator {

void LogLine(absl::string_view line);

template <typename... Args>
void Log(const absl::FormatSpec<Args...>& format, const Args&... args) {
  LogLine(absl::StrFormat(format, args...));
}

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_HOST_LOG_H_
