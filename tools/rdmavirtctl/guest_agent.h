// What rdmavirtctl asks of a guest through its QEMU guest agent: to run a
// command (guest-exec), above all the guest-side command (rdmavirt-guest)
// that suspends or resumes every RDMA endpoint of the guest through the
// guest's own rdmavirt-migratord, and the addresses of its interfaces.
// Each call needs a domain of a connection Open made (libvirt.h) and
// blocks the calling thread until the agent answers or the time is up.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_GUEST_AGENT_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_GUEST_AGENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rdmavirt/v1/migrator.pb.h"
#include "tools/rdmavirtctl/libvirt.h"

namespace rdmavirt::ctl {

// `guest_command ARGS` in the guest (ARGS end with --json); its
// GuestReport. ABORTED naming the command, its exit code and its error
// when it fails or prints no report; UNAVAILABLE when the agent does not
// answer, DEADLINE_EXCEEDED after 3 minutes.
absl::StatusOr<v1::GuestReport> GuestStep(virDomainPtr d, const std::string& guest_command,
                                          const std::vector<std::string>& args);

// The fabric address (a.b.c.d/len) the guest has on interface MAC, from
// its agent; "" when the agent does not say.
std::string GuestAddress(virDomainPtr d, const std::string& mac);

// Waits until the guest agent answers (after a revert the agent channel
// comes back with the guest); DEADLINE_EXCEEDED with the last error.
absl::Status WaitAgent(virDomainPtr d, absl::Duration timeout);

// The longest RDMA blackout of the endpoints in `r`.
uint64_t LongestBlackout(const v1::GuestReport& r);

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_GUEST_AGENT_H_
