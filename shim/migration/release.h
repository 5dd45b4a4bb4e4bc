// The release half of a migration (release.cc): Shim members, declared in
// shim.h, defined there.
//
// It owns
// - Quiesce and DrainNow: pause every queue and CQ (SetPaused, the pause
//   gate, the thread probe's ProviderEntries), then wait for every send in
//   flight behind drain markers (PostSendMarker);
// - Release and ReleaseNow: count each queue's receives still posted from
//   their flushes (SettleUnacknowledgedReceives, FailAndCountRecvs),
//   acknowledge what the application has not (CloseEvents,
//   ReleaseChannel), destroy every hardware resource (DestroyReal), mark
//   the registered pages (dirty_pages.h) and stop the interval timers
//   (StopItimers; RestartItimers, their counterpart at the resume, lives
//   beside it);
// - EventFds and RealQpState, which the restore uses too.
//
// Thread-safety: called by the control thread, one step at a time; each
// step runs through the control gate (control_gate.h), possibly on an
// application thread, with mu_ held. Failure: a Status (status.h);
// DEADLINE_EXCEEDED leaves the endpoint paused, to be resumed.
#ifndef RDMAVIRT_SHIM_MIGRATION_RELEASE_H_
#define RDMAVIRT_SHIM_MIGRATION_RELEASE_H_

#include "shim/core/shim.h"

#endif  // RDMAVIRT_SHIM_MIGRATION_RELEASE_H_
