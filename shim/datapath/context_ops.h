// Installs the shim's entries in shadow objects: a context's post and
// poll entries (data_path.h's tables, by what the process is) and its
// own ops (query_port, create_cq_ex, ..., which pass into the Shim, and
// the unsupported ones, which fail as a device without them would), and a
// QP's or CQ's extended entries where the real object has them.
//
// Thread-safety: called by the Shim with its mutex held, on a shadow the
// application does not hold yet, except InstallTranslatingOps (see
// there). Nothing fails.
#ifndef RDMAVIRT_SHIM_DATAPATH_CONTEXT_OPS_H_
#define RDMAVIRT_SHIM_DATAPATH_CONTEXT_OPS_H_

#include "shim/core/objects.h"

namespace rdmavirt::shim {

// Fills a new shadow context's ops and verbs_context entry points: those
// of a process the migrator may move (`pausable`) raise the thread's mark,
// except posts and polls on the marked path when `probed`
// (thread_probe.h): those jump into the provider.
void InstallContextOps(Context* ctx, bool pausable, bool probed);
// A probed process's context whose queues translate (offset mode, or the
// process has moved): its post and poll entries compare the translating
// path first. Either entry is right on every path; this only orders the
// compares. Safe while application threads post and poll.
void InstallTranslatingOps(Context* ctx);
// Fills a shadow QP's ibv_qp_ex function pointers where the real QP has them.
void InstallQpExOps(Qp* qp);
// Fills a shadow CQ's ibv_cq_ex function pointers where the real CQ has them.
void InstallCqExOps(Cq* cq);

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_DATAPATH_CONTEXT_OPS_H_
