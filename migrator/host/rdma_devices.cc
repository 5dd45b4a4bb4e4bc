#include "migrator/host/rdma_devices.h"

#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"

namespace rdmavirt::migrator {
namespace {

std::string GidText(const ibv_gid& gid) {
  char buf[INET6_ADDRSTRLEN] = {};
  inet_ntop(AF_INET6, gid.raw, buf, sizeof(buf));
  return buf;
}

const char* LinkLayer(uint8_t l) {
  switch (l) {
    case IBV_LINK_LAYER_ETHERNET:
      return "Ethernet";
    case IBV_LINK_LAYER_INFINIBAND:
      return "InfiniBand";
    default:
      return "unspecified";
  }
}

}  // namespace

std::vector<v1::RdmaDevice> ListRdmaDevices() {
  std::vector<v1::RdmaDevice> out;
  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) return out;
  for (int i = 0; i < num; ++i) {
    v1::RdmaDevice d;
    d.set_name(ibv_get_device_name(list[i]));
    d.set_node_guid(absl::StrFormat("%016x", be64toh(ibv_get_device_guid(list[i]))));
    ibv_context* ctx = ibv_open_device(list[i]);
    if (ctx != nullptr) {
      ibv_device_attr attr;
      if (ibv_query_device(ctx, &attr) == 0) {
        d.set_max_qp(attr.max_qp);
        d.set_max_mr(attr.max_mr);
        d.set_max_cq(attr.max_cq);
        for (uint8_t p = 1; p <= attr.phys_port_cnt; ++p) {
          ibv_port_attr pa;
          if (ibv_query_port(ctx, p, &pa) != 0) continue;
          v1::RdmaPort* port = d.add_ports();
          port->set_port_num(p);
          // libibverbs spells states "active", "down" ...; host.proto
          // upper-case ("ACTIVE").
          std::string state = absl::AsciiStrToUpper(ibv_port_state_str(pa.state));
          if (absl::StartsWith(state, "PORT_")) state = state.substr(5);
          port->set_state(state);
          port->set_link_layer(LinkLayer(pa.link_layer));
          for (int g = 0; g < pa.gid_tbl_len; ++g) {
            ibv_gid gid;
            if (ibv_query_gid(ctx, p, g, &gid) != 0) break;
            static const ibv_gid kZero{};
            if (memcmp(gid.raw, kZero.raw, sizeof(gid.raw)) == 0) continue;
            port->add_gids(GidText(gid));
          }
        }
      }
      ibv_close_device(ctx);
    }
    out.push_back(std::move(d));
  }
  ibv_free_device_list(list);
  return out;
}

const v1::RdmaDevice* FirstActiveDevice(const v1::HostInfo& host) {
  for (const v1::RdmaDevice& d : host.devices())
    for (const v1::RdmaPort& p : d.ports())
      if (p.state() == "ACTIVE") return &d;
  return nullptr;
}

}  // namespace rdmavirt::migrator
