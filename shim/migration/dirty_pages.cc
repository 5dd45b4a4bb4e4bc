// Dirty-page tracking of registered memory at a release (dirty_pages.h).
#include "shim/migration/dirty_pages.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "shim/core/log.h"
#include "shim/core/shim.h"

namespace rdmavirt::shim {

std::vector<std::pair<uintptr_t, uintptr_t>> Shim::WritableRegistered() {
  MutexLock lock(&mu_);
  return WritableRegisteredLocked();
}

std::vector<std::pair<uintptr_t, uintptr_t>> Shim::WritableRegisteredLocked() {
  std::vector<std::pair<uintptr_t, uintptr_t>> writable;
  for (const Mr* mr : All<Mr>(Kind::kMr)) {
    if (!(mr->access &
          (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)))
      continue;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(mr->shadow.addr);
    writable.emplace_back(begin, begin + mr->shadow.length);
  }
  return writable;
}

std::vector<std::pair<uintptr_t, uintptr_t>> LockUnlocked(
    const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges) {
  // The mappings the application locked itself ("lo" in their VmFlags)
  // stay as they are, and are not unlocked after.
  std::vector<std::pair<uintptr_t, uintptr_t>> locked;
  if (ranges.empty()) return locked;
  FILE* smaps = fopen("/proc/self/smaps", "re");
  if (smaps == nullptr) {
    LogOnce("release: /proc/self/smaps unreadable; registered memory is not locked for post-copy");
    return locked;
  }
  constexpr uintptr_t kPage = 4096;
  std::vector<std::pair<uintptr_t, uintptr_t>> vmas;  // not locked by the application
  unsigned long lo = 0, hi = 0;
  char line[512];
  while (fgets(line, sizeof line, smaps) != nullptr) {
    unsigned long a = 0, b = 0;
    if (sscanf(line, "%lx-%lx ", &a, &b) == 2) {  // a mapping's first line
      lo = a;
      hi = b;
      continue;
    }
    if (strncmp(line, "VmFlags:", 8) != 0) continue;
    if (strstr(line, " lo") == nullptr) vmas.emplace_back(lo, hi);
  }
  fclose(smaps);
  for (const auto& [begin, end] : ranges) {
    for (const auto& [vlo, vhi] : vmas) {
      const uintptr_t from = std::max<uintptr_t>(begin & ~(kPage - 1), vlo);
      const uintptr_t to = std::min<uintptr_t>((end + kPage - 1) & ~(kPage - 1), vhi);
      if (from >= to) continue;
      // On fault: the pages are there (pinned until the release) and are
      // not touched. A plain mlock populates a writable range by writing
      // to it, which sets every page's soft-dirty bit, and CRIU would then
      // dump what the pre-copy holds unchanged.
      if (mlock2(reinterpret_cast<void*>(from), to - from, MLOCK_ONFAULT) == 0) {
        locked.emplace_back(from, to);
      } else {
        LogOnce(("release: mlock of registered memory: " + std::string(strerror(errno)) +
                 "; it comes with post-copy's lazy pages, and is re-registered more slowly")
                    .c_str());
      }
    }
  }
  return locked;
}

void DirtyPages(const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges, const KnownPages& known,
                DirtyCount* count) {
  // The HCA writes registered memory through the kernel's mapping of the
  // pinned pages, which leaves the process's soft-dirty bits alone: a
  // pre-dump's copy of such a page would be taken for current. One write
  // per page, through the process's own mapping, marks it: an atomic OR
  // with 0, which changes nothing even while an application thread writes
  // the same byte. Only where the mapping is writable now (an application
  // may have made registered memory read-only since): /proc/self/maps.
  if (ranges.empty()) return;
  FILE* maps = fopen("/proc/self/maps", "re");
  if (maps == nullptr) {
    LogOnce("release: /proc/self/maps unreadable; registered pages are not marked for the dump");
    return;
  }
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  char line[512];
  while (fgets(line, sizeof line, maps) != nullptr) {
    unsigned long lo = 0, hi = 0;
    char perms[5] = {};
    if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) != 3 || perms[1] != 'w') continue;
    for (const auto& [begin, end] : ranges) {
      // A byte of the range on each of its pages: the first one's is the
      // range's start, the others' their first.
      const uintptr_t to = std::min<uintptr_t>(end, hi);
      for (uintptr_t p = std::max<uintptr_t>(begin, lo); p < to; p = (p & ~(page - 1)) + page) {
        const uintptr_t whole = p & ~(page - 1);
        if (known.Unchanged(whole, reinterpret_cast<const void*>(whole), page)) {
          if (count != nullptr) ++count->unchanged;
          continue;
        }
        __atomic_fetch_or(reinterpret_cast<uint8_t*>(p), uint8_t{0}, __ATOMIC_RELAXED);
        if (count != nullptr) ++count->marked;
      }
    }
  }
  fclose(maps);
}

}  // namespace rdmavirt::shim
