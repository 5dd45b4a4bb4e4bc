// Dirty-page tracking of registered memory across a release: what the
// HCA wrote behind the CPU's soft-dirty bits is marked for the final dump,
// and a post-copy's release locks registered memory so that CRIU dumps it
// whole. Called by the release step (release.cc) on the control thread,
// or by tests; neither function fails: what the kernel refuses is said
// once on stderr (log.h) and left as it was.
#ifndef RDMAVIRT_SHIM_MIGRATION_DIRTY_PAGES_H_
#define RDMAVIRT_SHIM_MIGRATION_DIRTY_PAGES_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "shim/migration/page_digest.h"

namespace rdmavirt::shim {

// What DirtyPages did: pages marked, and pages left alone because the
// destination already holds their content.
struct DirtyCount {
  uint64_t marked = 0;
  uint64_t unchanged = 0;
};

// Writes every page of `ranges` (start, end addresses) once, where the
// process maps it writable, so that a dump tracking soft-dirty bits copies
// what the HCA wrote there (called at a release). A page in `known` (from
// the pre-copy's images, page_digest.h) whose content still has its digest
// there is left alone.
void DirtyPages(const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges,
                const KnownPages& known = KnownPages(), DirtyCount* count = nullptr);

// Locks (mlock) the pages of `ranges` that lie in mappings the process has
// not locked itself; returns what it locked, page-aligned (a post-copy's
// release: CRIU dumps locked memory whole rather than as lazy pages). What
// mlock refuses (RLIMIT_MEMLOCK) stays unlocked, said once.
std::vector<std::pair<uintptr_t, uintptr_t>> LockUnlocked(
    const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges);

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_MIGRATION_DIRTY_PAGES_H_
