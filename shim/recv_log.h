// RecvLog: the receive WRs last posted to one receive queue (a QP's or an
// SRQ's), as the application posted them (virtual lkeys), in posting order.
//
// It holds at least as many WRs as the queue can have outstanding, so the
// outstanding ones are always among them: at release the shim flushes the
// queue (the QP goes to the error state) and the flushed completions, which
// come back in posting order, name exactly which of the recent posts to
// re-post elsewhere. So completions need no bookkeeping here, and polling
// stays free of it. The translating completion path also uses it to find
// the buffer a UD receive landed in (to rewrite its GRH).
//
// A fixed ring sized at creation: posting touches no allocator. One thread
// posts to a queue at a time (rdma-core's providers serialize posts on a
// queue); the ring adds no lock.
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
    mask_ = cap - 1;
    return buf_ != nullptr;
  }

  // Data path: records a WR about to be posted (overwriting the oldest).
  // False, recording nothing, when it has more SGEs than the queue takes:
  // the provider refuses it too.
  bool Push(const ibv_recv_wr* wr) {
    if (PushOne(wr)) return true;
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
  // The common case of Push: one SGE, which every stride holds. False,
  // recording nothing, for any other count.
  bool PushOne(const ibv_recv_wr* wr) {
    if (wr->num_sge != 1) [[unlikely]]
      return false;
    Entry* e = At(tail_);
    e->wr_id = wr->wr_id;
    e->num_sge = 1;
    e->sge[0] = wr->sg_list[0];
    ++tail_;
    return true;
  }
  // Receives recorded so far (64 bits: 0 means none ever, even after 2^32).
  uint64_t posted() const { return tail_; }
  // Forgets the last `n` pushes (the provider refused them).
  void Unpush(uint32_t n) { tail_ -= n; }

  // Translating completion path only: the oldest not yet consumed post
  // with this wr_id (receives complete in posting order), consumed.
  const Entry* Consume(uint64_t wr_id) {
    if (tail_ - consumed_ > mask_ + 1) consumed_ = tail_ - (mask_ + 1);
    for (uint64_t i = consumed_; i != tail_; ++i) {
      if (At(i)->wr_id == wr_id) {
        consumed_ = i + 1;
        return At(i);
      }
    }
    return nullptr;
  }

  // Consume() starts after every post recorded so far: when the queue's
  // outstanding receives are taken out to be posted again (and recorded
  // again), so that the old records of the same WRs are not found first.
  void ConsumeAll() { consumed_ = tail_; }

  // The last `n` posts, oldest first (n is capped by what the ring holds).
  std::vector<const Entry*> Recent(uint32_t n) const {
    if (n > tail_) n = tail_;
    if (n > mask_ + 1) n = mask_ + 1;
    std::vector<const Entry*> out;
    for (uint64_t i = tail_ - n; i != tail_; ++i) out.push_back(At(i));
    return out;
  }

 private:
  Entry* At(uint64_t i) const { return reinterpret_cast<Entry*>(&buf_[(i & mask_) * stride_]); }

  std::unique_ptr<uint8_t[]> buf_;
  size_t stride_ = 0;
  uint32_t max_sge_ = 0;
  uint32_t mask_ = 0;
  uint64_t tail_ = 0;      // posts so far
  uint64_t consumed_ = 0;  // Consume()'s position
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_RECV_LOG_H_
