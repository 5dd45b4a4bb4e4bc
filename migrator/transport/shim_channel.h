// ShimChannel: how the migrator talks to the shims of this host's processes
// (control.proto). ShimServer is the real one (a Unix socket); tests use
// an in-memory fake. Implementations are safe for concurrent use: requests
// to different processes proceed in parallel, requests to one process are
// sent one at a time, in order.
#ifndef RDMAVIRT_MIGRATOR_TRANSPORT_SHIM_CHANNEL_H_
#define RDMAVIRT_MIGRATOR_TRANSPORT_SHIM_CHANNEL_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rdmavirt/v1/control.pb.h"

namespace rdmavirt::migrator {

// A connected shim, as its Hello said.
struct ShimInfo {
  pid_t pid = 0;
  std::string endpoint_id;
  std::string program;
  v1::EndpointPhase phase = v1::ENDPOINT_PHASE_UNSPECIFIED;
};

class ShimChannel {
 public:
  virtual ~ShimChannel() = default;

  // The shims connected now, by pid.
  virtual std::vector<ShimInfo> Connected() = 0;

  // Sends `request` (its request_id is assigned here) to the shim of `pid`
  // and waits for the reply. The reply's own code is the shim's verdict;
  // the status is about the exchange: NOT_FOUND when no shim of that pid is
  // connected, UNAVAILABLE when the connection dropped before the reply,
  // DEADLINE_EXCEEDED after `timeout`.
  virtual absl::StatusOr<v1::Reply> Call(pid_t pid, v1::MigratorToShim request,
                                         absl::Duration timeout) = 0;

  // Waits until `pid` has no open connection (a shim closes its socket
  // after replying to release). DEADLINE_EXCEEDED after `timeout`.
  virtual absl::Status WaitClosed(pid_t pid, absl::Duration timeout) = 0;

  // Waits until `pid` is connected and said Hello with `phase`.
  // DEADLINE_EXCEEDED after `timeout`.
  virtual absl::StatusOr<ShimInfo> WaitHello(pid_t pid, v1::EndpointPhase phase,
                                             absl::Duration timeout) = 0;

  // Creates (present) or removes the resume marker of `pid`: a released
  // shim waits, holding no fd, until its marker exists, then reconnects and
  // says Hello with phase RELEASED.
  virtual absl::Status SetResumeMarker(pid_t pid, bool present) = 0;
};

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_TRANSPORT_SHIM_CHANNEL_H_
