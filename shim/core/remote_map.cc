#include "shim/core/remote_map.h"

#include <cstring>
#include <new>

namespace rdmavirt::shim {

bool RemoteEndpoint::Map::Init(const std::vector<std::pair<uint32_t, uint32_t>>& pairs) {
  if (pairs.empty()) return true;
  uint32_t cap = 2;
  while (cap < 2 * pairs.size()) cap <<= 1;
  slots_.reset(new (std::nothrow) Slot[cap]());
  if (slots_ == nullptr) return false;
  mask_ = cap - 1;
  for (const auto& [v, p] : pairs) {
    uint32_t i = Hash(v) & mask_;
    while (slots_[i].used && slots_[i].v != v) i = (i + 1) & mask_;
    slots_[i] = {v, p, true};  // a repeated virtual value: the last one wins
  }
  return true;
}

std::unique_ptr<RemoteEndpoint> RemoteEndpoint::Build(const RemoteMapping& m) {
  std::unique_ptr<RemoteEndpoint> e(new (std::nothrow) RemoteEndpoint());
  std::vector<std::pair<uint32_t, uint32_t>> back;
  back.reserve(m.qpns.size());
  for (const auto& [v, p] : m.qpns) back.emplace_back(p, v);
  if (e == nullptr || !e->qpns_.Init(m.qpns) || !e->qpns_back_.Init(back) ||
      !e->rkeys_.Init(m.rkeys))
    return nullptr;
  e->virtual_gid_ = m.virtual_gid;
  e->physical_gid_ = m.physical_gid;
  e->virtual_qpns_.reserve(m.qpns.size());
  for (const auto& [v, p] : m.qpns) e->virtual_qpns_.push_back(v);
  return e;
}

bool RemoteEndpoint::SameEndpointAs(const RemoteEndpoint& o) const {
  if (memcmp(virtual_gid_.raw, o.virtual_gid_.raw, sizeof(virtual_gid_.raw)) != 0) return false;
  for (uint32_t v : virtual_qpns_)
    if (o.Owns(v)) return true;
  return false;
}

bool RemoteEndpoint::SamePlaceFor(const RemoteEndpoint& o, uint32_t v) const {
  return Owns(v) && o.Owns(v) && Qpn(v) == o.Qpn(v) &&
         memcmp(physical_gid_.raw, o.physical_gid_.raw, sizeof(physical_gid_.raw)) == 0;
}

}  // namespace rdmavirt::shim
