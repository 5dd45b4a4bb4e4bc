// Named points of a move where a test may stop this migrator, so that it
// can be killed at a known step (lab fault tests: the source killed after
// its final dump, a destination or a peer's host killed before it is asked
// to resume or re-point). Read once from $RDMAVIRT_FAILPOINTS, a comma-
// separated list of points; unset, ReachFailpoint is one test of an empty
// set. At a listed point the daemon logs it and stops itself (SIGSTOP):
// the test kills it (SIGKILL) and restarts it, which is what an operator
// or systemd does to a migrator that died.
//
// Points:
//   phase:NAME           a move of this host's process enters phase NAME
//                        (prepare, precopy, dump, transfer, restore,
//                        reconnect, cleanup, rollback)
//   serve:reconnect      this host is asked to re-point its peers
//   serve:resume         this host is asked to resume an endpoint that
//                        arrived here
// Thread-safe.
#ifndef RDMAVIRT_MIGRATOR_HOST_FAILPOINTS_H_
#define RDMAVIRT_MIGRATOR_HOST_FAILPOINTS_H_

#include <string>

#include "absl/strings/string_view.h"

namespace rdmavirt::migrator {

void ReachFailpoint(absl::string_view point);

// The points set in this process, as given (for the startup log line).
std::string FailpointsSet();

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_HOST_FAILPOINTS_H_
