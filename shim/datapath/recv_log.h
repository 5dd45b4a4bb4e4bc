// RecvLog: the receive WRs last posted to one receive queue (a QP's or an
// SRQ's), as the application posted them (virtual lkeys), in posting order.
//
// It holds at least as many WRs as the queue can have outstanding, so the
// outstanding ones are always among them: at release the shim flushes the
// queue (the QP goes to the error state) and the flushed completions, which
// come back in posting order, name exactly which of the recent posts to
// re-post elsewhere. So completions need no bookkeeping here, and polling
// stays free of it. The translating completion path also uses it to find
// the buffer a UD receive landed in (to rewrite its GRH), from whichever
// thread polls (Consume).
//
// A fixed ring sized at creation: posting touches no allocator.
//
// Who writes it. Verbs let several threads post to one queue at once (an
// SRQ that worker threads replenish, say). The provider serializes their
// calls under its own lock, but the ring is written before the call, and
// its order must be the provider's: so one thread at a time writes the
// ring and calls the provider (Writer). The first thread that posts to the
// queue owns it, and its posts take no lock: once it has seen that it owns
// the queue, it raises `busy_` (a plain store; no other thread writes it)
// across the write and the call, and checks again that it owns it. The first post of any other
// thread makes the queue shared for good: under `mu_` it takes the
// ownership away, makes every thread pass a full barrier (membarrier(2))
// and waits for the owner's post in progress, if any, to end; from then on
// every post takes `mu_`. An owner that raised `busy_` before that barrier
// is waited for; one that checks after it sees that it owns nothing. So
// the post of a queue one thread posts to costs two loads and compares of
// the owner and two stores more, and no locked instruction. A process
// where membarrier(2) is refused (a kernel older than 4.14, a seccomp
// filter) has every queue shared from the start. The thread pointer
// tells threads apart: threads made without a TLS of their own (raw
// clone(2)) are not told apart.
#ifndef RDMAVIRT_SHIM_DATAPATH_RECV_LOG_H_
#define RDMAVIRT_SHIM_DATAPATH_RECV_LOG_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "shim/core/mutex.h"

namespace rdmavirt::shim {

class RecvLog {
 public:
  struct Entry {
    uint64_t wr_id;
    uint32_t num_sge;
    ibv_sge sge[1];  // num_sge of them (the stride holds max_sge)
  };

  // The calling thread's identity: its thread pointer (%fs:0 on x86-64),
  // one load, distinct among the threads alive at any time.
  static uintptr_t ThisThread() { return reinterpret_cast<uintptr_t>(__builtin_thread_pointer()); }

  // The right to write the ring and post, for one post (see the top).
  class Writer {
   public:
    // Holds mu_ from here to the destructor only when the queue is not
    // this thread's own: a lock taken on one condition, which the analysis
    // cannot follow.
    explicit Writer(RecvLog* log) ABSL_NO_THREAD_SAFETY_ANALYSIS : log_(log),
                                                                   owned_(log->BeginOwned()) {
      if (!owned_) log_->LockShared();
    }
    ~Writer() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      if (owned_)
        log_->EndOwned();
      else
        log_->mu_.Unlock();
    }
    Writer(const Writer&) = delete;
    Writer& operator=(const Writer&) = delete;

   private:
    RecvLog* const log_;
    const bool owned_;
  };

  // Data path: true when the calling thread owns the queue, which it then
  // may write until EndOwned; false (nothing held): take a Writer.
  bool BeginOwned() {
    const uintptr_t self = ThisThread();
    // Another thread writes nothing: `busy_` is the owner's alone.
    if (owner_.load(std::memory_order_relaxed) != self) [[unlikely]]
      return false;
    busy_.store(1, std::memory_order_relaxed);
    // Ordered against the load below by LockShared's barrier.
    std::atomic_signal_fence(std::memory_order_seq_cst);
    if (owner_.load(std::memory_order_relaxed) == self) [[likely]]
      return true;
    busy_.store(0, std::memory_order_relaxed);  // shared meanwhile
    return false;
  }
  void EndOwned() { busy_.store(0, std::memory_order_release); }
  // No thread has posted to the queue yet.
  bool unowned() const { return owner_.load(std::memory_order_relaxed) == 0; }
  // The queue's first post, outside a Writer: the calling thread owns the
  // queue unless another claimed it first (one compare-and-swap in the
  // queue's life).
  void Claim() {
    uintptr_t none = 0;
    owner_.compare_exchange_strong(none, ThisThread());
  }

  // While no thread can post to the queue (its pause): the calling thread
  // writes the ring as its owner, and the owner it had is put back after.
  class Quiesced {
   public:
    explicit Quiesced(RecvLog* log)
        : log_(log), saved_(log->owner_.load(std::memory_order_relaxed)) {
      if (saved_ != kShared) log_->owner_.store(ThisThread(), std::memory_order_relaxed);
    }
    ~Quiesced() { log_->owner_.store(saved_, std::memory_order_relaxed); }
    Quiesced(const Quiesced&) = delete;
    Quiesced& operator=(const Quiesced&) = delete;

   private:
    RecvLog* const log_;
    const uintptr_t saved_;
  };

  // Whether every post takes the lock: more than one thread has posted to
  // the queue, or the process has no barrier to take it from its owner.
  bool shared() const { return owner_.load(std::memory_order_relaxed) == kShared; }

  // Capacity for max_wr receives of up to max_sge SGEs; `consumed`: the
  // translating completion path may look posts up (Consume: a UD QP's
  // queue, an SRQ). False on ENOMEM.
  bool Init(uint32_t max_wr, uint32_t max_sge, bool consumed) {
    // Consume reads all but the oldest; a completion may be polled long
    // after its post (a slow poller of one of an SRQ's CQs while the
    // others repost), so a looked-up queue keeps 4 times its depth.
    const uint64_t need = (consumed ? 4 : 1) * (uint64_t{max_wr} + 2);
    uint64_t cap = 1;
    while (cap < need) cap <<= 1;
    max_sge_ = max_sge ? max_sge : 1;
    stride_ = (offsetof(Entry, sge) + sizeof(ibv_sge) * max_sge_ + 7) & ~size_t{7};
    buf_.reset(new (std::nothrow) uint8_t[stride_ * cap]);
    if (consumed) taken_.reset(new (std::nothrow) std::atomic<uint64_t>[cap]());
    mask_ = static_cast<uint32_t>(cap - 1);
    // Without the barrier nothing can be taken from an owner safely: every
    // post takes the lock from the start.
    if (!FenceUsable()) owner_.store(kShared, std::memory_order_relaxed);
    return buf_ != nullptr && (!consumed || taken_ != nullptr);
  }

  // Data path: records a WR about to be posted (overwriting the oldest).
  // False, recording nothing, when it has more SGEs than the queue takes:
  // the provider refuses it too.
  bool Push(const ibv_recv_wr* wr) {
    if (wr->num_sge == 1) [[likely]] {
      PushSingle(wr);
      return true;
    }
    if (static_cast<uint32_t>(wr->num_sge) > max_sge_) [[unlikely]]
      return false;
    Entry* e = At(tail_);
    e->wr_id = wr->wr_id;
    const uint32_t n = static_cast<uint32_t>(wr->num_sge);
    e->num_sge = n;
    for (uint32_t i = 0; i < n; ++i) e->sge[i] = wr->sg_list[i];
    ++tail_;
    return true;
  }
  // The common case of Push: a WR known to have one SGE, which every
  // stride holds.
  void PushSingle(const ibv_recv_wr* wr) {
    Entry* e = At(tail_);
    e->wr_id = wr->wr_id;
    e->num_sge = 1;
    e->sge[0] = wr->sg_list[0];
    ++tail_;
  }
  // Receives recorded so far (64 bits: 0 means none ever, even after 2^32).
  uint64_t posted() const { return tail_; }
  // Forgets the last `n` pushes (the provider refused them).
  void Unpush(uint32_t n) { tail_ -= n; }

  // What Consume hands out: the first SGEs of the post a completion took,
  // copied (the ring's slot may be written again once handed out).
  struct Taken {
    static constexpr uint32_t kMaxSge = 4;  // a GRH's 40 bytes lie in them
    uint32_t num_sge;
    ibv_sge sge[kMaxSge];
  };

  // Translating completion path only, from any thread (pollers of one CQ,
  // or of CQs whose QPs share an SRQ): a post with this wr_id that no
  // completion took yet, taken: the first after the last post taken (a
  // QP's receives complete in posting order), else the nearest before it.
  // False when there is none in the ring (or only in a slot a later post
  // may be writing), or when Init was not told the queue's posts are
  // looked up.
  bool Consume(uint64_t wr_id, Taken* out);

  // Consume() starts after every post recorded so far: when the queue's
  // outstanding receives are taken out to be posted again (and recorded
  // again), so that the old records of the same WRs are not found first.
  void ConsumeAll() {
    floor_.store(tail_);
    next_.store(tail_, std::memory_order_relaxed);
  }

  // The last `n` posts, oldest first (n is capped by what the ring holds).
  std::vector<const Entry*> Recent(uint32_t n) const {
    if (n > tail_) n = static_cast<uint32_t>(tail_);
    if (n > mask_ + 1) n = mask_ + 1;
    std::vector<const Entry*> out;
    for (uint64_t i = tail_ - n; i != tail_; ++i) out.push_back(At(i));
    return out;
  }

 private:
  static constexpr uintptr_t kShared = 1;  // no thread's pointer

  uint64_t Capacity() const { return uint64_t{mask_} + 1; }
  Entry* At(uint64_t i) const { return reinterpret_cast<Entry*>(&buf_[(i & mask_) * stride_]); }

  // Consume at post i: taken and copied if it is this WR's, untaken and
  // whole (recv_log.cc).
  bool TakeAt(uint64_t i, uint64_t wr_id, Taken* out);

  // Whether membarrier(2)'s private expedited barrier works in this
  // process (asked once; recv_log.cc).
  static bool FenceUsable();

  // Holds `mu_`: the first poster of the queue takes it; any other makes
  // it shared, once the owner's post in progress is over (recv_log.cc).
  void LockShared() ABSL_EXCLUSIVE_LOCK_FUNCTION(mu_);

  // Written by the owner only: raised across its post. First, so that
  // its address is the log's own (the post keeps one register for both).
  std::atomic<uint32_t> busy_{0};
  std::unique_ptr<uint8_t[]> buf_;
  size_t stride_ = 0;
  uint32_t max_sge_ = 0;
  uint32_t mask_ = 0;
  // Posts so far: written by the writer of the moment with plain stores
  // (one instruction), also read by Consume on any thread, which checks
  // what it read against it.
  uint64_t tail_ = 0;
  // Consume's: per slot, 1 + the position of the last post taken from it
  // (a slot written again holds a later post, which none took yet); where
  // its search starts, after the last post taken; and the first post it
  // may take (ConsumeAll).
  std::unique_ptr<std::atomic<uint64_t>[]> taken_;
  std::atomic<uint64_t> next_{0};
  std::atomic<uint64_t> floor_{0};
  // The owning thread's pointer, 0 before the first post, or kShared.
  std::atomic<uintptr_t> owner_{0};
  Mutex mu_;  // every post of a shared queue; claiming and sharing it
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_DATAPATH_RECV_LOG_H_
