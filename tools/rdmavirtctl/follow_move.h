// How rdmavirtctl follows a process move (migrate, checkpoint, restore):
// the migrator's Progress stream as lines on stderr, its report on stdout,
// and what it means when the migrator goes away in the middle. Called from
// the main thread; blocks until the move has ended.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_FOLLOW_MOVE_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_FOLLOW_MOVE_H_

#include <memory>

#include "grpcpp/grpcpp.h"
#include "rdmavirt/v1/migrator.pb.h"
#include "tools/rdmavirtctl/args.h"
#include "tools/rdmavirtctl/cli.h"

namespace rdmavirt::ctl {

// Reads `reader` to its end: progress on stderr, the report at the end.
// When the daemon goes away in the middle (killed, restarted), says what
// that means and, with --wait, waits up to 10 minutes for the restarted
// daemon's outcome of the move. Exit code: kOk, kFailed when the move
// failed, kUnreachable when the daemon went away (and, with --wait, did not
// say how the move ended).
int FollowMove(Client* c, const Args& args, const char* what,
               std::unique_ptr<grpc::ClientReaderInterface<v1::Progress>> reader);

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_FOLLOW_MOVE_H_
