#include "shim/recv_log.h"

#include <sched.h>

#include "shim/log.h"
#include "shim/pause.h"

namespace rdmavirt::shim {

bool RecvLog::FenceUsable() {
  static const bool usable = AsymmetricFenceAvailable();
  return usable;
}

void RecvLog::LockShared() {
  mu_.lock();
  uintptr_t owner = 0;
  // The queue's first post: this thread owns it from now on.
  if (owner_.compare_exchange_strong(owner, ThisThread())) return;
  if (owner == kShared) return;
  owner_.store(kShared, std::memory_order_seq_cst);
  // The owner raised `busy_` before this barrier (and is waited for), or
  // reads `owner_` after it (and takes `mu_`).
  if (!FenceOtherThreads())
    LogOnce(
        "membarrier failed: a receive queue posted to by several threads is shared "
        "without the barrier");
  while (busy_.load(std::memory_order_acquire) != 0) sched_yield();
}

}  // namespace rdmavirt::shim
