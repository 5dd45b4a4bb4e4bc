#include "shim/core/log.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <atomic>

namespace rdmavirt::shim {

void LogOnce(const char* why) {
  // Reasons are string literals: their addresses identify them. A small
  // lock-free set is enough; past it, reasons are logged every time.
  static std::atomic<const char*> seen[32];
  for (auto& slot : seen) {
    const char* cur = slot.load(std::memory_order_acquire);
    if (cur == why) return;
    if (cur == nullptr) {
      const char* expected = nullptr;
      if (slot.compare_exchange_strong(expected, why)) break;
      if (expected == why) return;
    }
  }
  Log(why);
}

void Log(const char* what) {
  const char* level = getenv("RDMAVIRT_LOG");
  if (level != nullptr && strcmp(level, "quiet") == 0) return;
  // write(2), not stdio: no locks or buffers shared with the application.
  char line[256];
  size_t n = 0;
  for (const char* p = "rdmavirt: "; *p && n < sizeof(line) - 2; ++p) line[n++] = *p;
  for (const char* p = what; *p && n < sizeof(line) - 2; ++p) line[n++] = *p;
  line[n++] = '\n';
  ssize_t ignored = write(STDERR_FILENO, line, n);
  (void)ignored;
}

bool LogMoves() {
  const char* level = getenv("RDMAVIRT_LOG");
  return level != nullptr && strcmp(level, "moves") == 0;
}

}  // namespace rdmavirt::shim
