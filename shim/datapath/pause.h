// The pause of a migratable process's data path, paid for by the pause.
//
// Each application thread has a mark, in its own thread-local storage,
// that it raises while it is inside a post or a poll (or a polling or
// work-request batch) and lowers when it leaves: plain stores to memory no
// other thread writes. Each queue and CQ has a `paused` flag. The control
// thread sets the flags of the objects it pauses with plain stores, then
// makes every thread of the process pass a full memory barrier
// (membarrier(2), MEMBARRIER_CMD_PRIVATE_EXPEDITED), then waits until no
// other thread's mark is raised. A thread that raised its mark before that
// barrier is seen by the wait; one that reads a flag after it sees it set.
// So the data path needs no locked instruction and no fence of its own:
// the asymmetric fence moves the cost of ordering to the rare side.
// A process whose pause probes its threads (thread_probe.h, the default)
// raises no mark for a post or poll on the marked path: it jumps into the
// provider, and the pause asks each thread where it is after Close.
//
// Thread safety: the data-path helpers on application threads, Close and
// Open on one control thread at a time (the shim's mutex).
#ifndef RDMAVIRT_SHIM_DATAPATH_PAUSE_H_
#define RDMAVIRT_SHIM_DATAPATH_PAUSE_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "shim/core/mutex.h"

namespace rdmavirt::shim {

// One thread's in-call mark. Written only by its thread; read by the
// control thread while the thread is registered.
struct ThreadMark {
  static constexpr uint16_t kUnregistered = 0xffff;  // no PathState's word

  std::atomic<uint32_t> depth{0};    // inside a post, poll or notify: 0 or 1
  std::atomic<uint32_t> batches{0};  // open ibv_wr_start / ibv_start_poll batches
  bool registered = false;           // the control thread knows this mark
  // The PathState word of an object on the marked path and not paused
  // once registered, else a word no object has: the fast entry checks
  // the object and the registration with one compare.
  uint16_t marked_word = kUnregistered;
  // The same for the translating path (EnterGate).
  uint16_t translated_word = kUnregistered;
};

// The calling thread's mark. Initial-exec TLS: the shim is preloaded, so
// the access is a load of the offset and an %fs-relative store.
extern __thread ThreadMark tls_thread_mark __attribute__((tls_model("initial-exec")));

// Makes the calling thread's mark known to the control thread (its first
// gated call; the slow path). Unregistered again when the thread exits.
void RegisterThreadMark();

// True when the kernel offers the asymmetric fence (Linux 4.14 and later,
// unless a seccomp filter refuses membarrier); registers the process for it.
bool AsymmetricFenceAvailable();

// Makes every other running thread of the process pass a full memory
// barrier (membarrier(2), MEMBARRIER_CMD_PRIVATE_EXPEDITED), registering
// the process first if it is not. False when the kernel refuses.
bool FenceOtherThreads();

// How a queue's or CQ's data path runs (data_path.cc).
enum class Path : uint8_t {
  // A tail call to the provider: nothing to translate, never paused.
  kDirect,
  // The provider's call inside the thread's mark: nothing to translate or
  // count, but the process may be paused.
  kMarked,
  // Identities translated, counts kept for the drain (UD sends, SRQ
  // receives), inside the thread's mark if the process may be paused.
  kTranslated,
};

// A queue's or CQ's Path (low byte), its pause flag and a CQ's long way,
// in one word: a migratable post or poll checks them with one compare.
class PathState {
 public:
  static constexpr uint16_t kPausedBit = 0x100;
  // A CQ's polls take the long way (data_path.cc, PollTranslatedSlow):
  // completions a pause held to hand out, a drain's late markers to drop,
  // or a way back to the marked path once they are out. Set with
  // kTranslated only, and only while the CQ's process is paused (or the
  // CQ unpublished); a poller clears it. The translating entries compare
  // the word with kTranslated's: with it set, they take the gated path,
  // which tests it, and the common poll tests nothing more.
  static constexpr uint16_t kLongWayBit = 0x200;

  Path get() const { return static_cast<Path>(bits_.load(std::memory_order_relaxed) & 0xff); }
  bool paused() const { return bits_.load(std::memory_order_relaxed) & kPausedBit; }
  bool long_way() const { return bits_.load(std::memory_order_relaxed) & kLongWayBit; }
  // On path `p` and not paused.
  bool Is(Path p) const {
    return bits_.load(std::memory_order_relaxed) == static_cast<uint16_t>(p);
  }
  // The whole word is `word` (EnterMarked).
  bool Equals(uint16_t word) const { return bits_.load(std::memory_order_relaxed) == word; }
  // The whole word, read once (the probed entries compare it twice). An
  // acquire: what a probed entry reads of its object after the word (the
  // real QP or CQ and the provider's entry) is not read before it, where
  // a thread that stalled across a pause and its release could have read
  // what the release freed.
  uint16_t word() const { return bits_.load(std::memory_order_acquire); }
  // The path; the pause flag and the long way are kept.
  void Set(Path p) { Replace(kPausedBit | kLongWayBit, static_cast<uint16_t>(p)); }
  // kTranslated, the long way taken (control thread: while paused, or
  // before the CQ is published); the pause flag is kept.
  void SetLongWay() { Replace(kPausedBit, kLongWayBit | static_cast<uint16_t>(Path::kTranslated)); }
  // A poller that found nothing left for the long way: from kTranslated
  // on the long way to `to`, unless paused or changed meanwhile (the next
  // poll takes the long way again).
  bool EndLongWay(Path to) {
    uint16_t expected = kLongWayBit | static_cast<uint16_t>(Path::kTranslated);
    return bits_.compare_exchange_strong(expected, static_cast<uint16_t>(to));
  }
  // Control thread (pause.h's protocol: set, then PauseGate::Close).
  void SetPaused(bool on) {
    if (on)
      bits_.fetch_or(kPausedBit);
    else
      bits_.fetch_and(static_cast<uint16_t>(~kPausedBit));
  }

 private:
  // The word's `keep` bits, the rest replaced by `bits`.
  void Replace(uint16_t keep, uint16_t bits) {
    uint16_t old = bits_.load();
    while (!bits_.compare_exchange_weak(old, static_cast<uint16_t>((old & keep) | bits))) {
    }
  }
  std::atomic<uint16_t> bits_{static_cast<uint16_t>(Path::kTranslated)};
};

// ---- The data path.

// The fast entry of a migratable process's call: raises the thread's mark
// and says whether the object is on the marked path and not paused, and
// the thread registered. False (mark lowered): take the slow path.
inline bool EnterMarked(const PathState& s) {
  ThreadMark& m = tls_thread_mark;
  m.depth.store(1, std::memory_order_relaxed);
  // Ordered against the loads below by the control thread's membarrier.
  std::atomic_signal_fence(std::memory_order_seq_cst);
  if (s.Equals(m.marked_word)) [[likely]]  // registered, marked, not paused
    return true;
  m.depth.store(0, std::memory_order_relaxed);
  return false;
}
// A migratable process's entry that also takes translating queues (a
// process after a move, or with UD QPs) without lowering and raising the
// mark again: which path the call may run inside the raised mark, or
// kSlow (mark lowered): paused, or the thread not yet registered.
enum class Gate : uint8_t { kMarked, kTranslated, kSlow };
inline Gate EnterGate(const PathState& s) {
  ThreadMark& m = tls_thread_mark;
  m.depth.store(1, std::memory_order_relaxed);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  if (s.Equals(m.marked_word)) [[likely]]
    return Gate::kMarked;
  if (s.Equals(m.translated_word)) return Gate::kTranslated;
  m.depth.store(0, std::memory_order_relaxed);
  return Gate::kSlow;
}
// EnterGate for a caller that knows the object is not on the marked path
// (the probed entries, data_path.cc): whether it translates inside the
// raised mark; false (mark lowered): the slow path.
inline bool EnterTranslated(const PathState& s) {
  ThreadMark& m = tls_thread_mark;
  m.depth.store(1, std::memory_order_relaxed);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  if (s.Equals(m.translated_word)) [[likely]]
    return true;
  m.depth.store(0, std::memory_order_relaxed);
  return false;
}
inline void LeaveFast() {
  // Release: what the call did is visible before the mark falls.
  tls_thread_mark.depth.store(0, std::memory_order_release);
}

// The slow entry: registers the thread if needed; false when paused.
inline bool Enter(const PathState& s) {
  ThreadMark& m = tls_thread_mark;
  if (!m.registered) RegisterThreadMark();
  m.depth.store(1, std::memory_order_relaxed);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  if (s.paused()) {
    m.depth.store(0, std::memory_order_relaxed);
    return false;
  }
  return true;
}

// A batch keeps the mark raised across calls (nested in a post or poll).
inline bool EnterBatch(const PathState& s) {
  ThreadMark& m = tls_thread_mark;
  if (!m.registered) RegisterThreadMark();
  m.batches.store(m.batches.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  if (s.paused()) {
    m.batches.store(m.batches.load(std::memory_order_relaxed) - 1, std::memory_order_relaxed);
    return false;
  }
  return true;
}
inline void LeaveBatch() {
  ThreadMark& m = tls_thread_mark;
  m.batches.store(m.batches.load(std::memory_order_relaxed) - 1, std::memory_order_release);
}

// ---- The control thread.
class PauseGate {
 public:
  // After the caller has set the `paused` flags of the objects to pause:
  // waits until no thread but the caller is inside a gated call. Fails
  // (`error` says why; the caller clears the flags) when the fence is
  // unavailable or a thread stays inside a call (a polling batch never
  // ended, say) for `timeout_ms`.
  bool Close(uint32_t timeout_ms, std::string* error);
  // Whether objects created now start paused; set by Close, cleared by Open.
  bool closed() const { return closed_.load(std::memory_order_acquire); }
  void Open() { closed_.store(false, std::memory_order_release); }

  // Guards the queues of posts made while paused (objects.h): a post that
  // finds its object paused queues under it, and the resume replays the
  // queues and clears the flags under it, so no post overtakes one that
  // was queued.
  Mutex& queue_mu() ABSL_LOCK_RETURNED(queue_mu_) { return queue_mu_; }

 private:
  std::atomic<bool> closed_{false};
  Mutex queue_mu_;
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_DATAPATH_PAUSE_H_
