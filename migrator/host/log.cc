#include "migrator/host/log.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace rdmavirt::migrator {

void LogLine(absl::string_view line) {
  // One write per line: lines of concurrent threads do not interleave.
  std::string out = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  absl::StrAppendFormat(&out, " [%d] %s\n", static_cast<int>(syscall(SYS_gettid)), line);
  fwrite(out.data(), 1, out.size(), stderr);
  fflush(stderr);
}

}  // namespace rdmavirt::migrator
