// The restore half of a migration (restore.cc): Shim members, declared in
// shim.h, defined there.
//
// It owns
// - Restore, RestoreNow and RecreateReal: open the device, re-create every
//   hardware resource under the same virtual identities, with the fds
//   under the numbers the application knows, re-post the receives the
//   release counted and replay each QP's transitions (ReplayTransitions);
// - Resume and ResumeNow: replay the posts queued during the pause, arm
//   the CQs the application armed (ArmForResume, OweEvents), and lift the
//   pause;
// - PeerReconnect, PeerReconnectNow and Reconnect: re-point QPs and AHs at
//   peers that moved;
// - RelayWrites/DropRelay (a re-opened device's write relay) and
//   ReopenChannel, LogResume.
//
// Thread-safety: called by the control thread, one step at a time; each
// step runs through the control gate (control_gate.h), on an application
// thread once the process was restored, with mu_ held. Failure: a Status
// (status.h); a failed restore destroys what it re-created and leaves the
// endpoint released, as before.
#ifndef RDMAVIRT_SHIM_MIGRATION_RESTORE_H_
#define RDMAVIRT_SHIM_MIGRATION_RESTORE_H_

#include "shim/core/shim.h"

#endif  // RDMAVIRT_SHIM_MIGRATION_RESTORE_H_
