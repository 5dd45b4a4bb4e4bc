// The slot through which one thread's probe handler answers the control
// thread that asked it (thread_probe.cc). The control thread opens it for
// probe `seq` before it sends the signal; the handler that probe reaches
// fills it once. A handler of an earlier probe that finishes late (its
// thread was passed over because it showed the signal blocked, which a
// handler that has just begun also does) finds the slot opened for
// another probe and leaves that probe's answer alone: a plain store would
// overwrite it, and the control thread would wait for an answer already
// given until its deadline.
#ifndef RDMAVIRT_SHIM_DATAPATH_PROBE_ANSWER_H_
#define RDMAVIRT_SHIM_DATAPATH_PROBE_ANSWER_H_

#include <atomic>
#include <cstdint>

namespace rdmavirt::shim {

class ProbeAnswer {
 public:
  // What Read() returns while probe `seq` has not answered.
  static constexpr uint8_t kNone = 0xff;

  // From the control thread, before probe `seq` (never 0) is sent.
  void Open(uint32_t seq) { slot_.store(Key(seq) | kNone, std::memory_order_release); }

  // From the handler (lock-free, async-signal-safe): whether probe `seq`
  // is the one awaited, so that its answer is worth working out.
  bool Awaits(uint32_t seq) const {
    return slot_.load(std::memory_order_acquire) == (Key(seq) | kNone);
  }

  // From the handler: answers probe `seq` with `verdict` (not kNone);
  // false if it is not the awaited one or has answered already.
  bool Answer(uint32_t seq, uint8_t verdict) {
    uint64_t open = Key(seq) | kNone;
    return slot_.compare_exchange_strong(open, Key(seq) | verdict, std::memory_order_acq_rel,
                                         std::memory_order_acquire);
  }

  // Probe `seq`'s answer, or kNone while there is none.
  uint8_t Read(uint32_t seq) const {
    const uint64_t a = slot_.load(std::memory_order_acquire);
    return (a >> 8) == seq ? static_cast<uint8_t>(a & 0xff) : kNone;
  }

 private:
  static uint64_t Key(uint32_t seq) { return uint64_t{seq} << 8; }

  std::atomic<uint64_t> slot_{0};
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_DATAPATH_PROBE_ANSWER_H_
