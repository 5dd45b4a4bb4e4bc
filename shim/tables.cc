#include "shim/tables.h"

namespace rdmavirt::shim {

bool QpIndex::Insert(uint32_t pqpn, Qp* qp) {
  std::atomic<Qp*>& home = slots_[pqpn & kMask];
  if (home.load(std::memory_order_relaxed) == nullptr) {
    home.store(qp, std::memory_order_release);
    return true;
  }
  for (auto& e : overflow_) {
    if (e.load(std::memory_order_relaxed) == nullptr) {
      e.store(qp, std::memory_order_release);
      return true;
    }
  }
  return false;
}

void QpIndex::Remove(uint32_t pqpn, Qp* qp) {
  std::atomic<Qp*>& home = slots_[pqpn & kMask];
  if (home.load(std::memory_order_relaxed) == qp) {
    home.store(nullptr, std::memory_order_release);
    return;
  }
  for (auto& e : overflow_) {
    if (e.load(std::memory_order_relaxed) == qp) e.store(nullptr, std::memory_order_release);
  }
}

}  // namespace rdmavirt::shim
