// The shim's control path over FakeBackend: virtual identities, what the
// backend is given, real objects passed through, unsupported features,
// completion and asynchronous events.
#include "shim/core/shim.h"

#include <fcntl.h>
#include <gtest/gtest.h>

#include <cstring>

#include "tests/shim/verbs_test_util.h"

namespace rdmavirt::shim::testing {
namespace {

ibv_gid Ipv4Mapped(uint8_t a, uint8_t b, uint8_t c, uint8_t d) {
  ibv_gid g{};
  g.raw[10] = g.raw[11] = 0xff;
  g.raw[12] = a;
  g.raw[13] = b;
  g.raw[14] = c;
  g.raw[15] = d;
  return g;
}

TEST_F(ShimTest, QpnsAreVirtualInOffsetMode) {
  ibv_qp* qp = dev().Qp(IBV_QPT_RC);
  const uint32_t physical = ShimQp(qp)->real->qp_num;
  EXPECT_NE(qp->qp_num, physical);
  EXPECT_EQ(qp->qp_num, physical | kQpnMarker);
  EXPECT_EQ(fake_.QpByNum(physical), ShimQp(qp)->real);
  EXPECT_EQ(fake_.QpByNum(qp->qp_num), nullptr);
}

TEST_F(ShimTest, KeysAreVirtualInOffsetMode) {
  char buf[64];
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  const ibv_mr* real = ShimMr(mr)->real;
  EXPECT_NE(mr->lkey, real->lkey);
  EXPECT_NE(mr->rkey, real->rkey);
  EXPECT_EQ(mr->rkey, real->rkey | kRkeyMarker);
  EXPECT_EQ(mr->lkey & kLkeyOffsetBit, kLkeyOffsetBit);
  EXPECT_EQ(mr->lkey & 0xff, real->lkey & 0xff);  // the tag
  EXPECT_EQ(fake_.MrByLkey(mr->lkey), nullptr) << "virtual lkey must not be a device key";
  EXPECT_EQ(mr->addr, static_cast<void*>(buf));
  EXPECT_EQ(mr->length, sizeof(buf));
  EXPECT_EQ(mr->pd, dev().pd);
  EXPECT_EQ(shim_.mr_table().ToPhysical(mr->lkey), real->lkey);
}

TEST_F(ShimTest, GidsAreVirtualInOffsetMode) {
  ibv_gid virt, phys;
  ASSERT_EQ(shim_.QueryGid(dev().ctx, 1, 1, &virt), 0);
  ASSERT_EQ(fake_.QueryGid(AsContext(dev().ctx)->real, 1, 1, &phys), 0);
  EXPECT_TRUE(GidEq(phys, Ipv4Mapped(10, 77, 0, 9)));
  EXPECT_TRUE(GidEq(virt, Ipv4Mapped(10, 77, 0x80, 9)));
  // Link-local too.
  ASSERT_EQ(shim_.QueryGid(dev().ctx, 1, 0, &virt), 0);
  EXPECT_FALSE(GidEq(virt, FakeBackend::Gid(0)));
  EXPECT_TRUE(GidEq(shim_.mode().PhysicalGid(virt), FakeBackend::Gid(0)));

  ibv_gid_entry e{};
  ASSERT_EQ(shim_.QueryGidEx(dev().ctx, 1, 1, &e, 0, sizeof(e)), 0);
  EXPECT_TRUE(GidEq(e.gid, Ipv4Mapped(10, 77, 0x80, 9)));
  EXPECT_EQ(e.gid_type, IBV_GID_TYPE_ROCE_V2);

  // The table, with an entry stride larger than the struct.
  struct Wide {
    ibv_gid_entry e;
    uint64_t extra;
  } table[4];
  ASSERT_EQ(shim_.QueryGidTable(dev().ctx, &table[0].e, 4, 0, sizeof(Wide)), 2);
  EXPECT_TRUE(GidEq(table[0].e.gid, shim_.mode().VirtualGid(FakeBackend::Gid(0))));
  EXPECT_TRUE(GidEq(table[1].e.gid, Ipv4Mapped(10, 77, 0x80, 9)));
}

TEST_F(ShimTest, DefaultModeShowsPhysicalIdentities) {
  FakeBackend fake;
  Shim shim(&fake, IdentityMode{});
  {
    Device<Shim> d(shim);
    ibv_qp* qp = d.Qp(IBV_QPT_RC);
    EXPECT_EQ(qp->qp_num, ShimQp(qp)->real->qp_num);
    char buf[8];
    ibv_mr* mr = d.Reg(buf, sizeof(buf));
    EXPECT_EQ(mr->rkey, ShimMr(mr)->real->rkey);
    // Whatever lkey default mode shows, it reaches the device as the real one.
    EXPECT_EQ(shim.mr_table().ToPhysical(mr->lkey), ShimMr(mr)->real->lkey);
    EXPECT_TRUE(GidEq(d.gid, FakeBackend::Gid(1)));
  }
  EXPECT_EQ(fake.live_objects(), 0);
}

TEST_F(ShimTest, ModifyQpGivesTheBackendPhysicalDestination) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  bool seen = false;
  for (const auto& m : fake_.modifies()) {
    if (!(m.mask & IBV_QP_DEST_QPN)) continue;
    seen = true;
    EXPECT_EQ(m.rc, 0);
    const uint32_t peer =
        m.qp == ShimQp(a)->real ? ShimQp(b)->real->qp_num : ShimQp(a)->real->qp_num;
    EXPECT_EQ(m.attr.dest_qp_num, peer);
    EXPECT_TRUE(GidEq(m.attr.ah_attr.grh.dgid, FakeBackend::Gid(1)));
  }
  EXPECT_TRUE(seen);
  EXPECT_EQ(a->state, IBV_QPS_RTS);
}

TEST_F(ShimTest, QueryQpShowsVirtualIdentities) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(shim_.QueryQp(a, &attr, IBV_QP_STATE | IBV_QP_DEST_QPN | IBV_QP_AV, &init), 0);
  EXPECT_EQ(attr.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(attr.dest_qp_num, b->qp_num);
  EXPECT_TRUE(GidEq(attr.ah_attr.grh.dgid, dev().gid));
  EXPECT_EQ(init.send_cq, dev().cq);
  EXPECT_EQ(init.recv_cq, dev().cq);
}

TEST_F(ShimTest, CreateQpReportsTheProvidersCapabilities) {
  ibv_qp_init_attr attr{};
  attr.send_cq = attr.recv_cq = dev().cq;
  attr.qp_type = IBV_QPT_RC;
  attr.cap.max_send_wr = 100;
  attr.cap.max_recv_wr = 3;
  attr.cap.max_send_sge = 2;
  attr.cap.max_recv_sge = 2;
  ibv_qp* qp = shim_.CreateQp(dev().pd, &attr);
  ASSERT_NE(qp, nullptr);
  EXPECT_EQ(attr.cap.max_send_wr, 128u);
  EXPECT_EQ(attr.cap.max_recv_wr, 4u);
  EXPECT_EQ(qp->send_cq, dev().cq);
  EXPECT_EQ(qp->pd, dev().pd);
  EXPECT_EQ(qp->context, dev().ctx);
  EXPECT_EQ(qp->state, IBV_QPS_RESET);
  EXPECT_EQ(shim_.DestroyQp(qp), 0);
}

TEST_F(ShimTest, CreateAhGivesTheBackendPhysicalGid) {
  ibv_ah* ah = dev().Ah(dev().gid);
  ASSERT_FALSE(fake_.ahs().empty());
  const auto rec = fake_.ahs().back();
  EXPECT_EQ(rec.ah, ShimAh(ah)->real);
  EXPECT_TRUE(GidEq(rec.attr.grh.dgid, FakeBackend::Gid(1)));
  EXPECT_TRUE(GidEq(ShimAh(ah)->attr.grh.dgid, dev().gid)) << "journal keeps the virtual GID";
}

TEST_F(ShimTest, RealObjectsGoStraightToTheBackend) {
  // libibverbs and providers call exported verbs on their own objects.
  ibv_context* ctx = fake_.OpenDevice(fake_.device());
  ASSERT_NE(ctx, nullptr);
  ibv_gid gid;
  ASSERT_EQ(shim_.QueryGid(ctx, 1, 1, &gid), 0);
  EXPECT_TRUE(GidEq(gid, FakeBackend::Gid(1)));
  ibv_pd* pd = shim_.AllocPd(ctx);
  ASSERT_NE(pd, nullptr);
  char buf[16];
  ibv_mr* mr = shim_.RegMr(pd, buf, sizeof(buf), reinterpret_cast<uintptr_t>(buf), kAllAccess);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(fake_.MrByLkey(mr->lkey), mr) << "a real MR keeps its real keys";
  ibv_cq* cq = shim_.CreateCq(ctx, 8, nullptr, nullptr, 0);
  ASSERT_NE(cq, nullptr);
  ibv_qp_init_attr attr{};
  attr.send_cq = attr.recv_cq = cq;
  attr.qp_type = IBV_QPT_UD;
  attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
  attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
  ibv_qp* qp = shim_.CreateQp(pd, &attr);
  ASSERT_NE(qp, nullptr);
  EXPECT_EQ(fake_.QpByNum(qp->qp_num), qp);
  EXPECT_EQ(shim_.Qps().size(), 0u) << "nothing shadowed";
  ibv_ah_attr ah_attr{};
  ah_attr.is_global = 1;
  ah_attr.grh.dgid = FakeBackend::Gid(1);
  ah_attr.grh.sgid_index = 1;
  ah_attr.port_num = 1;
  ibv_ah* ah = shim_.CreateAh(pd, &ah_attr);
  ASSERT_NE(ah, nullptr);
  EXPECT_EQ(fake_.ahs().back().ah, ah);
  EXPECT_EQ(shim_.DestroyAh(ah), 0);
  EXPECT_EQ(shim_.DestroyQp(qp), 0);
  EXPECT_EQ(shim_.DestroyCq(cq), 0);
  EXPECT_EQ(shim_.DeregMr(mr), 0);
  EXPECT_EQ(shim_.DeallocPd(pd), 0);
  EXPECT_EQ(shim_.CloseDevice(ctx), 0);
}

TEST_F(ShimTest, QpToQpExOnlyForExtendedQps) {
  ibv_qp* plain = dev().Qp(IBV_QPT_RC);
  ibv_qp* ex = dev().QpEx(IBV_QPT_RC);
  EXPECT_EQ(shim_.QpToQpEx(plain), nullptr);
  EXPECT_EQ(shim_.QpToQpEx(ex), reinterpret_cast<ibv_qp_ex*>(ex));
}

TEST_F(ShimTest, InlineQueryVerbsReachTheShim) {
  ibv_port_attr port{};
  ASSERT_EQ(ibv_query_port(dev().ctx, 1, &port), 0);
  EXPECT_EQ(port.state, IBV_PORT_ACTIVE);
  EXPECT_EQ(port.link_layer, IBV_LINK_LAYER_ETHERNET);
  EXPECT_EQ(port.gid_tbl_len, FakeBackend::kGidCount);
  ibv_device_attr_ex attr{};
  ASSERT_EQ(ibv_query_device_ex(dev().ctx, nullptr, &attr), 0);
  EXPECT_EQ(attr.orig_attr.phys_port_cnt, 1);
  EXPECT_EQ(attr.orig_attr.max_sge, static_cast<int>(FakeBackend::kMaxSge));
}

// ---------------------------------------------------------------- unsupported

TEST_F(ShimTest, XrcdIsNotSupported) {
  ibv_xrcd_init_attr attr{};
  attr.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
  attr.fd = -1;
  attr.oflags = O_CREAT;
  errno = 0;
  EXPECT_EQ(ibv_open_xrcd(dev().ctx, &attr), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
}

TEST_F(ShimTest, MemoryWindowsAreNotSupported) {
  errno = 0;
  EXPECT_EQ(ibv_alloc_mw(dev().pd, IBV_MW_TYPE_1), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  errno = 0;
  EXPECT_EQ(ibv_alloc_mw(dev().pd, IBV_MW_TYPE_2), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
}

TEST_F(ShimTest, RssQpsAreNotSupported) {
  uint8_t key[40] = {};
  ibv_qp_init_attr_ex attr{};
  attr.qp_type = IBV_QPT_RAW_PACKET;
  attr.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_RX_HASH;
  attr.pd = dev().pd;
  attr.rx_hash_conf.rx_hash_function = IBV_RX_HASH_FUNC_TOEPLITZ;
  attr.rx_hash_conf.rx_hash_key_len = sizeof(key);
  attr.rx_hash_conf.rx_hash_key = key;
  attr.rx_hash_conf.rx_hash_fields_mask = IBV_RX_HASH_SRC_IPV4;
  const int calls = fake_.create_qp_calls();
  errno = 0;
  EXPECT_EQ(ibv_create_qp_ex(dev().ctx, &attr), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  EXPECT_EQ(fake_.create_qp_calls(), calls) << "refused before reaching the device";
}

TEST_F(ShimTest, RawPacketQpsAreNotSupported) {
  ibv_qp_init_attr attr{};
  attr.send_cq = attr.recv_cq = dev().cq;
  attr.qp_type = IBV_QPT_RAW_PACKET;
  attr.cap.max_send_wr = attr.cap.max_recv_wr = 1;
  attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
  const int calls = fake_.create_qp_calls();
  errno = 0;
  EXPECT_EQ(shim_.CreateQp(dev().pd, &attr), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  EXPECT_EQ(fake_.create_qp_calls(), calls);
}

TEST_F(ShimTest, XrcSrqsAndParentDomainCqsAreNotSupported) {
  ibv_srq_init_attr_ex srq{};
  srq.comp_mask = IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_CQ;
  srq.srq_type = IBV_SRQT_XRC;
  srq.pd = dev().pd;
  srq.cq = dev().cq;
  srq.attr.max_wr = 4;
  srq.attr.max_sge = 1;
  errno = 0;
  EXPECT_EQ(ibv_create_srq_ex(dev().ctx, &srq), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);

  ibv_cq_init_attr_ex cq{};
  cq.cqe = 4;
  cq.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD;
  cq.parent_domain = dev().pd;
  errno = 0;
  EXPECT_EQ(ibv_create_cq_ex(dev().ctx, &cq), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
}

// ---------------------------------------------------------------- events

TEST_F(ShimTest, CqEventReturnsShadowCqAndApplicationContext) {
  int cookie = 42;
  ibv_comp_channel* ch = dev().Channel();
  // The application polls the real channel's fd.
  EXPECT_EQ(ch->fd, reinterpret_cast<const Channel*>(ch)->real->fd);
  ibv_cq* cq = dev().Cq(ch, &cookie);
  EXPECT_EQ(cq->cq_context, &cookie);
  EXPECT_EQ(cq->channel, ch);
  ibv_qp* a = dev().Qp(IBV_QPT_RC, 1, nullptr, cq, cq);
  ibv_qp* b = dev().Qp(IBV_QPT_RC, 1, nullptr, cq, cq);
  ASSERT_EQ(ToRts(shim_, a, b->qp_num, dev().gid), 0);
  ASSERT_EQ(ToRts(shim_, b, a->qp_num, dev().gid), 0);
  ASSERT_EQ(ibv_req_notify_cq(cq, 0), 0);

  char buf[8] = "x";
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  ibv_sge sge = Sge(buf, 1, mr);
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(buf + 4);
  wr.wr.rdma.rkey = mr->rkey;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);

  ibv_cq* ev_cq = nullptr;
  void* ev_ctx = nullptr;
  ASSERT_EQ(shim_.GetCqEvent(ch, &ev_cq, &ev_ctx), 0);
  EXPECT_EQ(ev_cq, cq);
  EXPECT_EQ(ev_ctx, &cookie);
  shim_.AckCqEvents(ev_cq, 1);
  ASSERT_EQ(fake_.acked_cq_events().size(), 1u);
  EXPECT_EQ(fake_.acked_cq_events()[0].first, ShimCq(cq)->real);
  EXPECT_EQ(fake_.acked_cq_events()[0].second, 1u);
  auto wcs = Drain(cq);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].qp_num, a->qp_num);
  // No second event without re-arming.
  errno = 0;
  EXPECT_EQ(shim_.GetCqEvent(ch, &ev_cq, &ev_ctx), -1);
  EXPECT_EQ(errno, EAGAIN);
}

TEST_F(ShimTest, AsyncEventsMapToShadowsAndAckMapsBack) {
  ibv_qp* qp = dev().Qp(IBV_QPT_RC);
  ibv_srq* srq = dev().Srq();
  ibv_context* real_ctx = ShimQp(qp)->ctx->real;

  struct Case {
    ibv_event_type type;
    void* shadow;
    void* real;
  } cases[] = {
      {IBV_EVENT_QP_FATAL, qp, ShimQp(qp)->real},
      {IBV_EVENT_COMM_EST, qp, ShimQp(qp)->real},
      {IBV_EVENT_QP_LAST_WQE_REACHED, qp, ShimQp(qp)->real},
      {IBV_EVENT_CQ_ERR, dev().cq, ShimCq(dev().cq)->real},
      {IBV_EVENT_SRQ_LIMIT_REACHED, srq, ShimSrq(srq)->real},
      {IBV_EVENT_SRQ_ERR, srq, ShimSrq(srq)->real},
  };
  for (const Case& c : cases) {
    ibv_async_event in{};
    in.event_type = c.type;
    in.element.qp = static_cast<ibv_qp*>(c.real);  // a union: any member will do
    fake_.InjectAsyncEvent(real_ctx, in);
    ibv_async_event out{};
    ASSERT_EQ(shim_.GetAsyncEvent(dev().ctx, &out), 0);
    EXPECT_EQ(out.event_type, c.type);
    EXPECT_EQ(static_cast<void*>(out.element.qp), c.shadow) << c.type;
    shim_.AckAsyncEvent(&out);
    ASSERT_FALSE(fake_.acked_async_events().empty());
    EXPECT_EQ(static_cast<void*>(fake_.acked_async_events().back().element.qp), c.real) << c.type;
  }

  ibv_async_event port{};
  port.event_type = IBV_EVENT_PORT_ACTIVE;
  port.element.port_num = 1;
  fake_.InjectAsyncEvent(real_ctx, port);
  ibv_async_event out{};
  ASSERT_EQ(shim_.GetAsyncEvent(dev().ctx, &out), 0);
  EXPECT_EQ(out.element.port_num, 1);
  shim_.AckAsyncEvent(&out);
  EXPECT_EQ(fake_.acked_async_events().back().element.port_num, 1);

  errno = 0;
  EXPECT_EQ(shim_.GetAsyncEvent(dev().ctx, &out), -1);
  EXPECT_EQ(errno, EAGAIN);
}

TEST_F(ShimTest, SrqKeepsTheApplicationsContext) {
  int cookie;
  ibv_srq_init_attr attr{};
  attr.srq_context = &cookie;
  attr.attr.max_wr = 10;
  attr.attr.max_sge = 1;
  ibv_srq* srq = shim_.CreateSrq(dev().pd, &attr);
  ASSERT_NE(srq, nullptr);
  EXPECT_EQ(srq->srq_context, &cookie);
  EXPECT_EQ(attr.attr.max_wr, 16u) << "the provider's size comes back";
  ibv_srq_attr q{};
  ASSERT_EQ(shim_.QuerySrq(srq, &q), 0);
  EXPECT_EQ(q.max_wr, 16u);
  EXPECT_EQ(shim_.DestroySrq(srq), 0);
}

}  // namespace
}  // namespace rdmavirt::shim::testing
