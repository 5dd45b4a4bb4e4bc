// EndpointView: what Shim::Describe reports of the endpoint to the
// migrator (mirrors control.proto's EndpointSummary; control.cc encodes
// it). A plain value, taken under the shim's mutex and read by the control
// thread; it cannot fail.
#ifndef RDMAVIRT_SHIM_MIGRATION_ENDPOINT_VIEW_H_
#define RDMAVIRT_SHIM_MIGRATION_ENDPOINT_VIEW_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace rdmavirt::shim {

struct QpView {
  uint32_t virtual_qpn = 0;
  uint32_t physical_qpn = 0;  // 0 while released
  uint32_t qp_type = 0;
  uint32_t state = 0;
  bool connected = false;  // has a remote address (RC/UC after RTR)
  ibv_gid remote_virtual_gid{};
  uint32_t remote_virtual_qpn = 0;
  ibv_gid remote_physical_gid{};
  uint32_t outstanding_recvs = 0;
  uint32_t queued_sends = 0;
};

struct EndpointView {
  bool paused = false;
  bool released = false;
  std::string device;  // "" while released
  uint32_t devices = 0, pds = 0, mrs = 0, cqs = 0, srqs = 0, qps = 0, ahs = 0;
  uint64_t registered_bytes = 0;
  uint32_t pending_completions = 0;
  std::vector<QpView> qp_list;
  // Where the peers the address handles point at are now (UD peers).
  std::vector<ibv_gid> ud_peer_physical_gids;
  // This endpoint's own identities now (Mapping in control.proto).
  bool has_gid = false;
  ibv_gid virtual_gid{};
  ibv_gid physical_gid{};
  std::vector<std::pair<uint32_t, uint32_t>> qpns;   // virtual, physical
  std::vector<std::pair<uint32_t, uint32_t>> rkeys;  // virtual, physical
  // RDMA CM connections waiting for their peers after a restore (cm.h):
  // the QP's virtual QPN, the port this process listens on.
  std::vector<std::pair<uint32_t, uint32_t>> cm_rendezvous;
  uint32_t cm_ids = 0;  // librdmacm's ids the shim holds
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_MIGRATION_ENDPOINT_VIEW_H_
