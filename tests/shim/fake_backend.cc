#include "tests/shim/fake_backend.h"

#include <endian.h>
#include <errno.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <deque>

#include "shim/core/async_event.h"

namespace rdmavirt::shim {
namespace {

uint32_t RoundUpPow2(uint32_t v) {
  uint32_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

bool IsV4Mapped(const ibv_gid& g) {
  static constexpr uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(g.raw, kPrefix, sizeof(kPrefix)) == 0;
}

// The RFC 791 header checksum, computed here on its own rather than with
// the shim's Ipv4HeaderChecksum (shim/core/grh.h): the fake stands for
// the kernel's IP stack, which fills in the header the HCA delivers, and
// the shim decides a GRH's layout by that checksum (LayoutOf). A fake
// that used the shim's function would accept whatever the shim computes,
// right or wrong. Written the way the kernel fills it in (ip_send_check),
// not as the shim checks it: the field zeroed, the ten 16-bit words
// summed, the carries folded back twice (RFC 1071).
uint16_t Ipv4Checksum(const uint8_t* h) {
  uint8_t header[20];
  memcpy(header, h, sizeof(header));
  header[10] = header[11] = 0;
  uint64_t sum = 0;
  for (size_t i = 0; i < sizeof(header); i += 2) sum += (header[i] << 8) + header[i + 1];
  sum = (sum >> 16) + (sum & 0xffff);
  sum += sum >> 16;
  return static_cast<uint16_t>(~sum & 0xffff);
}

// What rxe puts in front of a UD payload for RoCEv2: for IPv4 peers the
// first 20 bytes are zero and the IPv4 header fills bytes 20..39;
// otherwise the 40 bytes are the IPv6 header.
void BuildGrh(const ibv_gid& sgid, const ibv_gid& dgid, uint8_t tclass, uint8_t hop_limit,
              size_t payload, uint8_t out[FakeBackend::kGrhBytes]) {
  memset(out, 0, FakeBackend::kGrhBytes);
  const uint8_t hops = hop_limit != 0 ? hop_limit : 64;
  // UDP + BTH + DETH + payload + ICRC.
  const size_t l4 = 8 + 12 + 8 + payload + 4;
  if (IsV4Mapped(sgid) && IsV4Mapped(dgid)) {
    uint8_t* ip = out + 20;
    const size_t total = 20 + l4;
    ip[0] = 0x45;
    ip[1] = tclass;
    ip[2] = static_cast<uint8_t>(total >> 8);
    ip[3] = static_cast<uint8_t>(total);
    ip[6] = 0x40;  // don't fragment
    ip[8] = hops;
    ip[9] = 17;  // UDP
    memcpy(ip + 12, sgid.raw + 12, 4);
    memcpy(ip + 16, dgid.raw + 12, 4);
    // The checksum stays 0, as rxe leaves it in a packet it loops back to
    // its own device (the only kind this one device delivers): the IP
    // stack that fills it in is not on that path.
  } else {
    out[0] = static_cast<uint8_t>(0x60 | tclass >> 4);
    out[1] = static_cast<uint8_t>(tclass << 4);
    out[4] = static_cast<uint8_t>(l4 >> 8);
    out[5] = static_cast<uint8_t>(l4);
    out[6] = 17;
    out[7] = hops;
    memcpy(out + 8, sgid.raw, 16);
    memcpy(out + 24, dgid.raw, 16);
  }
}

void Signal(int fd) {
  const uint64_t one = 1;
  ssize_t ignored = write(fd, &one, sizeof(one));
  (void)ignored;
}
void Consume(int fd) {
  uint64_t v;
  ssize_t ignored = read(fd, &v, sizeof(v));
  (void)ignored;
}
int NewEventFd() { return eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC | EFD_SEMAPHORE); }

}  // namespace

// Each object starts with the libibverbs struct it hands out, so the
// pointer the caller holds converts back with one cast (as in providers).
struct FakeBackend::ContextObj {
  verbs_context vctx;  // hands out &vctx.context
  FakeBackend* fake = nullptr;
  std::deque<ibv_async_event> async_events;
  ~ContextObj() {
    if (vctx.context.async_fd >= 0) close(vctx.context.async_fd);
  }
};
struct FakeBackend::PdObj {
  ibv_pd pd;
};
struct FakeBackend::MrObj {
  ibv_mr mr;
  uint64_t iova = 0;
  unsigned int access = 0;
};
struct FakeBackend::ChannelObj {
  ibv_comp_channel ch;
  std::deque<ibv_cq*> events;
  bool closed = false;  // destroyed: a blocked reader gets EIO, as from ib_uverbs
  int readers = 0;      // threads between the lock and read(2) on the fd
  ~ChannelObj() {
    if (ch.fd >= 0) close(ch.fd);
  }
};
struct FakeBackend::CqObj {
  ibv_cq_ex ex;  // ibv_cq is its prefix
  bool extended = false;
  ChannelObj* channel = nullptr;
  int armed = 0;  // 0: no, 1: next completion, 2: next solicited or error
  // As libibverbs: a destroy waits until every event read is acknowledged.
  uint32_t events_read = 0;
  uint32_t events_acked = 0;
  std::deque<ibv_wc> wcs;
  int overflows = 0;  // completions lost to a full CQ
  ibv_wc cur{};       // the ibv_cq_ex poll cursor
};
struct FakeBackend::RecvWr {
  uint64_t wr_id = 0;
  std::vector<ibv_sge> sges;
};
struct FakeBackend::SrqObj {
  ibv_srq srq;
  PdObj* pd = nullptr;
  ibv_srq_attr attr{};
  uint32_t max_sge = 0;
  std::deque<RecvWr> rq;
};
struct FakeBackend::Wr {
  uint64_t wr_id = 0;
  ibv_wr_opcode opcode = IBV_WR_SEND;
  // The opcode the application stored is one the enum holds (the fake
  // refuses any other, as a provider does).
  bool known_opcode = true;
  unsigned int flags = 0;
  int num_sge = 0;
  std::vector<ibv_sge> sges;
  std::string inline_data;
  __be32 imm = 0;
  uint32_t invalidate_rkey = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint64_t compare_add = 0;
  uint64_t swap = 0;
  ibv_ah* ah = nullptr;
  uint32_t remote_qpn = 0;
  uint32_t remote_qkey = 0;
};
struct FakeBackend::QpObj {
  ibv_qp_ex ex;  // ibv_qp is its prefix
  bool extended = false;
  PdObj* pd = nullptr;
  CqObj* send_cq = nullptr;
  CqObj* recv_cq = nullptr;
  SrqObj* srq = nullptr;
  ibv_qp_cap cap{};
  int sq_sig_all = 0;
  ibv_qp_attr attr{};  // as last modified: what QueryQp reports
  std::deque<RecvWr> rq;
  std::vector<Wr> batch;  // between wr_start and wr_complete
  int batch_error = 0;
  std::vector<ibv_gid> groups;  // multicast, attached
};
struct FakeBackend::AhObj {
  ibv_ah ah;
  PdObj* pd = nullptr;
  ibv_ah_attr attr{};
};

// The function pointers of the fake's objects: static, so they can sit in
// C structs, and nested, so they reach the fake's state.
struct FakeBackend::Ops {
  static ContextObj* AsContext(ibv_context* c) {
    return reinterpret_cast<ContextObj*>(reinterpret_cast<char*>(c) -
                                         offsetof(verbs_context, context));
  }
  static FakeBackend* Of(ibv_context* c) { return AsContext(c)->fake; }
  static QpObj* AsQp(ibv_qp_ex* q) { return reinterpret_cast<QpObj*>(q); }
  static CqObj* AsCq(ibv_cq_ex* c) { return reinterpret_cast<CqObj*>(c); }

  static Wr FromSendWr(const ibv_send_wr& s, ibv_qp_type type) {
    Wr w;
    w.wr_id = s.wr_id;
    // Read as a number: a C program may store any int in the enum.
    uint32_t raw;
    std::memcpy(&raw, &s.opcode, sizeof(raw));
    w.known_opcode = raw <= IBV_WR_ATOMIC_WRITE;
    w.opcode = w.known_opcode ? static_cast<ibv_wr_opcode>(raw) : IBV_WR_SEND;
    w.flags = s.send_flags;
    w.num_sge = s.num_sge;
    if (s.num_sge > 0) w.sges.assign(s.sg_list, s.sg_list + s.num_sge);
    if (s.send_flags & IBV_SEND_INLINE) {
      // The HCA copies inline data at post time; lkeys are not looked at.
      for (const ibv_sge& g : w.sges)
        w.inline_data.append(reinterpret_cast<const char*>(g.addr), g.length);
    }
    switch (w.known_opcode ? w.opcode : -1) {
      case IBV_WR_SEND_WITH_IMM:
        w.imm = s.imm_data;
        break;
      case IBV_WR_SEND_WITH_INV:
        w.invalidate_rkey = s.invalidate_rkey;
        break;
      case IBV_WR_RDMA_WRITE_WITH_IMM:
        w.imm = s.imm_data;
        [[fallthrough]];
      case IBV_WR_RDMA_WRITE:
      case IBV_WR_RDMA_READ:
      case IBV_WR_ATOMIC_WRITE:
        w.remote_addr = s.wr.rdma.remote_addr;
        w.rkey = s.wr.rdma.rkey;
        break;
      case IBV_WR_ATOMIC_CMP_AND_SWP:
      case IBV_WR_ATOMIC_FETCH_AND_ADD:
        w.remote_addr = s.wr.atomic.remote_addr;
        w.rkey = s.wr.atomic.rkey;
        w.compare_add = s.wr.atomic.compare_add;
        w.swap = s.wr.atomic.swap;
        break;
      default:
        break;
    }
    if (type == IBV_QPT_UD) {
      w.ah = s.wr.ud.ah;
      w.remote_qpn = s.wr.ud.remote_qpn;
      w.remote_qkey = s.wr.ud.remote_qkey;
    }
    return w;
  }

  static SendRecord ToRecord(const QpObj* qp, const Wr& w) {
    SendRecord r;
    r.qp_num = qp->ex.qp_base.qp_num;
    r.wr_id = w.wr_id;
    r.opcode = w.opcode;
    r.send_flags = w.flags;
    for (const ibv_sge& g : w.sges) r.lkeys.push_back(g.lkey);
    r.rkey = w.rkey;
    r.invalidate_rkey = w.invalidate_rkey;
    r.ah = w.ah;
    r.remote_qpn = w.remote_qpn;
    r.remote_qkey = w.remote_qkey;
    return r;
  }

  // ---- context ops

  static int PostSend(ibv_qp* q, ibv_send_wr* wr, ibv_send_wr** bad) {
    FakeBackend* f = Of(q->context);
    std::lock_guard<std::mutex> lock(f->mu_);
    ++f->post_send_calls_;
    QpObj* qp = f->Lookup(f->qps_, q);
    if (qp == nullptr) {
      *bad = wr;
      return EINVAL;
    }
    // Like a provider: WRs before the first bad one are posted.
    for (; wr != nullptr; wr = wr->next) {
      const Wr w = FromSendWr(*wr, q->qp_type);
      const int rc = f->Validate(qp, w);
      if (rc != 0) {
        f->refused_sends_.push_back(ToRecord(qp, w));
        *bad = wr;
        return rc;
      }
      f->sends_.push_back(ToRecord(qp, w));
      f->Execute(qp, w);
    }
    return 0;
  }

  static int PostRecv(ibv_qp* q, ibv_recv_wr* wr, ibv_recv_wr** bad) {
    FakeBackend* f = Of(q->context);
    std::lock_guard<std::mutex> lock(f->mu_);
    QpObj* qp = f->Lookup(f->qps_, q);
    for (; wr != nullptr; wr = wr->next) {
      if (qp == nullptr || qp->srq != nullptr || q->state == IBV_QPS_RESET || wr->num_sge < 0 ||
          static_cast<uint32_t>(wr->num_sge) > qp->cap.max_recv_sge) {
        *bad = wr;
        return EINVAL;
      }
      if (qp->rq.size() >= qp->cap.max_recv_wr) {
        *bad = wr;
        return ENOMEM;
      }
      RecvRecord rec;
      rec.qp_num = q->qp_num;
      rec.wr_id = wr->wr_id;
      RecvWr r;
      r.wr_id = wr->wr_id;
      r.sges.assign(wr->sg_list, wr->sg_list + wr->num_sge);
      for (const ibv_sge& g : r.sges) rec.lkeys.push_back(g.lkey);
      f->recvs_.push_back(rec);
      qp->rq.push_back(r);
      if (q->state == IBV_QPS_ERR) f->FlushRecvs(qp);
    }
    return 0;
  }

  static int PostSrqRecv(ibv_srq* s, ibv_recv_wr* wr, ibv_recv_wr** bad) {
    FakeBackend* f = Of(s->context);
    std::lock_guard<std::mutex> lock(f->mu_);
    SrqObj* srq = f->Lookup(f->srqs_, s);
    for (; wr != nullptr; wr = wr->next) {
      if (srq == nullptr || wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > srq->max_sge) {
        *bad = wr;
        return EINVAL;
      }
      if (srq->rq.size() >= srq->attr.max_wr) {
        *bad = wr;
        return ENOMEM;
      }
      RecvRecord rec;
      rec.srq = s;
      rec.wr_id = wr->wr_id;
      RecvWr r;
      r.wr_id = wr->wr_id;
      r.sges.assign(wr->sg_list, wr->sg_list + wr->num_sge);
      for (const ibv_sge& g : r.sges) rec.lkeys.push_back(g.lkey);
      f->recvs_.push_back(rec);
      srq->rq.push_back(r);
    }
    return 0;
  }

  static int PollCq(ibv_cq* c, int n, ibv_wc* wc) {
    FakeBackend* f = Of(c->context);
    std::lock_guard<std::mutex> lock(f->mu_);
    ++f->poll_cq_calls_;
    f->DeliverDueDatagrams();
    CqObj* cq = f->Lookup(f->cqs_, c);
    if (cq == nullptr || n < 0) return -EINVAL;
    int got = 0;
    for (; got < n && !cq->wcs.empty(); ++got) {
      wc[got] = cq->wcs.front();
      cq->wcs.pop_front();
    }
    return got;
  }

  static int ReqNotifyCq(ibv_cq* c, int solicited_only) {
    FakeBackend* f = Of(c->context);
    std::lock_guard<std::mutex> lock(f->mu_);
    CqObj* cq = f->Lookup(f->cqs_, c);
    if (cq == nullptr) return EINVAL;
    cq->armed = solicited_only ? 2 : 1;
    return 0;
  }

  static int QueryDeviceEx(ibv_context* c, const ibv_query_device_ex_input* input,
                           ibv_device_attr_ex* attr, size_t size) {
    if ((input != nullptr && input->comp_mask != 0) || size < sizeof(ibv_device_attr))
      return EINVAL;
    memset(attr, 0, size);
    return Of(c)->QueryDevice(c, &attr->orig_attr);
  }

  // ---- ibv_cq_ex

  static int Cursor(ibv_cq_ex* c) {
    CqObj* cq = AsCq(c);
    if (cq->wcs.empty()) return ENOENT;
    cq->cur = cq->wcs.front();
    cq->wcs.pop_front();
    c->wr_id = cq->cur.wr_id;
    c->status = cq->cur.status;
    return 0;
  }
  static int StartPoll(ibv_cq_ex* c, ibv_poll_cq_attr* attr) {
    FakeBackend* f = Of(c->context);
    std::lock_guard<std::mutex> lock(f->mu_);
    if (f->Lookup(f->cqs_, c) == nullptr || attr->comp_mask != 0) return EINVAL;
    return Cursor(c);
  }
  static int NextPoll(ibv_cq_ex* c) {
    FakeBackend* f = Of(c->context);
    std::lock_guard<std::mutex> lock(f->mu_);
    return Cursor(c);
  }
  static void EndPoll(ibv_cq_ex*) {}
  static ibv_wc_opcode ReadOpcode(ibv_cq_ex* c) { return AsCq(c)->cur.opcode; }
  static uint32_t ReadVendorErr(ibv_cq_ex* c) { return AsCq(c)->cur.vendor_err; }
  static uint32_t ReadByteLen(ibv_cq_ex* c) { return AsCq(c)->cur.byte_len; }
  static __be32 ReadImmData(ibv_cq_ex* c) { return AsCq(c)->cur.imm_data; }
  static uint32_t ReadQpNum(ibv_cq_ex* c) { return AsCq(c)->cur.qp_num; }
  static uint32_t ReadSrcQp(ibv_cq_ex* c) { return AsCq(c)->cur.src_qp; }
  static unsigned int ReadWcFlags(ibv_cq_ex* c) { return AsCq(c)->cur.wc_flags; }
  static uint32_t ReadSlid(ibv_cq_ex* c) { return AsCq(c)->cur.slid; }
  static uint8_t ReadSl(ibv_cq_ex* c) { return AsCq(c)->cur.sl; }
  static uint8_t ReadDlidPathBits(ibv_cq_ex* c) { return AsCq(c)->cur.dlid_path_bits; }

  // ---- ibv_qp_ex builders: collect WRs, executed by wr_complete

  static Wr* NewWr(ibv_qp_ex* q, ibv_wr_opcode opcode) {
    QpObj* qp = AsQp(q);
    Wr& w = qp->batch.emplace_back();
    // Providers read wr_id and wr_flags from their own ibv_qp_ex here.
    w.wr_id = q->wr_id;
    w.flags = q->wr_flags;
    w.opcode = opcode;
    return &w;
  }
  static Wr* Last(ibv_qp_ex* q) {
    QpObj* qp = AsQp(q);
    if (qp->batch.empty()) {
      qp->batch_error = EINVAL;
      return nullptr;
    }
    return &qp->batch.back();
  }
  static FakeBackend* Lock(ibv_qp_ex* q) { return Of(q->qp_base.context); }

  static void WrStart(ibv_qp_ex* q) {
    std::lock_guard<std::mutex> lock(Lock(q)->mu_);
    AsQp(q)->batch.clear();
    AsQp(q)->batch_error = 0;
  }
  static int WrComplete(ibv_qp_ex* q) {
    FakeBackend* f = Lock(q);
    std::lock_guard<std::mutex> lock(f->mu_);
    QpObj* qp = AsQp(q);
    int rc = qp->batch_error;
    // All or nothing, as mlx5: a bad WR fails the whole batch.
    for (const Wr& w : qp->batch)
      if (rc == 0) rc = f->Validate(qp, w);
    if (rc == 0) {
      for (const Wr& w : qp->batch) {
        f->sends_.push_back(ToRecord(qp, w));
        f->Execute(qp, w);
      }
    }
    qp->batch.clear();
    qp->batch_error = 0;
    return rc;
  }
  static void WrAbort(ibv_qp_ex* q) {
    std::lock_guard<std::mutex> lock(Lock(q)->mu_);
    AsQp(q)->batch.clear();
    AsQp(q)->batch_error = 0;
  }
  static void WrSend(ibv_qp_ex* q) {
    std::lock_guard<std::mutex> lock(Lock(q)->mu_);
    NewWr(q, IBV_WR_SEND);
  }
  static void WrSendImm(ibv_qp_ex* q, __be32 imm) {
    std::lock_guard<std::mutex> lock(Lock(q)->mu_);
    NewWr(q, IBV_WR_SEND_WITH_IMM)->imm = imm;
  }
  static void WrSendInv(ibv_qp_ex* q, uint32_t rkey) {
    std::lock_guard<std::mutex> lock(Lock(q)->mu_);
    NewWr(q, IBV_WR_SEND_WITH_INV)->invalidate_rkey = rkey;
  }
  static void Rdma(ibv_qp_ex* q, ibv_wr_opcode op, uint32_t rkey, uint64_t addr, __be32 imm) {
    std::lock_guard<std::mutex> lock(Lock(q)->mu_);
    Wr* w = NewWr(q, op);
    w->rkey = rkey;
    w->remote_addr = addr;
    w->imm = imm;
  }
  static void WrRdmaWrite(ibv_qp_ex* q, uint32_t rkey, uint64_t addr) {
    Rdma(q, IBV_WR_RDMA_WRITE, rkey, addr, 0);
  }
  static void WrRdmaWriteImm(ibv_qp_ex* q, uint32_t rkey, uint64_t addr, __be32 imm) {
    Rdma(q, IBV_WR_RDMA_WRITE_WITH_IMM, rkey, addr, imm);
  }
  static void WrRdmaRead(ibv_qp_ex* q, uint32_t rkey, uint64_t addr) {
    Rdma(q, IBV_WR_RDMA_READ, rkey, addr, 0);
  }
  static void Atomic(ibv_qp_ex* q, ibv_wr_opcode op, uint32_t rkey, uint64_t addr,
                     uint64_t compare_add, uint64_t swap) {
    std::lock_guard<std::mutex> lock(Lock(q)->mu_);
    Wr* w = NewWr(q, op);
    w->rkey = rkey;
    w->remote_addr = addr;
    w->compare_add = compare_add;
    w->swap = swap;
  }
  static void WrAtomicCmpSwp(ibv_qp_ex* q, uint32_t rkey, uint64_t addr, uint64_t compare,
                             uint64_t swap) {
    Atomic(q, IBV_WR_ATOMIC_CMP_AND_SWP, rkey, addr, compare, swap);
  }
  static void WrAtomicFetchAdd(ibv_qp_ex* q, uint32_t rkey, uint64_t addr, uint64_t add) {
    Atomic(q, IBV_WR_ATOMIC_FETCH_AND_ADD, rkey, addr, add, 0);
  }
  static void WrSetUdAddr(ibv_qp_ex* q, ibv_ah* ah, uint32_t qpn, uint32_t qkey) {
    std::lock_guard<std::mutex> lock(Lock(q)->mu_);
    if (Wr* w = Last(q)) {
      w->ah = ah;
      w->remote_qpn = qpn;
      w->remote_qkey = qkey;
    }
  }
  static void WrSetSge(ibv_qp_ex* q, uint32_t lkey, uint64_t addr, uint32_t length) {
    std::lock_guard<std::mutex> lock(Lock(q)->mu_);
    if (Wr* w = Last(q)) {
      w->sges.assign(1, ibv_sge{addr, length, lkey});
      w->num_sge = 1;
    }
  }
  static void WrSetSgeList(ibv_qp_ex* q, size_t n, const ibv_sge* list) {
    std::lock_guard<std::mutex> lock(Lock(q)->mu_);
    if (Wr* w = Last(q)) {
      w->sges.assign(list, list + n);
      w->num_sge = static_cast<int>(n);
    }
  }
  static void WrSetInlineData(ibv_qp_ex* q, void* addr, size_t length) {
    std::lock_guard<std::mutex> lock(Lock(q)->mu_);
    if (Wr* w = Last(q)) {
      w->flags |= IBV_SEND_INLINE;
      w->inline_data.assign(static_cast<const char*>(addr), length);
    }
  }
  static void WrSetInlineDataList(ibv_qp_ex* q, size_t n, const ibv_data_buf* list) {
    std::lock_guard<std::mutex> lock(Lock(q)->mu_);
    if (Wr* w = Last(q)) {
      w->flags |= IBV_SEND_INLINE;
      w->inline_data.clear();
      for (size_t i = 0; i < n; ++i)
        w->inline_data.append(static_cast<const char*>(list[i].addr), list[i].length);
    }
  }
};

// ---------------------------------------------------------------- helpers

ibv_gid FakeBackend::Gid(int index) {
  ibv_gid g{};
  if (index == 0) {
    static constexpr uint8_t kLinkLocal[16] = {0xfe, 0x80, 0,    0,    0,    0,    0,    0,
                                               0x02, 0x16, 0x3e, 0xff, 0xfe, 0x4d, 0x00, 0x09};
    memcpy(g.raw, kLinkLocal, 16);
  } else if (index == 1) {
    g.raw[10] = 0xff;
    g.raw[11] = 0xff;
    memcpy(g.raw + 12, kIpv4, 4);
  }
  return g;
}

FakeBackend::FakeBackend() {
  device_.node_type = IBV_NODE_CA;
  device_.transport_type = IBV_TRANSPORT_IB;
  strcpy(device_.name, "fake0");
  strcpy(device_.dev_name, "uverbs_fake0");
  strcpy(device_.dev_path, "/sys/class/infiniband_verbs/uverbs_fake0");
  strcpy(device_.ibdev_path, "/sys/class/infiniband/fake0");
}

// Maps are destroyed members-last-first: AHs and QPs before the PDs and
// contexts they point into.
FakeBackend::~FakeBackend() = default;

bool FakeBackend::TakeFault(Op op, int* error) {
  auto it = faults_.find(op);
  if (it == faults_.end()) return false;
  *error = it->second;
  faults_.erase(it);
  return true;
}

bool FakeBackend::Refused(Op op, bool valid) {
  int err;
  if (TakeFault(op, &err)) {
    errno = err;
    return true;
  }
  if (!valid) {
    errno = EINVAL;
    return true;
  }
  return false;
}

template <typename T>
T* FakeBackend::Lookup(const Owned<T>& objects, const void* p) const {
  if (p == nullptr) return nullptr;
  auto it = objects.find(p);
  if (it == objects.end()) {
    ++foreign_;
    return nullptr;
  }
  return it->second.get();
}

uint32_t FakeBackend::NewKey() {
  return next_mr_index_++ << 8 | static_cast<uint32_t>(rng_() & 0xff);
}

FakeBackend::MrObj* FakeBackend::FindMr(const PdObj* pd, uint32_t key, bool remote) const {
  for (const auto& [p, mr] : mrs_) {
    if ((remote ? mr->mr.rkey : mr->mr.lkey) == key && mr->mr.pd == &pd->pd) return mr.get();
  }
  return nullptr;
}

FakeBackend::QpObj* FakeBackend::FindQpByNum(uint32_t qpn) const {
  for (const auto& [p, qp] : qps_)
    if (qp->ex.qp_base.qp_num == qpn) return qp.get();
  return nullptr;
}

bool FakeBackend::IsOurGid(const ibv_gid& gid) const {
  for (int i = 0; i < kGidCount; ++i) {
    const ibv_gid g = Gid(i);
    if (memcmp(g.raw, gid.raw, 16) == 0) return true;
  }
  return false;
}

namespace {

// Host address of [addr, addr+len) in `mr` (addressed by its iova), or
// nullptr when the range is outside it.
char* HostRange(const ibv_mr& mr, uint64_t iova, uint64_t addr, uint64_t len) {
  if (addr < iova || addr - iova > mr.length || len > mr.length - (addr - iova)) return nullptr;
  return static_cast<char*>(mr.addr) + (addr - iova);
}

ibv_wc_opcode SendWcOpcode(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ:
      return IBV_WC_RDMA_READ;
    case IBV_WR_ATOMIC_CMP_AND_SWP:
      return IBV_WC_COMP_SWAP;
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      return IBV_WC_FETCH_ADD;
    default:
      return IBV_WC_SEND;
  }
}

bool IsAtomic(ibv_wr_opcode op) {
  return op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD;
}

}  // namespace

// Checks done when a WR is posted (the provider returns an error and
// bad_wr); everything else is found while executing it (a completion).
int FakeBackend::Validate(QpObj* qp, const Wr& w) const {
  const ibv_qp& q = qp->ex.qp_base;
  if (q.state != IBV_QPS_RTS && q.state != IBV_QPS_ERR) return EINVAL;
  if (w.num_sge < 0 || static_cast<uint32_t>(w.num_sge) > qp->cap.max_send_sge) return EINVAL;
  if ((w.flags & IBV_SEND_INLINE) && w.inline_data.size() > qp->cap.max_inline_data) return EINVAL;
  if (!w.known_opcode) return EINVAL;
  switch (w.opcode) {
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM:
      break;
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
    case IBV_WR_SEND_WITH_INV:
      if (q.qp_type == IBV_QPT_UD) return EINVAL;
      break;
    case IBV_WR_RDMA_READ:
    case IBV_WR_ATOMIC_CMP_AND_SWP:
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      if (q.qp_type != IBV_QPT_RC) return EINVAL;
      break;
    default:
      return EINVAL;
  }
  if (q.qp_type == IBV_QPT_UD && w.ah == nullptr) return EINVAL;
  return 0;
}

void FakeBackend::Complete(CqObj* cq, const ibv_wc& wc, bool solicited) {
  // A full CQ loses the completion (rxe drops it and raises CQ_ERR).
  if (cq->wcs.size() >= static_cast<size_t>(cq->ex.cqe)) {
    ++cq->overflows;
    return;
  }
  cq->wcs.push_back(wc);
  if (cq->armed == 1 || (cq->armed == 2 && (solicited || wc.status != IBV_WC_SUCCESS))) {
    cq->armed = 0;
    if (cq->channel != nullptr) {
      cq->channel->events.push_back(ibv_cq_ex_to_cq(&cq->ex));
      Signal(cq->channel->ch.fd);
    }
  }
}

void FakeBackend::FlushRecvs(QpObj* qp) {
  for (const RecvWr& r : qp->rq) {
    ibv_wc wc{};
    wc.wr_id = r.wr_id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = IBV_WC_RECV;
    wc.qp_num = qp->ex.qp_base.qp_num;
    Complete(qp->recv_cq, wc, false);
  }
  qp->rq.clear();
}

void FakeBackend::Execute(QpObj* qp, const Wr& w) {
  ibv_qp& q = qp->ex.qp_base;
  ibv_wc_status status = IBV_WC_SUCCESS;
  uint32_t byte_len = 0;
  std::string payload;
  if (q.state == IBV_QPS_ERR) {
    status = IBV_WC_WR_FLUSH_ERR;
  } else if (w.flags & IBV_SEND_INLINE) {
    payload = w.inline_data;
  } else {
    // Local buffers: sources of SEND/WRITE, destinations of READ/atomics.
    const bool local_write = w.opcode == IBV_WR_RDMA_READ || IsAtomic(w.opcode);
    for (const ibv_sge& g : w.sges) {
      MrObj* mr = FindMr(qp->pd, g.lkey, false);
      char* host = mr ? HostRange(mr->mr, mr->iova, g.addr, g.length) : nullptr;
      if (host == nullptr || (local_write && !(mr->access & IBV_ACCESS_LOCAL_WRITE))) {
        status = IBV_WC_LOC_PROT_ERR;
        break;
      }
      if (!local_write) payload.append(host, g.length);
    }
  }
  if (status == IBV_WC_SUCCESS) status = Deliver(qp, w, payload, &byte_len);

  const bool signaled = (w.flags & IBV_SEND_SIGNALED) || qp->sq_sig_all;
  if (status != IBV_WC_SUCCESS || signaled) {
    ibv_wc wc{};
    wc.wr_id = w.wr_id;
    wc.status = status;
    wc.opcode = SendWcOpcode(w.opcode);
    wc.byte_len = byte_len;
    wc.qp_num = q.qp_num;
    Complete(qp->send_cq, wc, false);
  }
  if (status != IBV_WC_SUCCESS && status != IBV_WC_WR_FLUSH_ERR) {
    // Any error completion moves the QP to the error state.
    q.state = IBV_QPS_ERR;
    qp->attr.qp_state = IBV_QPS_ERR;
    FlushRecvs(qp);
  }
}

// A datagram reaching its receiver: lost, as on rxe, unless the QP is
// ready to receive, its Q_Key matches and a receive is posted.
void FakeBackend::ReceiveDatagram(const Datagram& g) {
  QpObj* d = FindQpByNum(g.dest_qp);
  if (d == nullptr || d->ex.qp_base.qp_type != IBV_QPT_UD ||
      (d->ex.qp_base.state != IBV_QPS_RTR && d->ex.qp_base.state != IBV_QPS_RTS) ||
      d->attr.qkey != g.qkey)
    return;
  std::deque<RecvWr>& rq = d->srq != nullptr ? d->srq->rq : d->rq;
  if (rq.empty()) return;
  const RecvWr r = std::move(rq.front());
  rq.pop_front();
  ibv_wc wc{};
  wc.wr_id = r.wr_id;
  wc.opcode = IBV_WC_RECV;
  wc.qp_num = d->ex.qp_base.qp_num;
  wc.src_qp = g.src_qp;
  wc.wc_flags = IBV_WC_GRH;
  if (g.with_imm) {
    wc.wc_flags |= IBV_WC_WITH_IMM;
    wc.imm_data = g.imm;
  }
  wc.status = Scatter(d, r, g.message);
  wc.byte_len = static_cast<uint32_t>(g.message.size());
  Complete(d->recv_cq, wc, g.solicited);
  if (wc.status != IBV_WC_SUCCESS) {
    d->ex.qp_base.state = IBV_QPS_ERR;
    d->attr.qp_state = IBV_QPS_ERR;
    FlushRecvs(d);
  }
}

void FakeBackend::DeliverDueDatagrams() {
  const auto now = std::chrono::steady_clock::now();
  while (!held_.empty() && held_.front().due <= now) {
    const Datagram g = std::move(held_.front());
    held_.pop_front();
    ReceiveDatagram(g);
  }
}

// Writes `message` into a receive WR's buffers (lkeys of the responder).
ibv_wc_status FakeBackend::Scatter(QpObj* d, const RecvWr& r, const std::string& message) {
  const PdObj* pd = d->srq != nullptr ? d->srq->pd : d->pd;
  std::vector<std::pair<char*, uint32_t>> dst;
  uint64_t room = 0;
  for (const ibv_sge& g : r.sges) {
    MrObj* mr = FindMr(pd, g.lkey, false);
    char* host = mr ? HostRange(mr->mr, mr->iova, g.addr, g.length) : nullptr;
    if (host == nullptr || !(mr->access & IBV_ACCESS_LOCAL_WRITE)) return IBV_WC_LOC_PROT_ERR;
    dst.emplace_back(host, g.length);
    room += g.length;
  }
  if (message.size() > room) return IBV_WC_LOC_LEN_ERR;
  size_t off = 0;
  for (const auto& [host, len] : dst) {
    const size_t n = std::min<size_t>(len, message.size() - off);
    memcpy(host, message.data() + off, n);
    off += n;
  }
  return IBV_WC_SUCCESS;
}

ibv_wc_status FakeBackend::Deliver(QpObj* qp, const Wr& w, const std::string& payload,
                                   uint32_t* byte_len) {
  const ibv_qp& q = qp->ex.qp_base;
  const bool rc = q.qp_type == IBV_QPT_RC;
  *byte_len = static_cast<uint32_t>(payload.size());

  // Takes the responder's next receive WR; false when there is none.
  auto pop_recv = [](QpObj* d, RecvWr* r) {
    std::deque<RecvWr>& rq = d->srq != nullptr ? d->srq->rq : d->rq;
    if (rq.empty()) return false;
    *r = std::move(rq.front());
    rq.pop_front();
    return true;
  };
  auto scatter = [this](QpObj* d, const RecvWr& r, const std::string& message) {
    return Scatter(d, r, message);
  };
  // A responder-side error: its QP goes to error as well.
  auto fail_responder = [this](QpObj* d) {
    d->ex.qp_base.state = IBV_QPS_ERR;
    d->attr.qp_state = IBV_QPS_ERR;
    FlushRecvs(d);
  };
  auto new_recv_wc = [](QpObj* d, const RecvWr& r, ibv_wc_opcode op) {
    ibv_wc wc{};
    wc.wr_id = r.wr_id;
    wc.opcode = op;
    wc.qp_num = d->ex.qp_base.qp_num;
    return wc;
  };

  if (q.qp_type == IBV_QPT_UD) {
    AhObj* ah = Lookup(ahs_, w.ah);
    if (ah == nullptr) return IBV_WC_LOC_QP_OP_ERR;
    if (payload.size() > kMtu) return IBV_WC_LOC_LEN_ERR;
    // A datagram to an address or QPN that is not here is lost, silently.
    if (!IsOurGid(ah->attr.grh.dgid)) return IBV_WC_SUCCESS;
    Datagram g;
    g.src_qp = q.qp_num;
    g.dest_qp = w.remote_qpn;
    g.qkey = w.remote_qkey;
    uint8_t grh[kGrhBytes];
    BuildGrh(Gid(ah->attr.grh.sgid_index), ah->attr.grh.dgid, ah->attr.grh.traffic_class,
             ah->attr.grh.hop_limit, payload.size(), grh);
    g.message.assign(reinterpret_cast<const char*>(grh), kGrhBytes);
    g.message += payload;
    g.with_imm = w.opcode == IBV_WR_SEND_WITH_IMM;
    g.imm = w.imm;
    g.solicited = w.flags & IBV_SEND_SOLICITED;
    if (ud_delay_ms_ > 0) {
      // Completed at the sender now, received later.
      g.due = std::chrono::steady_clock::now() + std::chrono::milliseconds(ud_delay_ms_);
      held_.push_back(std::move(g));
      return IBV_WC_SUCCESS;
    }
    ReceiveDatagram(g);
    return IBV_WC_SUCCESS;
  }

  // RC and UC: the peer is the QP named by this QP's address vector.
  const ibv_wc_status lost = rc ? IBV_WC_RETRY_EXC_ERR : IBV_WC_SUCCESS;
  if (!IsOurGid(qp->attr.ah_attr.grh.dgid)) return lost;
  QpObj* d = FindQpByNum(qp->attr.dest_qp_num);
  if (d == nullptr || d->ex.qp_base.qp_type != q.qp_type ||
      (d->ex.qp_base.state != IBV_QPS_RTR && d->ex.qp_base.state != IBV_QPS_RTS))
    return lost;
  // A remote access error is reported to the requester on RC; UC drops.
  const ibv_wc_status remote_access = rc ? IBV_WC_REM_ACCESS_ERR : IBV_WC_SUCCESS;

  switch (w.opcode) {
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM:
    case IBV_WR_SEND_WITH_INV: {
      if (w.opcode == IBV_WR_SEND_WITH_INV && FindMr(d->pd, w.invalidate_rkey, true) == nullptr)
        return rc ? IBV_WC_REM_OP_ERR : IBV_WC_SUCCESS;
      RecvWr r;
      if (!pop_recv(d, &r)) return rc ? IBV_WC_RNR_RETRY_EXC_ERR : IBV_WC_SUCCESS;
      ibv_wc wc = new_recv_wc(d, r, IBV_WC_RECV);
      wc.src_qp = q.qp_num;
      if (w.opcode == IBV_WR_SEND_WITH_IMM) {
        wc.wc_flags = IBV_WC_WITH_IMM;
        wc.imm_data = w.imm;
      } else if (w.opcode == IBV_WR_SEND_WITH_INV) {
        wc.wc_flags = IBV_WC_WITH_INV;
        wc.invalidated_rkey = w.invalidate_rkey;
      }
      wc.status = scatter(d, r, payload);
      wc.byte_len = static_cast<uint32_t>(payload.size());
      Complete(d->recv_cq, wc, w.flags & IBV_SEND_SOLICITED);
      if (wc.status != IBV_WC_SUCCESS) {
        fail_responder(d);
        if (!rc) return IBV_WC_SUCCESS;
        return wc.status == IBV_WC_LOC_LEN_ERR ? IBV_WC_REM_INV_REQ_ERR : IBV_WC_REM_OP_ERR;
      }
      return IBV_WC_SUCCESS;
    }
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM: {
      // The responder QP must allow remote writes (as rxe checks), even
      // zero-length ones, which check no rkey (IBTA C9-88).
      if (!(d->attr.qp_access_flags & IBV_ACCESS_REMOTE_WRITE))
        return rc ? IBV_WC_REM_INV_REQ_ERR : IBV_WC_SUCCESS;
      if (payload.empty() && w.opcode == IBV_WR_RDMA_WRITE) return IBV_WC_SUCCESS;
      MrObj* mr = FindMr(d->pd, w.rkey, true);
      char* host = mr ? HostRange(mr->mr, mr->iova, w.remote_addr, payload.size()) : nullptr;
      if (host == nullptr || !(mr->access & IBV_ACCESS_REMOTE_WRITE)) return remote_access;
      if (w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
        RecvWr r;
        if (!pop_recv(d, &r)) return rc ? IBV_WC_RNR_RETRY_EXC_ERR : IBV_WC_SUCCESS;
        ibv_wc wc = new_recv_wc(d, r, IBV_WC_RECV_RDMA_WITH_IMM);
        wc.src_qp = q.qp_num;
        wc.wc_flags = IBV_WC_WITH_IMM;
        wc.imm_data = w.imm;
        wc.byte_len = static_cast<uint32_t>(payload.size());
        memcpy(host, payload.data(), payload.size());
        Complete(d->recv_cq, wc, w.flags & IBV_SEND_SOLICITED);
      } else {
        memcpy(host, payload.data(), payload.size());
      }
      return IBV_WC_SUCCESS;
    }
    case IBV_WR_RDMA_READ: {
      uint64_t len = 0;
      for (const ibv_sge& g : w.sges) len += g.length;
      MrObj* mr = FindMr(d->pd, w.rkey, true);
      const char* src = mr ? HostRange(mr->mr, mr->iova, w.remote_addr, len) : nullptr;
      if (src == nullptr || !(mr->access & IBV_ACCESS_REMOTE_READ)) return remote_access;
      for (const ibv_sge& g : w.sges) {
        MrObj* local = FindMr(qp->pd, g.lkey, false);
        memcpy(HostRange(local->mr, local->iova, g.addr, g.length), src, g.length);
        src += g.length;
      }
      *byte_len = static_cast<uint32_t>(len);
      return IBV_WC_SUCCESS;
    }
    case IBV_WR_ATOMIC_CMP_AND_SWP:
    case IBV_WR_ATOMIC_FETCH_AND_ADD: {
      if (w.sges.size() != 1 || w.sges[0].length != 8) return IBV_WC_LOC_LEN_ERR;
      if (w.remote_addr % 8 != 0) return IBV_WC_REM_INV_REQ_ERR;
      MrObj* mr = FindMr(d->pd, w.rkey, true);
      char* host = mr ? HostRange(mr->mr, mr->iova, w.remote_addr, 8) : nullptr;
      if (host == nullptr || !(mr->access & IBV_ACCESS_REMOTE_ATOMIC)) return remote_access;
      uint64_t old;
      memcpy(&old, host, 8);
      uint64_t now = old;
      if (w.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
        now = old + w.compare_add;
      } else if (old == w.compare_add) {
        now = w.swap;
      }
      memcpy(host, &now, 8);
      MrObj* local = FindMr(qp->pd, w.sges[0].lkey, false);
      memcpy(HostRange(local->mr, local->iova, w.sges[0].addr, 8), &old, 8);
      *byte_len = 8;
      return IBV_WC_SUCCESS;
    }
    default:
      return IBV_WC_LOC_QP_OP_ERR;
  }
}

// ---------------------------------------------------------------- switches, records

void FakeBackend::FailNext(Op op, int error) {
  std::lock_guard<std::mutex> lock(mu_);
  faults_[op] = error;
}
void FakeBackend::set_ud_delivery_delay_ms(int ms) {
  std::lock_guard<std::mutex> lock(mu_);
  ud_delay_ms_ = ms;
}
void FakeBackend::set_stall_open_device(bool stall) {
  {
    std::lock_guard<std::mutex> lock(stall_mu_);
    stall_open_device_ = stall;
  }
  stall_cv_.notify_all();
}
int FakeBackend::stalled_opens() {
  std::lock_guard<std::mutex> lock(stall_mu_);
  return stalled_opens_;
}
void FakeBackend::SetNextQpn(uint32_t qpn) {
  std::lock_guard<std::mutex> lock(mu_);
  forced_qpn_ = qpn;
}
void FakeBackend::SetNextMrIndex(uint32_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  next_mr_index_ = index;
}
void FakeBackend::InjectAsyncEvent(ibv_context* ctx, const ibv_async_event& event) {
  std::lock_guard<std::mutex> lock(mu_);
  ContextObj* c = Lookup(contexts_, ctx);
  if (c == nullptr) return;
  c->async_events.push_back(event);
  Signal(ctx->async_fd);
}

std::vector<FakeBackend::SendRecord> FakeBackend::sends() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sends_;
}
std::vector<FakeBackend::SendRecord> FakeBackend::refused_sends() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_sends_;
}
std::vector<FakeBackend::RecvRecord> FakeBackend::recvs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return recvs_;
}
std::vector<FakeBackend::ModifyRecord> FakeBackend::modifies() const {
  std::lock_guard<std::mutex> lock(mu_);
  return modifies_;
}
std::vector<FakeBackend::AhRecord> FakeBackend::ahs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ah_records_;
}
std::vector<ibv_async_event> FakeBackend::acked_async_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return acked_async_;
}
std::vector<std::pair<ibv_cq*, unsigned int>> FakeBackend::acked_cq_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return acked_cq_events_;
}
int FakeBackend::post_send_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return post_send_calls_;
}
int FakeBackend::poll_cq_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return poll_cq_calls_;
}
int FakeBackend::create_qp_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return create_qp_calls_;
}
int FakeBackend::foreign_objects() const {
  std::lock_guard<std::mutex> lock(mu_);
  return foreign_;
}
int FakeBackend::live_objects() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(contexts_.size() + pds_.size() + mrs_.size() + channels_.size() +
                          cqs_.size() + srqs_.size() + qps_.size() + ahs_.size());
}
ibv_qp* FakeBackend::QpByNum(uint32_t qpn) const {
  std::lock_guard<std::mutex> lock(mu_);
  QpObj* qp = FindQpByNum(qpn);
  return qp != nullptr ? &qp->ex.qp_base : nullptr;
}
ibv_mr* FakeBackend::MrByLkey(uint32_t lkey) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [p, mr] : mrs_)
    if (mr->mr.lkey == lkey) return &mr->mr;
  return nullptr;
}

// ---------------------------------------------------------------- devices

ibv_device** FakeBackend::GetDeviceList(int* num) {
  if (num != nullptr) *num = 1;
  return new ibv_device* [2] { &device_, nullptr };
}

void FakeBackend::FreeDeviceList(ibv_device** list) { delete[] list; }

ibv_context* FakeBackend::OpenDevice(ibv_device* device) {
  {
    std::unique_lock<std::mutex> stall(stall_mu_);
    ++stalled_opens_;
    stall_cv_.wait(stall, [this] { return !stall_open_device_; });
    --stalled_opens_;
  }
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kOpenDevice, &err)) {
    errno = err;
    return nullptr;
  }
  if (device != &device_) {
    ++foreign_;
    errno = ENODEV;
    return nullptr;
  }
  auto obj = std::make_unique<ContextObj>();
  obj->fake = this;
  ibv_context* c = &obj->vctx.context;
  c->device = &device_;
  c->cmd_fd = -1;
  c->async_fd = NewEventFd();
  c->num_comp_vectors = 1;
  pthread_mutex_init(&c->mutex, nullptr);
  c->abi_compat = __VERBS_ABI_IS_EXTENDED;
  c->ops.post_send = Ops::PostSend;
  c->ops.post_recv = Ops::PostRecv;
  c->ops.post_srq_recv = Ops::PostSrqRecv;
  c->ops.poll_cq = Ops::PollCq;
  c->ops.req_notify_cq = Ops::ReqNotifyCq;
  obj->vctx.sz = sizeof(verbs_context);
  obj->vctx.query_device_ex = Ops::QueryDeviceEx;
  contexts_[c] = std::move(obj);
  return c;
}

int FakeBackend::CloseDevice(ibv_context* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kCloseDevice, &err)) return err;
  if (Lookup(contexts_, ctx) == nullptr) return EINVAL;
  contexts_.erase(ctx);
  return 0;
}

int FakeBackend::GetAsyncEvent(ibv_context* ctx, ibv_async_event* event) {
  std::lock_guard<std::mutex> lock(mu_);
  ContextObj* c = Lookup(contexts_, ctx);
  if (c == nullptr) {
    errno = EINVAL;
    return -1;
  }
  // The async fd is non-blocking here: no event, no wait.
  if (c->async_events.empty()) {
    errno = EAGAIN;
    return -1;
  }
  *event = c->async_events.front();
  c->async_events.pop_front();
  Consume(ctx->async_fd);
  return 0;
}

void FakeBackend::AckAsyncEvent(ibv_async_event* event) {
  std::lock_guard<std::mutex> lock(mu_);
  switch (ElementOf(event->event_type)) {
    case EventElement::kQp:
      Lookup(qps_, event->element.qp);
      break;
    case EventElement::kCq:
      Lookup(cqs_, event->element.cq);
      break;
    case EventElement::kSrq:
      Lookup(srqs_, event->element.srq);
      break;
    case EventElement::kOther:
      break;
  }
  acked_async_.push_back(*event);
}

// ---------------------------------------------------------------- queries

int FakeBackend::QueryDevice(ibv_context* ctx, ibv_device_attr* attr) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Lookup(contexts_, ctx) == nullptr) return EINVAL;
  memset(attr, 0, sizeof(*attr));
  strcpy(attr->fw_ver, "1.0.0-fake");
  attr->node_guid = 0x0900'4dfe'ff3e'1602;
  attr->sys_image_guid = attr->node_guid;
  attr->max_mr_size = ~0ull;
  attr->page_size_cap = 0xfffff000;
  attr->vendor_id = 0xfa4e;
  attr->max_qp = 1 << 16;
  attr->max_qp_wr = kMaxWr;
  attr->max_sge = kMaxSge;
  attr->max_sge_rd = kMaxSge;
  attr->max_cq = 1 << 16;
  attr->max_cqe = kMaxCqe;
  attr->max_mr = 1 << 16;
  attr->max_pd = 1 << 16;
  attr->max_qp_rd_atom = 128;
  attr->max_qp_init_rd_atom = 128;
  attr->max_res_rd_atom = 1 << 16;
  attr->atomic_cap = IBV_ATOMIC_HCA;
  attr->max_ah = 1 << 16;
  attr->max_srq = 1 << 16;
  attr->max_srq_wr = kMaxWr;
  attr->max_srq_sge = kMaxSge;
  attr->max_pkeys = 1;
  attr->phys_port_cnt = 1;
  return 0;
}

int FakeBackend::QueryPort(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Lookup(contexts_, ctx) == nullptr || port != kPort) return EINVAL;
  memset(attr, 0, sizeof(*attr));
  attr->state = IBV_PORT_ACTIVE;
  attr->max_mtu = IBV_MTU_4096;
  attr->active_mtu = IBV_MTU_1024;
  attr->gid_tbl_len = kGidCount;
  attr->max_msg_sz = 1u << 31;
  attr->pkey_tbl_len = 1;
  attr->active_width = 1;
  attr->active_speed = 1;
  attr->phys_state = 5;  // LinkUp
  attr->link_layer = IBV_LINK_LAYER_ETHERNET;
  return 0;
}

int FakeBackend::QueryGid(ibv_context* ctx, uint8_t port, int index, ibv_gid* gid) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kQueryGid, &err)) {
    errno = err;
    return -1;
  }
  // As libibverbs: -1 with errno.
  if (Lookup(contexts_, ctx) == nullptr || port != kPort || index < 0 || index >= kGidCount) {
    errno = EINVAL;
    return -1;
  }
  *gid = Gid(index);
  return 0;
}

int FakeBackend::QueryGidEx(ibv_context* ctx, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                            uint32_t flags, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Lookup(contexts_, ctx) == nullptr || port != kPort || flags != 0 ||
      size < sizeof(ibv_gid_entry) || index >= static_cast<uint32_t>(kGidCount))
    return EINVAL;
  memset(entry, 0, size);
  entry->gid = Gid(static_cast<int>(index));
  entry->gid_index = index;
  entry->port_num = port;
  entry->gid_type = IBV_GID_TYPE_ROCE_V2;
  entry->ndev_ifindex = 2;
  return 0;
}

ssize_t FakeBackend::QueryGidTable(ibv_context* ctx, ibv_gid_entry* entries, size_t max,
                                   uint32_t flags, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Lookup(contexts_, ctx) == nullptr || flags != 0 || size < sizeof(ibv_gid_entry) ||
      max < static_cast<size_t>(kGidCount))
    return -EINVAL;
  for (int i = 0; i < kGidCount; ++i) {
    auto* e = reinterpret_cast<ibv_gid_entry*>(reinterpret_cast<char*>(entries) + i * size);
    memset(e, 0, size);
    e->gid = Gid(i);
    e->gid_index = static_cast<uint32_t>(i);
    e->port_num = kPort;
    e->gid_type = IBV_GID_TYPE_ROCE_V2;
    e->ndev_ifindex = 2;
  }
  return kGidCount;
}

int FakeBackend::QueryPkey(ibv_context* ctx, uint8_t port, int index, __be16* pkey) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Lookup(contexts_, ctx) == nullptr || port != kPort || index != 0) {
    errno = EINVAL;
    return -1;
  }
  *pkey = htobe16(0xffff);
  return 0;
}

int FakeBackend::GetPkeyIndex(ibv_context* ctx, uint8_t port, __be16 pkey) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Lookup(contexts_, ctx) == nullptr || port != kPort || pkey != htobe16(0xffff)) {
    errno = EINVAL;
    return -1;
  }
  return 0;
}

// ---------------------------------------------------------------- PD, MR

ibv_pd* FakeBackend::AllocPd(ibv_context* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Refused(Op::kAllocPd, Lookup(contexts_, ctx) != nullptr)) return nullptr;
  auto obj = std::make_unique<PdObj>();
  obj->pd.context = ctx;
  obj->pd.handle = next_handle_++;
  ibv_pd* p = &obj->pd;
  pds_[p] = std::move(obj);
  return p;
}

int FakeBackend::DeallocPd(ibv_pd* pd) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kDeallocPd, &err)) return err;
  if (Lookup(pds_, pd) == nullptr) return EINVAL;
  // The kernel refuses while anything still uses the PD.
  for (const auto& [p, mr] : mrs_)
    if (mr->mr.pd == pd) return EBUSY;
  for (const auto& [p, qp] : qps_)
    if (qp->ex.qp_base.pd == pd) return EBUSY;
  for (const auto& [p, srq] : srqs_)
    if (srq->srq.pd == pd) return EBUSY;
  for (const auto& [p, ah] : ahs_)
    if (ah->ah.pd == pd) return EBUSY;
  pds_.erase(pd);
  return 0;
}

ibv_mr* FakeBackend::RegMr(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                           unsigned int access) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Refused(Op::kRegMr, Lookup(pds_, pd) != nullptr)) return nullptr;
  // Remote write and atomics need local write, as the kernel checks.
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
      !(access & IBV_ACCESS_LOCAL_WRITE)) {
    errno = EINVAL;
    return nullptr;
  }
  auto obj = std::make_unique<MrObj>();
  obj->mr.context = pd->context;
  obj->mr.pd = pd;
  obj->mr.addr = addr;
  obj->mr.length = length;
  obj->mr.handle = next_handle_++;
  obj->mr.lkey = obj->mr.rkey = NewKey();  // rxe: one key for both
  obj->iova = iova;
  obj->access = access;
  ibv_mr* m = &obj->mr;
  mrs_[m] = std::move(obj);
  return m;
}

int FakeBackend::ReregMr(ibv_mr* mr, int flags, ibv_pd* pd, void* addr, size_t length, int access) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kReregMr, &err)) return err;
  MrObj* m = Lookup(mrs_, mr);
  if (m == nullptr) return EINVAL;
  if ((flags & IBV_REREG_MR_CHANGE_PD) && Lookup(pds_, pd) == nullptr) return EINVAL;
  if (flags & IBV_REREG_MR_CHANGE_PD) mr->pd = pd;
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    mr->addr = addr;
    mr->length = length;
    m->iova = reinterpret_cast<uintptr_t>(addr);
  }
  if (flags & IBV_REREG_MR_CHANGE_ACCESS) m->access = static_cast<unsigned int>(access);
  // Same index, new key byte: the keys change, as on rxe.
  mr->lkey = mr->rkey = (mr->lkey & ~0xffu) | ((mr->lkey + 1) & 0xff);
  return 0;
}

int FakeBackend::DeregMr(ibv_mr* mr) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kDeregMr, &err)) return err;
  if (Lookup(mrs_, mr) == nullptr) return EINVAL;
  mrs_.erase(mr);
  return 0;
}

// ---------------------------------------------------------------- CQ

ibv_comp_channel* FakeBackend::CreateCompChannel(ibv_context* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Refused(Op::kCreateCompChannel, Lookup(contexts_, ctx) != nullptr)) return nullptr;
  auto obj = std::make_unique<ChannelObj>();
  obj->ch.context = ctx;
  obj->ch.fd = blocking_channels_ ? eventfd(0, EFD_CLOEXEC | EFD_SEMAPHORE) : NewEventFd();
  if (obj->ch.fd < 0) return nullptr;
  ibv_comp_channel* c = &obj->ch;
  channels_[c] = std::move(obj);
  return c;
}

int FakeBackend::DestroyCompChannel(ibv_comp_channel* channel) {
  std::lock_guard<std::mutex> lock(mu_);
  ChannelObj* ch = Lookup(channels_, channel);
  if (ch == nullptr) return EINVAL;
  if (channel->refcnt != 0) return EBUSY;
  // A reader blocked on it wakes with EIO; the object stays readable by
  // that reader (its file outlives the fd, as in the kernel). With no
  // reader the fd is closed now, as the kernel closes it: its number is
  // free again, and it leaves every epoll set it was in.
  ch->closed = true;
  const uint64_t one = 1;
  if (write(ch->ch.fd, &one, sizeof one) < 0) return errno;
  if (ch->readers == 0) {
    close(ch->ch.fd);
    ch->ch.fd = -1;
  }
  closed_channels_.push_back(std::move(channels_[channel]));
  channels_.erase(channel);
  return 0;
}

ibv_cq* FakeBackend::CreateCq(ibv_context* ctx, int cqe, void* cq_context,
                              ibv_comp_channel* channel, int comp_vector) {
  ibv_cq_init_attr_ex attr{};
  attr.cqe = static_cast<uint32_t>(cqe);
  attr.cq_context = cq_context;
  attr.channel = channel;
  attr.comp_vector = static_cast<uint32_t>(comp_vector);
  if (cqe < 1) {
    errno = EINVAL;
    return nullptr;
  }
  // Shares CreateCqEx's checks; only the ex pointers differ.
  ibv_cq_ex* cq = CreateCqEx(ctx, &attr);
  if (cq == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  CqObj* obj = Ops::AsCq(cq);
  obj->extended = false;
  ibv_cq_ex& ex = obj->ex;
  ex.start_poll = nullptr;
  ex.next_poll = nullptr;
  ex.end_poll = nullptr;
  ex.read_opcode = nullptr;
  ex.read_vendor_err = nullptr;
  ex.read_byte_len = nullptr;
  ex.read_imm_data = nullptr;
  ex.read_qp_num = nullptr;
  ex.read_src_qp = nullptr;
  ex.read_wc_flags = nullptr;
  ex.read_slid = nullptr;
  ex.read_sl = nullptr;
  ex.read_dlid_path_bits = nullptr;
  return ibv_cq_ex_to_cq(cq);
}

ibv_cq_ex* FakeBackend::CreateCqEx(ibv_context* ctx, ibv_cq_init_attr_ex* attr) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Refused(Op::kCreateCq, Lookup(contexts_, ctx) != nullptr)) return nullptr;
  if ((attr->comp_mask & ~IBV_CQ_INIT_ATTR_MASK_FLAGS) ||
      (attr->wc_flags & ~static_cast<uint64_t>(IBV_WC_STANDARD_FLAGS))) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  ChannelObj* ch = nullptr;
  if (attr->channel != nullptr && (ch = Lookup(channels_, attr->channel)) == nullptr) {
    errno = EINVAL;
    return nullptr;
  }
  if (attr->cqe < 1 || attr->cqe > static_cast<uint32_t>(kMaxCqe) || attr->comp_vector != 0) {
    errno = EINVAL;
    return nullptr;
  }
  auto obj = std::make_unique<CqObj>();
  obj->extended = true;
  obj->channel = ch;
  ibv_cq_ex& ex = obj->ex;
  ex.context = ctx;
  ex.channel = attr->channel;
  ex.cq_context = attr->cq_context;
  ex.handle = next_handle_++;
  // Providers round the size up; callers must read it back.
  ex.cqe = static_cast<int>(RoundUpPow2(attr->cqe + 1) - 1);
  pthread_mutex_init(&ex.mutex, nullptr);
  pthread_cond_init(&ex.cond, nullptr);
  ex.start_poll = Ops::StartPoll;
  ex.next_poll = Ops::NextPoll;
  ex.end_poll = Ops::EndPoll;
  ex.read_opcode = Ops::ReadOpcode;
  ex.read_vendor_err = Ops::ReadVendorErr;
  ex.read_byte_len = Ops::ReadByteLen;
  ex.read_imm_data = Ops::ReadImmData;
  ex.read_qp_num = Ops::ReadQpNum;
  ex.read_src_qp = Ops::ReadSrcQp;
  ex.read_wc_flags = Ops::ReadWcFlags;
  ex.read_slid = Ops::ReadSlid;
  ex.read_sl = Ops::ReadSl;
  ex.read_dlid_path_bits = Ops::ReadDlidPathBits;
  if (ch != nullptr) ++ch->ch.refcnt;
  ibv_cq_ex* c = &obj->ex;
  cqs_[c] = std::move(obj);
  return c;
}

int FakeBackend::ResizeCq(ibv_cq* cq, int cqe) {
  std::lock_guard<std::mutex> lock(mu_);
  CqObj* c = Lookup(cqs_, cq);
  if (c == nullptr || cqe < 1 || cqe > kMaxCqe || static_cast<size_t>(cqe) < c->wcs.size())
    return EINVAL;
  cq->cqe = static_cast<int>(RoundUpPow2(static_cast<uint32_t>(cqe) + 1) - 1);
  return 0;
}

int FakeBackend::DestroyCq(ibv_cq* cq) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kDestroyCq, &err)) return err;
  CqObj* c = Lookup(cqs_, cq);
  if (c == nullptr) return EINVAL;
  for (const auto& [p, qp] : qps_)
    if (qp->send_cq == c || qp->recv_cq == c) return EBUSY;
  if (c->events_read != c->events_acked) ++blocked_destroys_;  // libibverbs would wait forever
  if (c->channel != nullptr) {
    --c->channel->ch.refcnt;
    std::erase(c->channel->events, cq);
  }
  cqs_.erase(cq);
  return 0;
}

int FakeBackend::GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
  std::unique_lock<std::mutex> lock(mu_);
  ChannelObj* ch = Lookup(channels_, channel);
  if (ch == nullptr) {
    errno = EINVAL;
    return -1;
  }
  const int fd = channel->fd;
  while (ch->events.empty()) {
    if (ch->closed) {
      errno = EIO;
      return -1;
    }
    // A non-blocking channel fd: no event, no wait.
    if (!blocking_channels_) {
      errno = EAGAIN;
      return -1;
    }
    // Blocking: one count of the eventfd per event, as one read(2) per event.
    ++ch->readers;
    lock.unlock();
    uint64_t v;
    const ssize_t n = read(fd, &v, sizeof v);
    const int err = errno;
    lock.lock();
    --ch->readers;
    if (n < 0 && err == EAGAIN) {  // the application made the fd non-blocking
      errno = EAGAIN;
      return -1;
    }
    if (n == sizeof v && !ch->closed && ch->events.empty()) continue;  // taken by another reader
    if (n == sizeof v && !ch->events.empty()) {
      *cq = ch->events.front();
      ch->events.pop_front();
      ++Lookup(cqs_, *cq)->events_read;
      *cq_context = (*cq)->cq_context;
      return 0;
    }
  }
  *cq = ch->events.front();
  ch->events.pop_front();
  Consume(fd);
  ++Lookup(cqs_, *cq)->events_read;
  *cq_context = (*cq)->cq_context;
  return 0;
}

void FakeBackend::AckCqEvents(ibv_cq* cq, unsigned int nevents) {
  std::lock_guard<std::mutex> lock(mu_);
  if (CqObj* c = Lookup(cqs_, cq)) c->events_acked += nevents;
  acked_cq_events_.emplace_back(cq, nevents);
}

void FakeBackend::set_blocking_channels(bool blocking) {
  std::lock_guard<std::mutex> lock(mu_);
  blocking_channels_ = blocking;
}

int FakeBackend::blocked_destroys() const {
  std::lock_guard<std::mutex> lock(mu_);
  return blocked_destroys_;
}

// ---------------------------------------------------------------- SRQ

ibv_srq* FakeBackend::CreateSrq(ibv_pd* pd, ibv_srq_init_attr* attr) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kCreateSrq, &err)) {
    errno = err;
    return nullptr;
  }
  PdObj* p = Lookup(pds_, pd);
  if (p == nullptr || attr->attr.max_wr < 1 || attr->attr.max_wr > kMaxWr ||
      attr->attr.max_sge > kMaxSge || attr->attr.srq_limit > attr->attr.max_wr) {
    errno = EINVAL;
    return nullptr;
  }
  auto obj = std::make_unique<SrqObj>();
  obj->pd = p;
  obj->srq.context = pd->context;
  obj->srq.srq_context = attr->srq_context;
  obj->srq.pd = pd;
  obj->srq.handle = next_handle_++;
  pthread_mutex_init(&obj->srq.mutex, nullptr);
  pthread_cond_init(&obj->srq.cond, nullptr);
  attr->attr.max_wr = RoundUpPow2(attr->attr.max_wr);
  obj->attr = attr->attr;
  obj->max_sge = attr->attr.max_sge;
  ibv_srq* s = &obj->srq;
  srqs_[s] = std::move(obj);
  return s;
}

int FakeBackend::ModifySrq(ibv_srq* srq, ibv_srq_attr* attr, int mask) {
  std::lock_guard<std::mutex> lock(mu_);
  SrqObj* s = Lookup(srqs_, srq);
  if (s == nullptr || (mask & IBV_SRQ_MAX_WR)) return EINVAL;  // no resizing
  if (mask & IBV_SRQ_LIMIT) {
    if (attr->srq_limit > s->attr.max_wr) return EINVAL;
    s->attr.srq_limit = attr->srq_limit;
  }
  return 0;
}

int FakeBackend::QuerySrq(ibv_srq* srq, ibv_srq_attr* attr) {
  std::lock_guard<std::mutex> lock(mu_);
  SrqObj* s = Lookup(srqs_, srq);
  if (s == nullptr) return EINVAL;
  *attr = s->attr;
  return 0;
}

int FakeBackend::DestroySrq(ibv_srq* srq) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kDestroySrq, &err)) return err;
  SrqObj* s = Lookup(srqs_, srq);
  if (s == nullptr) return EINVAL;
  for (const auto& [p, qp] : qps_)
    if (qp->srq == s) return EBUSY;
  srqs_.erase(srq);
  return 0;
}

// ---------------------------------------------------------------- QP

ibv_qp* FakeBackend::CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr) {
  std::lock_guard<std::mutex> lock(mu_);
  ++create_qp_calls_;
  if (Refused(Op::kCreateQp, Lookup(pds_, pd) != nullptr)) return nullptr;
  ibv_qp_init_attr_ex ex = ToInitAttrEx(pd, *attr);
  ibv_qp* qp = CreateQpLocked(pd->context, &ex);
  if (qp != nullptr) attr->cap = ex.cap;
  return qp;
}

ibv_qp* FakeBackend::CreateQpEx(ibv_context* ctx, ibv_qp_init_attr_ex* attr) {
  std::lock_guard<std::mutex> lock(mu_);
  ++create_qp_calls_;
  int err;
  if (TakeFault(Op::kCreateQp, &err)) {
    errno = err;
    return nullptr;
  }
  return CreateQpLocked(ctx, attr);
}

ibv_qp* FakeBackend::CreateQpLocked(ibv_context* ctx, ibv_qp_init_attr_ex* attr) {
  constexpr uint64_t kOps = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |
                            IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM |
                            IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
                            IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | IBV_QP_EX_WITH_SEND_WITH_INV;
  auto fail = [](int e) -> ibv_qp* {
    errno = e;
    return nullptr;
  };
  if (Lookup(contexts_, ctx) == nullptr) return fail(EINVAL);
  if (attr->comp_mask &
      ~(IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS | IBV_QP_INIT_ATTR_CREATE_FLAGS))
    return fail(EOPNOTSUPP);
  if (!(attr->comp_mask & IBV_QP_INIT_ATTR_PD)) return fail(EINVAL);
  if ((attr->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) && attr->create_flags != 0)
    return fail(EOPNOTSUPP);
  const bool extended = attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  if (extended && (attr->send_ops_flags & ~kOps)) return fail(EOPNOTSUPP);
  if (attr->qp_type != IBV_QPT_RC && attr->qp_type != IBV_QPT_UC && attr->qp_type != IBV_QPT_UD)
    return fail(EOPNOTSUPP);
  PdObj* pd = Lookup(pds_, attr->pd);
  CqObj* send_cq = Lookup(cqs_, attr->send_cq);
  CqObj* recv_cq = Lookup(cqs_, attr->recv_cq);
  SrqObj* srq = Lookup(srqs_, attr->srq);
  if (pd == nullptr || send_cq == nullptr || recv_cq == nullptr ||
      (attr->srq != nullptr && srq == nullptr) || pd->pd.context != ctx)
    return fail(EINVAL);
  ibv_qp_cap cap = attr->cap;
  if (cap.max_send_wr > kMaxWr || cap.max_recv_wr > kMaxWr || cap.max_send_sge > kMaxSge ||
      cap.max_recv_sge > kMaxSge || cap.max_inline_data > kMaxInline)
    return fail(EINVAL);
  uint32_t qpn = forced_qpn_;
  forced_qpn_ = 0;
  if (qpn != 0 && FindQpByNum(qpn) != nullptr) return fail(EBUSY);
  while (qpn == 0 || FindQpByNum(qpn) != nullptr) qpn = next_qpn_++;

  auto obj = std::make_unique<QpObj>();
  obj->extended = extended;
  obj->pd = pd;
  obj->send_cq = send_cq;
  obj->recv_cq = recv_cq;
  obj->srq = srq;
  obj->sq_sig_all = attr->sq_sig_all;
  // Providers round queue sizes up and report them back.
  cap.max_send_wr = RoundUpPow2(cap.max_send_wr < 1 ? 1 : cap.max_send_wr);
  cap.max_recv_wr = srq ? 0 : RoundUpPow2(cap.max_recv_wr < 1 ? 1 : cap.max_recv_wr);
  if (srq) cap.max_recv_sge = 0;
  attr->cap = cap;
  obj->cap = cap;
  ibv_qp& q = obj->ex.qp_base;
  q.context = ctx;
  q.qp_context = attr->qp_context;
  q.pd = attr->pd;
  q.send_cq = attr->send_cq;
  q.recv_cq = attr->recv_cq;
  q.srq = attr->srq;
  q.handle = next_handle_++;
  q.qp_num = qpn;
  q.state = IBV_QPS_RESET;
  q.qp_type = attr->qp_type;
  pthread_mutex_init(&q.mutex, nullptr);
  pthread_cond_init(&q.cond, nullptr);
  obj->attr.qp_state = IBV_QPS_RESET;
  if (extended) {
    ibv_qp_ex& x = obj->ex;
    x.wr_start = Ops::WrStart;
    x.wr_complete = Ops::WrComplete;
    x.wr_abort = Ops::WrAbort;
    x.wr_send = Ops::WrSend;
    x.wr_send_imm = Ops::WrSendImm;
    x.wr_send_inv = Ops::WrSendInv;
    x.wr_rdma_write = Ops::WrRdmaWrite;
    x.wr_rdma_write_imm = Ops::WrRdmaWriteImm;
    x.wr_rdma_read = Ops::WrRdmaRead;
    x.wr_atomic_cmp_swp = Ops::WrAtomicCmpSwp;
    x.wr_atomic_fetch_add = Ops::WrAtomicFetchAdd;
    x.wr_set_ud_addr = Ops::WrSetUdAddr;
    x.wr_set_sge = Ops::WrSetSge;
    x.wr_set_sge_list = Ops::WrSetSgeList;
    x.wr_set_inline_data = Ops::WrSetInlineData;
    x.wr_set_inline_data_list = Ops::WrSetInlineDataList;
  }
  qps_[&q] = std::move(obj);
  return &q;
}

ibv_qp_ex* FakeBackend::QpToQpEx(ibv_qp* qp) {
  std::lock_guard<std::mutex> lock(mu_);
  QpObj* q = Lookup(qps_, qp);
  return q != nullptr && q->extended ? &q->ex : nullptr;
}

int FakeBackend::ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask) {
  std::lock_guard<std::mutex> lock(mu_);
  ModifyRecord rec;
  rec.qp = qp;
  rec.attr = *attr;
  rec.mask = mask;
  QpObj* q = Lookup(qps_, qp);
  if (q != nullptr) rec.qp_num = qp->qp_num;
  auto finish = [&](int rc) {
    rec.rc = rc;
    modifies_.push_back(rec);
    return rc;
  };
  int err;
  if (TakeFault(Op::kModifyQp, &err)) return finish(err);
  if (q == nullptr) return finish(EINVAL);

  const ibv_qp_state cur = qp->state;
  const ibv_qp_state next = (mask & IBV_QP_STATE) ? attr->qp_state : cur;
  if ((mask & IBV_QP_CUR_STATE) && attr->cur_qp_state != cur) return finish(EINVAL);
  const ibv_qp_type type = qp->qp_type;
  int required = 0;
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) {
    required = IBV_QP_STATE;
  } else if (cur == IBV_QPS_RESET && next == IBV_QPS_INIT) {
    required = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
               (type == IBV_QPT_UD ? IBV_QP_QKEY : IBV_QP_ACCESS_FLAGS);
  } else if (cur == IBV_QPS_INIT && next == IBV_QPS_INIT) {
    required = 0;
  } else if (cur == IBV_QPS_INIT && next == IBV_QPS_RTR) {
    required = IBV_QP_STATE;
    if (type != IBV_QPT_UD)
      required |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
    if (type == IBV_QPT_RC) required |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  } else if (cur == IBV_QPS_RTR && next == IBV_QPS_RTS) {
    required = IBV_QP_STATE | IBV_QP_SQ_PSN;
    if (type == IBV_QPT_RC)
      required |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  } else if (cur == IBV_QPS_RTS && next == IBV_QPS_RTS) {
    required = 0;
  } else {
    return finish(EINVAL);
  }
  if ((mask & required) != required) return finish(EINVAL);
  if ((mask & IBV_QP_PORT) && attr->port_num != kPort) return finish(EINVAL);
  if ((mask & IBV_QP_PKEY_INDEX) && attr->pkey_index != 0) return finish(EINVAL);
  if (mask & IBV_QP_AV) {
    // RoCE: every address vector carries a GRH with a valid source index.
    const ibv_ah_attr& ah = attr->ah_attr;
    if (!ah.is_global || ah.grh.sgid_index >= kGidCount ||
        (ah.port_num != 0 && ah.port_num != kPort))
      return finish(EINVAL);
  }

  ibv_qp_attr& a = q->attr;
  if (mask & IBV_QP_STATE) a.qp_state = attr->qp_state;
  if (mask & IBV_QP_PKEY_INDEX) a.pkey_index = attr->pkey_index;
  if (mask & IBV_QP_PORT) a.port_num = attr->port_num;
  if (mask & IBV_QP_ACCESS_FLAGS) a.qp_access_flags = attr->qp_access_flags;
  if (mask & IBV_QP_QKEY) a.qkey = attr->qkey;
  if (mask & IBV_QP_AV) a.ah_attr = attr->ah_attr;
  if (mask & IBV_QP_ALT_PATH) a.alt_ah_attr = attr->alt_ah_attr;
  if (mask & IBV_QP_PATH_MTU) a.path_mtu = attr->path_mtu;
  if (mask & IBV_QP_DEST_QPN) a.dest_qp_num = attr->dest_qp_num;
  if (mask & IBV_QP_RQ_PSN) a.rq_psn = attr->rq_psn;
  if (mask & IBV_QP_SQ_PSN) a.sq_psn = attr->sq_psn;
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) a.max_dest_rd_atomic = attr->max_dest_rd_atomic;
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) a.max_rd_atomic = attr->max_rd_atomic;
  if (mask & IBV_QP_MIN_RNR_TIMER) a.min_rnr_timer = attr->min_rnr_timer;
  if (mask & IBV_QP_TIMEOUT) a.timeout = attr->timeout;
  if (mask & IBV_QP_RETRY_CNT) a.retry_cnt = attr->retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) a.rnr_retry = attr->rnr_retry;
  // libibverbs' ibv_modify_qp records the new state in the ibv_qp.
  qp->state = next;
  if (next == IBV_QPS_RESET) q->rq.clear();
  if (next == IBV_QPS_ERR && cur != IBV_QPS_ERR) FlushRecvs(q);
  return finish(0);
}

int FakeBackend::QueryQp(ibv_qp* qp, ibv_qp_attr* attr, int /*mask*/, ibv_qp_init_attr* init) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kQueryQp, &err)) return err;
  QpObj* q = Lookup(qps_, qp);
  if (q == nullptr) return EINVAL;
  // Like providers: the whole struct, whatever the mask.
  *attr = q->attr;
  attr->qp_state = qp->state;
  attr->cap = q->cap;
  memset(init, 0, sizeof(*init));
  init->qp_context = qp->qp_context;
  init->send_cq = qp->send_cq;
  init->recv_cq = qp->recv_cq;
  init->srq = qp->srq;
  init->cap = q->cap;
  init->qp_type = qp->qp_type;
  init->sq_sig_all = q->sq_sig_all;
  return 0;
}

int FakeBackend::DestroyQp(ibv_qp* qp) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kDestroyQp, &err)) return err;
  QpObj* q = Lookup(qps_, qp);
  if (q == nullptr) return EINVAL;
  // uverbs_free_qp(): a QP still attached to a multicast group stays.
  if (!q->groups.empty()) return EBUSY;
  qps_.erase(qp);
  return 0;
}

// ---------------------------------------------------------------- AH

ibv_ah* FakeBackend::CreateAh(ibv_pd* pd, ibv_ah_attr* attr) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kCreateAh, &err)) {
    errno = err;
    return nullptr;
  }
  PdObj* p = Lookup(pds_, pd);
  // RoCE address handles need a GRH.
  if (p == nullptr || !attr->is_global || attr->grh.sgid_index >= kGidCount ||
      attr->port_num != kPort) {
    errno = EINVAL;
    return nullptr;
  }
  auto obj = std::make_unique<AhObj>();
  obj->pd = p;
  obj->attr = *attr;
  obj->ah.context = pd->context;
  obj->ah.pd = pd;
  obj->ah.handle = next_handle_++;
  ibv_ah* a = &obj->ah;
  ahs_[a] = std::move(obj);
  ah_records_.push_back({a, *attr});
  return a;
}

int FakeBackend::InitAhFromWc(ibv_context* ctx, uint8_t port, ibv_wc* wc, ibv_grh* grh,
                              ibv_ah_attr* attr) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Lookup(contexts_, ctx) == nullptr || port != kPort) return EINVAL;
  memset(attr, 0, sizeof(*attr));
  attr->dlid = static_cast<uint16_t>(wc->slid);
  attr->sl = wc->sl;
  attr->src_path_bits = wc->dlid_path_bits;
  attr->port_num = port;
  if (!(wc->wc_flags & IBV_WC_GRH)) return 0;
  // As libibverbs: a RoCEv2/IPv4 GRH is an IPv4 header in the last 20
  // bytes, behind no IPv6 version nibble (or behind one, with a valid
  // checksum); the reply goes to the packet's source.
  const auto* g = reinterpret_cast<const uint8_t*>(grh);
  ibv_gid local{};
  attr->is_global = 1;
  if (g[20] == 0x45 && ((g[0] >> 4) != 6 || Ipv4Checksum(g + 20) == (g[30] << 8 | g[31]))) {
    attr->grh.dgid.raw[10] = attr->grh.dgid.raw[11] = 0xff;
    memcpy(attr->grh.dgid.raw + 12, g + 32, 4);
    local.raw[10] = local.raw[11] = 0xff;
    memcpy(local.raw + 12, g + 36, 4);
    attr->grh.traffic_class = g[21];
  } else {
    attr->grh.dgid = grh->sgid;
    local = grh->dgid;
    const uint32_t flow = be32toh(grh->version_tclass_flow);
    attr->grh.flow_label = flow & 0xfffff;
    attr->grh.traffic_class = static_cast<uint8_t>(flow >> 20);
  }
  attr->grh.hop_limit = 0xff;
  for (int i = 0; i < kGidCount; ++i) {
    const ibv_gid ours = Gid(i);
    if (memcmp(ours.raw, local.raw, 16) == 0) {
      attr->grh.sgid_index = static_cast<uint8_t>(i);
      return 0;
    }
  }
  return ENOENT;
}

int FakeBackend::DestroyAh(ibv_ah* ah) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (TakeFault(Op::kDestroyAh, &err)) return err;
  if (Lookup(ahs_, ah) == nullptr) return EINVAL;
  ahs_.erase(ah);
  return 0;
}

int FakeBackend::AttachMcast(ibv_qp* qp, const ibv_gid* gid, uint16_t /*lid*/) {
  std::lock_guard<std::mutex> lock(mu_);
  QpObj* q = Lookup(qps_, qp);
  if (q == nullptr || qp->qp_type != IBV_QPT_UD) return EINVAL;
  q->groups.push_back(*gid);
  return 0;
}

int FakeBackend::DetachMcast(ibv_qp* qp, const ibv_gid* gid, uint16_t /*lid*/) {
  std::lock_guard<std::mutex> lock(mu_);
  QpObj* q = Lookup(qps_, qp);
  if (q == nullptr || qp->qp_type != IBV_QPT_UD) return EINVAL;
  const auto same = [gid](const ibv_gid& g) { return memcmp(g.raw, gid->raw, 16) == 0; };
  const auto it = std::find_if(q->groups.begin(), q->groups.end(), same);
  if (it == q->groups.end()) return EINVAL;  // as rxe: not attached
  q->groups.erase(it);
  return 0;
}

std::vector<ibv_gid> FakeBackend::mcast_groups(const ibv_qp* qp) const {
  std::lock_guard<std::mutex> lock(mu_);
  const QpObj* q = Lookup(qps_, qp);
  return q != nullptr ? q->groups : std::vector<ibv_gid>{};
}

}  // namespace rdmavirt::shim
