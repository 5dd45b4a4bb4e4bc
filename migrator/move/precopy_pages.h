// The pages a pre-copy has sent, by address, with the digest of each
// page's content as the destination will restore it (shim/migration/page_digest.h):
// what lets a release leave registered pages the HCA has not written since
// out of the final dump.
//
// Read from CRIU's images of one process in a pre-dump directory:
// pagemap-PID.img (a magic, a PagemapHead naming pages-ID.img, then one
// PagemapEntry per run of pages; those flagged PE_PRESENT have their bytes
// in pages-ID.img, in order) and pages-ID.img (raw pages). A later round's
// pages replace an earlier one's.
#ifndef RDMAVIRT_MIGRATOR_MOVE_PRECOPY_PAGES_H_
#define RDMAVIRT_MIGRATOR_MOVE_PRECOPY_PAGES_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "shim/migration/page_digest.h"

namespace rdmavirt::migrator {

class PrecopyPages {
 public:
  // Adds the pages of `pid` in the pre-dump `dir`. On an error (an image
  // missing, malformed or short) everything recorded so far is dropped and
  // later calls record nothing: a release then marks every registered page.
  absl::Status AddPreDump(const std::string& dir, pid_t pid, uint64_t page_size);

  // The wire form for the Release request (ascending addresses) of the
  // pages that overlap `ranges` ([begin, end) each: the process's writable
  // registered memory, the only pages a release looks up); empty when
  // nothing is known or more than `max_pages` would go.
  void Encode(const std::vector<std::pair<uint64_t, uint64_t>>& ranges, size_t max_pages,
              std::string* addrs, std::string* digests) const;

  size_t size() const { return pages_.size(); }
  bool failed() const { return failed_; }

 private:
  absl::Status Read(const std::string& dir, pid_t pid);

  absl::flat_hash_map<uint64_t, shim::PageDigest> pages_;
  uint64_t page_size_ = 4096;
  bool failed_ = false;
};

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_MOVE_PRECOPY_PAGES_H_
