// The control-step gate of a migratable process (control_gate.cc): Shim
// members, declared in shim.h, defined here.
//
// It owns
// - Shim::ControlScope, which every control verb but the data path and the
//   event waits enters once it knows its object is the endpoint's: from a
//   release until the resume it waits there for the endpoint to be back,
//   running meanwhile a step left for an application thread;
// - CloseControl/OpenControl, by which a release waits for the verbs
//   inside to return and the resume lets them in again;
// - RunStep, ControlBusy/ControlIdle: a migration step runs marked as one
//   (it passes the gate), and first waits for the destroys inside;
// - OnAppThread, RunPendingStep, WakeEventWaiters: a step runs on an
//   application thread once the process was restored (ib_uverbs refuses
//   the control thread's writes then), handed over through Shim::task_.
//
// Thread-safety: the control thread calls CloseControl, OpenControl,
// RunStep and OnAppThread, one at a time; any thread enters a
// ControlScope or runs a pending step (a post or poll while paused).
// State under control_mu_, never held across a verb or a step.
// Failure: DEADLINE_EXCEEDED when a verb inside (or a step an application
// thread took up) outlasts its bound, with the gate left as it was;
// UNAVAILABLE for a step asked while another still runs.
#ifndef RDMAVIRT_SHIM_MIGRATION_CONTROL_GATE_H_
#define RDMAVIRT_SHIM_MIGRATION_CONTROL_GATE_H_

#include "shim/core/shim.h"

#endif  // RDMAVIRT_SHIM_MIGRATION_CONTROL_GATE_H_
