// The shim's end of the control protocol (protos/rdmavirt/v1/control.proto):
// a thread that connects to the host's migrator over its Unix socket, says
// Hello, and carries out the migrator's requests on the Shim one at a time.
//
// The thread is invisible to the application: it blocks every signal,
// holds its socket with O_CLOEXEC, and a forked child has no such thread
// (the socket is closed in the child; the child's shim works, unmigratable).
// After a Release it closes its socket (CRIU may then dump the process) and
// waits, holding no fd, until the file RUNDIR/resume/PID exists, RUNDIR
// being the socket's directory: the migrator creates it after CRIU
// restored the process on the destination, or on the source to roll back.
#ifndef RDMAVIRT_SHIM_MIGRATION_CONTROL_H_
#define RDMAVIRT_SHIM_MIGRATION_CONTROL_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shim/core/remote_map.h"
#include "shim/core/status.h"
#include "shim/migration/dirty_pages.h"
#include "shim/migration/endpoint_view.h"
#include "shim/migration/page_digest.h"

namespace rdmavirt::shim {

class Shim;

inline constexpr uint32_t kMaxFrame = 16u << 20;
inline constexpr const char* kDefaultSocket = "/run/rdmavirt/migratord.sock";

struct ControlRequest {
  enum class Kind {
    kNone,
    kQuiesce,
    kRelease,
    kRestore,
    kResume,
    kPeerQuiesce,
    kPeerReconnect,
    kDescribe
  };
  uint64_t id = 0;
  Kind kind = Kind::kNone;
  uint32_t drain_timeout_ms = 0;
  // peer_quiesce: the virtual GID of the endpoint that moves (the QPs
  // connected to it are drained), when the request names one.
  bool has_toward = false;
  ibv_gid toward{};
  std::string device;
  std::vector<RemoteMapping> peers;  // restore's; peer_reconnect's mappings
  bool keep_paused = false;          // peer_reconnect
  KnownPages known;                  // release: pages the destination holds
  bool lock_registered = false;      // release: mlock registered memory (post-copy)
};

// Codec (control.cc), exposed for tests.
std::string EncodeHello(int pid, std::string_view endpoint_id, bool released,
                        std::string_view program);
std::string EncodeReply(uint64_t id, const Status& status, const EndpointView& view,
                        std::string_view endpoint_id, int pid, uint64_t elapsed_us,
                        uint32_t drained_sends, const DirtyCount& pages = DirtyCount(),
                        const std::vector<std::pair<uintptr_t, uintptr_t>>& writable = {});
// False, with why, on malformed input or a request without a command.
bool DecodeRequest(std::string_view message, ControlRequest* out, std::string* why);

// Carries out one request on the shim; the serialized ShimToMigrator reply.
std::string Execute(Shim* shim, const ControlRequest& request, std::string_view endpoint_id,
                    int pid, bool* released);

// Starts the control thread once per process (later calls do nothing).
// The socket path is $RDMAVIRT_SOCKET, or kDefaultSocket.
void StartControl(Shim* shim);

// Whether this process is migratable: RDMAVIRT_MIGRATE is not "0" and the
// kernel offers the pause's fence (pause.h). A migrator need not run yet:
// the control thread connects to one whenever it appears.
bool MigrationEnabled();

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_MIGRATION_CONTROL_H_
