// The pause of a migratable process's data path, paid for by the pause.
//
// Each application thread has a mark that it raises while it is inside a
// post or a poll (or a polling or work-request batch) and lowers when it
// leaves: plain stores to a cache line no other thread writes. The control
// thread closes the gate with one store, then makes every thread of the
// process pass a full memory barrier (membarrier(2),
// MEMBARRIER_CMD_PRIVATE_EXPEDITED), then waits until no other thread's
// mark is raised. A thread that raised its mark before that barrier is
// seen by the wait; one that reads the gate after it sees it closed. So the
// data path needs no locked instruction and no fence of its own: the
// asymmetric fence moves the cost of ordering to the rare side.
//
// Thread safety: Enter/Leave on application threads, Close/Open on one
// control thread at a time (the shim's mutex). Marks are never freed; a
// thread's mark is reused by a later thread once it has exited.
#ifndef RDMAVIRT_SHIM_PAUSE_H_
#define RDMAVIRT_SHIM_PAUSE_H_

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

namespace rdmavirt::shim {

// One thread's in-call mark: how deep it is inside gated data-path calls.
// Written only by its thread; read by the control thread.
struct alignas(64) ThreadMark {
  std::atomic<uint32_t> depth{0};
  bool in_use = false;  // owned by a live thread (guarded by the registry's mutex)
};

// The calling thread's mark, null until its first gated call. Initial-exec
// TLS: the shim is preloaded, so the access is one load from %fs.
extern __thread ThreadMark* tls_thread_mark __attribute__((tls_model("initial-exec")));

// Gives the calling thread a mark (first gated call of the thread).
ThreadMark* RegisterThreadMark();

// True when the kernel offers the asymmetric fence (Linux 4.14 and later,
// unless a seccomp filter refuses membarrier); registers the process for it.
bool AsymmetricFenceAvailable();

class PauseGate {
 public:
  // Data path. Raises the thread's mark; nullptr (mark lowered again) when
  // the gate is closed. Leave with the mark it returned.
  ThreadMark* Enter() const {
    ThreadMark* m = tls_thread_mark;
    if (m == nullptr) [[unlikely]]
      m = RegisterThreadMark();
    m->depth.store(m->depth.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    // Ordered against the load below by the control thread's membarrier.
    std::atomic_signal_fence(std::memory_order_seq_cst);
    if (closed_.load(std::memory_order_relaxed)) [[unlikely]] {
      Leave(m);
      return nullptr;
    }
    return m;
  }
  static void Leave(ThreadMark* m) {
    // Release: what the call did is visible before the mark falls.
    m->depth.store(m->depth.load(std::memory_order_relaxed) - 1, std::memory_order_release);
  }
  bool closed() const { return closed_.load(std::memory_order_acquire); }

  // Control thread. Closes the gate and waits until no thread but the
  // caller is inside a gated call. Fails (the gate open again, `error`
  // saying why) when the fence is unavailable or a thread stays inside a
  // call (a polling batch never ended, say) for `timeout_ms`.
  bool Close(uint32_t timeout_ms, std::string* error);
  void Open() { closed_.store(false, std::memory_order_release); }

  // Guards the queues of posts made while the gate is closed (objects.h):
  // a post that finds the gate closed queues under it, and the resume
  // replays the queues and opens the gate under it, so no post overtakes
  // one that was queued.
  std::mutex& queue_mu() { return queue_mu_; }

 private:
  std::atomic<bool> closed_{false};
  std::mutex queue_mu_;
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_PAUSE_H_
