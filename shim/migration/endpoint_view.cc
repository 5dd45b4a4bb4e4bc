// Shim::Describe and the endpoint's own GID: what the migrator is told of
// the endpoint (endpoint_view.h).
#include "shim/migration/endpoint_view.h"

#include <string.h>

#include <algorithm>

#include "shim/core/shim.h"

namespace rdmavirt::shim {

namespace {

// A QP as the migrator sees it: its identities, its peer's, and what the
// pause holds of its work. Not analysed: it counts the sends queued during
// a pause under the shim's mutex alone, not the pause's queue lock, a
// snapshot for the operator that a post queued meanwhile may outdate.
void DescribeQp(const Qp* qp, const IdentityMode& mode,
                EndpointView* v) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  ++v->qps;
  QpView q;
  q.virtual_qpn = qp->shadow.qp_base.qp_num;
  q.physical_qpn = qp->physical_qpn;
  q.qp_type = qp->shadow.qp_base.qp_type;
  q.state = qp->shadow.qp_base.state;
  for (const QpTransition& t : qp->transitions) {
    if (t.mask & IBV_QP_DEST_QPN) q.remote_virtual_qpn = t.attr.dest_qp_num;
    if ((t.mask & IBV_QP_AV) && t.attr.ah_attr.is_global) q.connected = true;
  }
  if (q.connected) {
    q.remote_virtual_gid = qp->remote_gid;
    const RemoteEndpoint* r = qp->remote.load();
    q.remote_physical_gid = r ? r->physical_gid() : mode.PhysicalGid(qp->remote_gid);
  }
  q.outstanding_recvs = static_cast<uint32_t>(qp->outstanding.size());
  q.queued_sends = static_cast<uint32_t>(qp->queued_sends.size());
  if (qp->real != nullptr) v->qpns.emplace_back(q.virtual_qpn, qp->physical_qpn);
  v->qp_list.push_back(q);
}

// A memory region: its bytes, and its rkey's physical value while it has one.
void DescribeMr(const Mr* mr, EndpointView* v) {
  ++v->mrs;
  v->registered_bytes += mr->shadow.length;
  if (mr->real != nullptr) v->rkeys.emplace_back(mr->shadow.rkey, mr->real->rkey);
}

// A CQ: the completions the pause holds for it.
void DescribeCq(const Cq* cq, EndpointView* v) {
  ++v->cqs;
  v->pending_completions += cq->pending_count - cq->pending_head.load();
}

// Where a UD peer an address handle points at is now (`r`: the moved
// endpoint behind its GID, if any), once per GID. A multicast group's
// GID names no host (mckey's receiver has an address handle to its group;
// before, a move asked for a migrator at the group's address and rolled
// back): the group's members are the UD QP's every possible peer, as
// every host is for any UD QP.
void NoteUdPeer(const ibv_gid& virtual_gid, const RemoteEndpoint* r, const IdentityMode& mode,
                EndpointView* v) {
  if (IdentityMode::IsMulticast(virtual_gid)) return;
  const ibv_gid g = r ? r->physical_gid() : mode.PhysicalGid(virtual_gid);
  auto same = [&g](const ibv_gid& o) { return memcmp(o.raw, g.raw, 16) == 0; };
  if (std::none_of(v->ud_peer_physical_gids.begin(), v->ud_peer_physical_gids.end(), same))
    v->ud_peer_physical_gids.push_back(g);
}

}  // namespace

void Shim::NoteEndpointGid(Context* ctx, uint8_t port, int sgid_index) {
  if (endpoint_gid_known_) return;
  ibv_gid gid;
  if (backend_->QueryGid(ctx->real, port, sgid_index, &gid) != 0) return;
  endpoint_gid_known_ = true;
  endpoint_port_ = port;
  endpoint_sgid_index_ = sgid_index;
  endpoint_physical_gid_ = gid;
  endpoint_virtual_gid_ = mode_.VirtualGid(gid);
}

bool Shim::GuessGid(Context** ctx, int* index, ibv_gid* gid) const {
  // No QP or AH named a source GID (a UD receiver that only answers, say):
  // peers reach a RoCE v2 endpoint at its IPv4-mapped GID, the first one,
  // else at the port's first GID.
  static constexpr uint8_t kV4Prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  for (const auto& [p, k] : Shadows()) {
    if (k != Kind::kContext) continue;
    Context* c = AsContext(static_cast<ibv_context*>(const_cast<void*>(p)));
    if (c->real == nullptr) continue;
    bool found = false;
    for (int i = 0; i < 16; ++i) {
      ibv_gid g;
      if (backend_->QueryGid(c->real, 1, i, &g) != 0) break;
      const bool v4 = memcmp(g.raw, kV4Prefix, 12) == 0;
      if (i == 0 || v4) {
        *index = i;
        *gid = g;
        found = true;
      }
      if (v4) break;
    }
    if (!found) return false;
    *ctx = c;
    return true;
  }
  return false;
}

void Shim::GuessEndpointGid() {
  if (endpoint_gid_known_) return;
  Context* ctx;
  int index;
  ibv_gid gid;
  if (GuessGid(&ctx, &index, &gid)) NoteEndpointGid(ctx, 1, index);
}

EndpointView Shim::Describe() const {
  MutexLock lock(&mu_);
  EndpointView v;
  v.paused = paused_;
  v.released = released_;
  v.has_gid = endpoint_gid_known_;
  v.virtual_gid = endpoint_virtual_gid_;
  v.physical_gid = endpoint_physical_gid_;
  // A process that named no GID yet is shown at the one its pause will
  // guess (nothing recorded: a later QP or AH may still name its own), so
  // that a move can tell its peers' hosts which endpoint it pauses them for.
  Context* ctx;
  int index;
  if (!v.has_gid && GuessGid(&ctx, &index, &v.physical_gid)) {
    v.has_gid = true;
    v.virtual_gid = mode_.VirtualGid(v.physical_gid);
  }
  for (const auto& [p, k] : Shadows()) {
    switch (k) {
      case Kind::kContext: {
        ++v.devices;
        const Context* ctx = AsContext(static_cast<ibv_context*>(const_cast<void*>(p)));
        if (ctx->real != nullptr && ctx->real->device != nullptr)
          v.device = ctx->real->device->name;
        break;
      }
      case Kind::kPd:
        ++v.pds;
        break;
      case Kind::kMr:
        DescribeMr(static_cast<const Mr*>(p), &v);
        break;
      case Kind::kCq:
        DescribeCq(static_cast<const Cq*>(p), &v);
        break;
      case Kind::kSrq:
        ++v.srqs;
        break;
      case Kind::kQp:
        DescribeQp(static_cast<const Qp*>(p), mode_, &v);
        break;
      case Kind::kAh: {
        const Ah* ah = static_cast<const Ah*>(p);
        ++v.ahs;
        if (ah->attr.is_global)
          NoteUdPeer(ah->attr.grh.dgid, FindRemoteLocked(ah->attr.grh.dgid), mode_, &v);
        break;
      }
      case Kind::kChannel:
        break;
    }
  }
  return v;
}

}  // namespace rdmavirt::shim
