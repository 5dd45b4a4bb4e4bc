// What the shim's migration steps report (migration.cc, called by the
// control thread in control.cc): a status with an absl/gRPC code, and a
// view of the endpoint for the migrator (mirrors control.proto's
// EndpointSummary; control.cc encodes it).
#ifndef RDMAVIRT_SHIM_MIGRATION_H_
#define RDMAVIRT_SHIM_MIGRATION_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "shim/page_digest.h"

namespace rdmavirt::shim {

// Codes as absl::StatusCode / grpc::StatusCode, so they cross the wire
// unchanged.
enum class Code : int {
  kOk = 0,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kInternal = 13,
  kUnavailable = 14,
};

struct Status {
  Code code = Code::kOk;
  std::string message;
  bool ok() const { return code == Code::kOk; }
};

inline Status Error(Code code, std::string message) { return {code, std::move(message)}; }

struct QpView {
  uint32_t virtual_qpn = 0;
  uint32_t physical_qpn = 0;  // 0 while released
  uint32_t qp_type = 0;
  uint32_t state = 0;
  bool connected = false;  // has a remote address (RC/UC after RTR)
  ibv_gid remote_virtual_gid{};
  uint32_t remote_virtual_qpn = 0;
  ibv_gid remote_physical_gid{};
  uint32_t outstanding_recvs = 0;
  uint32_t queued_sends = 0;
};

struct EndpointView {
  bool paused = false;
  bool released = false;
  std::string device;  // "" while released
  uint32_t devices = 0, pds = 0, mrs = 0, cqs = 0, srqs = 0, qps = 0, ahs = 0;
  uint64_t registered_bytes = 0;
  uint32_t pending_completions = 0;
  std::vector<QpView> qp_list;
  // Where the peers the address handles point at are now (UD peers).
  std::vector<ibv_gid> ud_peer_physical_gids;
  // This endpoint's own identities now (Mapping in control.proto).
  bool has_gid = false;
  ibv_gid virtual_gid{};
  ibv_gid physical_gid{};
  std::vector<std::pair<uint32_t, uint32_t>> qpns;   // virtual, physical
  std::vector<std::pair<uint32_t, uint32_t>> rkeys;  // virtual, physical
};

// What DirtyPages did: pages marked, and pages left alone because the
// destination already holds their content.
struct DirtyCount {
  uint64_t marked = 0;
  uint64_t unchanged = 0;
};

// Writes every page of `ranges` (start, end addresses) once, where the
// process maps it writable, so that a dump tracking soft-dirty bits copies
// what the HCA wrote there (migration.cc; called at a release). A page in
// `known` (from the pre-copy's images, page_digest.h) whose content still
// has its digest there is left alone.
void DirtyPages(const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges,
                const KnownPages& known = KnownPages(), DirtyCount* count = nullptr);

// Locks (mlock) the pages of `ranges` that lie in mappings the process has
// not locked itself; returns what it locked, page-aligned (migration.cc;
// a post-copy's release: CRIU dumps locked memory whole rather than as
// lazy pages). What mlock refuses (RLIMIT_MEMLOCK) stays unlocked, said once.
std::vector<std::pair<uintptr_t, uintptr_t>> LockUnlocked(
    const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges);

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_MIGRATION_H_
