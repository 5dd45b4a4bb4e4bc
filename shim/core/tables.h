// The translation tables the data path reads: local lkeys by slot, and
// shadow QPs by physical QPN (for completions).
//
// Readers (post/poll, any thread) take no lock: entries are atomics loaded
// with relaxed order, which compiles to plain loads. Writers (the control
// path) hold Shim's mutex. A slot is published after the object it points
// at is complete and cleared before that object is freed.
#ifndef RDMAVIRT_SHIM_CORE_TABLES_H_
#define RDMAVIRT_SHIM_CORE_TABLES_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "shim/core/identity.h"
#include "shim/core/objects.h"

namespace rdmavirt::shim {

class MrTable {
 public:
  MrTable() : entries_(new std::atomic<uint64_t>[kMaxMrs + 1]()) {}

  // Virtual lkey -> physical lkey (MrLookup).
  uint32_t ToPhysical(uint32_t vlkey) const { return lookup().ToPhysical(vlkey); }
  // What the data path keeps of the table.
  MrLookup lookup() const { return MrLookup(entries_.get()); }

  // Control path, under the shim's mutex. Returns false when full.
  bool Allocate(uint32_t* slot) {
    for (uint32_t i = 0; i < kMaxMrs; ++i) {
      const uint32_t s = (next_ + i) % kMaxMrs;
      if (free(s) && !reserved(s)) {
        next_ = s + 1;
        *slot = s;
        return true;
      }
    }
    return false;
  }
  // Takes a given slot if it is free.
  bool Claim(uint32_t slot) {
    if (reserved(slot) || !free(slot)) return false;
    entries_[slot + 1].store(~uint64_t{0}, std::memory_order_relaxed);  // held until Set
    return true;
  }
  void Set(uint32_t slot, uint32_t vlkey, uint32_t plkey) {
    entries_[slot + 1].store(uint64_t{plkey} << 32 | vlkey, std::memory_order_release);
  }
  void Clear(uint32_t slot) { entries_[slot + 1].store(0, std::memory_order_release); }

 private:
  // Slot kMaxMrs-1 would make (slot+1) << 8 overflow into the next bits.
  static bool reserved(uint32_t s) { return s == kMaxMrs - 1; }
  bool free(uint32_t s) const { return entries_[s + 1].load(std::memory_order_relaxed) == 0; }
  // Slot s at s + 1 (MrLookup); entries 0 and kMaxMrs stay empty.
  std::unique_ptr<std::atomic<uint64_t>[]> entries_;
  uint32_t next_ = 0;
};

// Shadow QP by physical QPN: direct-mapped, with a short overflow list for
// the rare collision (live QPs whose numbers differ only above kBits). A
// free slot holds a QP no completion names (kNoQpn), so the completion
// path's lookup tests no null pointer. 16 bits: the home slot is the QPN's
// low half-word, taken with one zero-extending move.
class QpIndex {
 public:
  static constexpr uint32_t kBits = 16;
  static constexpr uint32_t kOverflow = 64;

  QpIndex();

  // The QP in `pqpn`'s home slot, or the empty one: never null.
  Qp* Home(uint32_t pqpn) const { return HomeIn(slots_.get(), pqpn); }
  // The same, from the home slots' address (fixed for the index's life),
  // which a caller may keep to save a load.
  const std::atomic<Qp*>* home_slots() const { return slots_.get(); }
  static Qp* HomeIn(const std::atomic<Qp*>* slots, uint32_t pqpn) {
    return slots[pqpn & kMask].load(std::memory_order_acquire);
  }
  Qp* Find(uint32_t pqpn) const {
    Qp* qp = Home(pqpn);
    if (qp->physical_qpn == pqpn && qp != Empty()) [[likely]]
      return qp;
    return FindOverflow(pqpn);
  }
  // What a free slot holds: a QP whose numbers (physical, plain and
  // virtual: kNoQpn) no hardware completion carries, so that the
  // completion path's one compare never takes it for a QP, and a number
  // that did match it would come back unchanged.
  static Qp* Empty();
  // Control path, under the shim's mutex.
  bool Insert(uint32_t pqpn, Qp* qp);
  void Remove(uint32_t pqpn, Qp* qp);

 private:
  static constexpr uint32_t kMask = (1u << kBits) - 1;
  [[gnu::noinline]] Qp* FindOverflow(uint32_t pqpn) const {
    for (const auto& e : overflow_) {
      Qp* qp = e.load(std::memory_order_acquire);
      if (qp != nullptr && qp->physical_qpn == pqpn) return qp;
    }
    return nullptr;
  }
  std::unique_ptr<std::atomic<Qp*>[]> slots_;
  std::atomic<Qp*> overflow_[kOverflow] = {};
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CORE_TABLES_H_
