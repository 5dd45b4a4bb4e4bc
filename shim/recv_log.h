// RecvLog: the receive WRs posted to one receive queue (a QP's or an
// SRQ's) and not completed yet, as the application posted them (virtual
// lkeys). It is the journal's list of outstanding receives, re-posted
// after a move, and tells the completion path which buffer a UD receive
// landed in (to rewrite its GRH).
//
// A fixed ring sized at creation: post and poll touch no allocator. One
// thread posts to a queue at a time and one polls its CQ at a time (what
// rdma-core's providers do under their queue locks); the ring adds no lock.
// Receives complete in posting order on a QP's own queue; on an SRQ they
// usually do, and Complete() searches forward when they do not.
#ifndef RDMAVIRT_SHIM_RECV_LOG_H_
#define RDMAVIRT_SHIM_RECV_LOG_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

namespace rdmavirt::shim {

class RecvLog {
 public:
  struct Entry {
    uint64_t wr_id;
    uint32_t num_sge;
    ibv_sge sge[1];  // num_sge of them (the stride holds max_sge)
  };

  // Capacity for max_wr receives of up to max_sge SGEs. False on ENOMEM.
  bool Init(uint32_t max_wr, uint32_t max_sge) {
    uint32_t cap = 1;
    while (cap < max_wr + 1) cap <<= 1;
    max_sge_ = max_sge ? max_sge : 1;
    stride_ = (offsetof(Entry, sge) + sizeof(ibv_sge) * max_sge_ + 7) & ~size_t{7};
    buf_.reset(new (std::nothrow) uint8_t[stride_ * cap]);
    scratch_.reset(new (std::nothrow) uint8_t[stride_]);
    mask_ = cap - 1;
    return buf_ != nullptr && scratch_ != nullptr;
  }

  // Data path: records a WR about to be posted. False when it does not
  // fit (more SGEs than the queue takes, or full): the provider will
  // refuse it, and nothing is recorded.
  bool Push(const ibv_recv_wr* wr) {
    if (static_cast<uint32_t>(wr->num_sge) > max_sge_ || tail_ - head_ > mask_) return false;
    Entry* e = At(tail_);
    e->wr_id = wr->wr_id;
    e->num_sge = static_cast<uint32_t>(wr->num_sge);
    for (int i = 0; i < wr->num_sge; ++i) e->sge[i] = wr->sg_list[i];
    ++tail_;
    return true;
  }
  // Forgets the last `n` pushes (the provider refused them).
  void Unpush(uint32_t n) { tail_ -= n; }

  // Completion path: removes the entry of a completed receive and returns
  // it (valid until the next Push), or nullptr if unknown.
  const Entry* Complete(uint64_t wr_id) {
    if (head_ == tail_) [[unlikely]] return nullptr;
    Entry* e = At(head_);
    if (e->wr_id == wr_id) [[likely]] {
      ++head_;
      return e;
    }
    return CompleteOutOfOrder(wr_id);
  }
  // For error completions, whose opcode is not defined: only a receive
  // at the head of the queue is taken to be the one that completed.
  const Entry* CompleteIfHead(uint64_t wr_id) {
    if (head_ == tail_ || At(head_)->wr_id != wr_id) return nullptr;
    return At(head_++);
  }

  uint32_t size() const { return tail_ - head_; }
  // Outstanding receives, oldest first (journal; call with the queue idle).
  std::vector<const Entry*> Outstanding() const {
    std::vector<const Entry*> out;
    for (uint32_t i = head_; i != tail_; ++i) out.push_back(At(i));
    return out;
  }

 private:
  Entry* At(uint32_t i) const { return reinterpret_cast<Entry*>(&buf_[(i & mask_) * stride_]); }
  const Entry* CompleteOutOfOrder(uint64_t wr_id) {
    // Move the match to the head, keeping the others in posting order.
    for (uint32_t i = head_ + 1; i != tail_; ++i) {
      if (At(i)->wr_id != wr_id) continue;
      memcpy(scratch_.get(), At(i), stride_);
      for (uint32_t j = i; j != head_; --j) memcpy(At(j), At(j - 1), stride_);
      memcpy(At(head_), scratch_.get(), stride_);
      return At(head_++);
    }
    return nullptr;
  }

  std::unique_ptr<uint8_t[]> buf_;
  std::unique_ptr<uint8_t[]> scratch_;  // one entry, for reordering
  size_t stride_ = 0;
  uint32_t max_sge_ = 0;
  uint32_t mask_ = 0;
  uint32_t head_ = 0;
  uint32_t tail_ = 0;
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_RECV_LOG_H_
