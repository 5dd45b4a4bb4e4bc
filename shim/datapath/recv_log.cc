#include "shim/datapath/recv_log.h"

#include <sched.h>

#include <algorithm>

#include "shim/core/log.h"
#include "shim/datapath/pause.h"

namespace rdmavirt::shim {

bool RecvLog::FenceUsable() {
  static const bool usable = AsymmetricFenceAvailable();
  return usable;
}

void RecvLog::LockShared() {
  mu_.Lock();
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

namespace {

// A word the queue's writer may be writing (a slot, the post count),
// read whole: Consume checks what it copied against the post count read
// after it. The writer's stores are plain (x86-64 makes aligned ones
// whole, and keeps them in order; the provider's call between two posts
// keeps the compiler from moving them). Each read is an acquire (a plain
// load on x86-64), so the count read last is read after the copy.
template <typename T>
T ReadRacing(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

}  // namespace

bool RecvLog::Consume(uint64_t wr_id, Taken* out) {
  if (taken_ == nullptr) return false;
  const uint64_t tail = ReadRacing(&tail_);
  const uint64_t cap = Capacity();
  // Not the oldest slot (the next post may be writing it already), nor
  // what ConsumeAll put out of reach.
  const uint64_t lo = std::max(tail >= cap ? tail - cap + 1 : 0, floor_.load());
  if (lo >= tail) return false;
  const uint64_t hint = std::clamp(next_.load(std::memory_order_relaxed), lo, tail);
  // A QP's receives complete in posting order: the completion's post is
  // usually the first after the last one taken. One that an SRQ handed
  // to a QP whose CQ was polled later lies behind it, nearest first.
  for (uint64_t i = hint; i != tail; ++i)
    if (TakeAt(i, wr_id, out)) return true;
  for (uint64_t i = hint; i-- > lo;)
    if (TakeAt(i, wr_id, out)) return true;
  return false;
}

bool RecvLog::TakeAt(uint64_t i, uint64_t wr_id, Taken* out) {
  const Entry* e = At(i);
  if (ReadRacing(&e->wr_id) != wr_id) return false;
  std::atomic<uint64_t>& taken = taken_[i & mask_];
  uint64_t was = taken.load(std::memory_order_relaxed);
  // Another poller's completion took this post: the next one may be ours.
  if (was == i + 1 || !taken.compare_exchange_strong(was, i + 1)) return false;
  const uint32_t n = ReadRacing(&e->num_sge);
  out->num_sge = n < Taken::kMaxSge ? n : Taken::kMaxSge;
  for (uint32_t k = 0; k < out->num_sge; ++k) {
    out->sge[k].addr = ReadRacing(&e->sge[k].addr);
    out->sge[k].length = ReadRacing(&e->sge[k].length);
    out->sge[k].lkey = ReadRacing(&e->sge[k].lkey);
  }
  // The copy holds post i unless post i + cap (same slot) had begun: its
  // writer had published tail_ == i + cap before it wrote the slot. Then
  // another post of the same WR may be the one.
  if (ReadRacing(&tail_) - i >= Capacity()) return false;
  uint64_t next = next_.load(std::memory_order_relaxed);
  while (next < i + 1 && !next_.compare_exchange_weak(next, i + 1)) {
  }
  return true;
}

}  // namespace rdmavirt::shim
