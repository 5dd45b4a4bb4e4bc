#include "shim/core/tables.h"

namespace rdmavirt::shim {

Qp* QpIndex::Empty() {
  static Qp* const empty = [] {
    Qp* qp = new Qp();  // never freed: slots may point at it until exit
    qp->physical_qpn = Qp::kNoQpn;
    qp->plain_qpn = Qp::kNoQpn;
    qp->shadow.qp_base.qp_num = Qp::kNoQpn;
    return qp;
  }();
  return empty;
}

QpIndex::QpIndex() : slots_(new std::atomic<Qp*>[1u << kBits]) {
  for (uint32_t i = 0; i <= kMask; ++i) slots_[i].store(Empty(), std::memory_order_relaxed);
}

bool QpIndex::Insert(uint32_t pqpn, Qp* qp) {
  std::atomic<Qp*>& home = slots_[pqpn & kMask];
  if (home.load(std::memory_order_relaxed) == Empty()) {
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
    home.store(Empty(), std::memory_order_release);
    return;
  }
  for (auto& e : overflow_) {
    if (e.load(std::memory_order_relaxed) == qp) e.store(nullptr, std::memory_order_release);
  }
}

}  // namespace rdmavirt::shim
