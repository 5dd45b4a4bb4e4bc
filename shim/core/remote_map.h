// RemoteEndpoint: what a peer endpoint that has moved published about
// itself, as this process's shim caches it. Its virtual GID (the identity
// the application connected to), where it is now (its physical GID), and
// the physical QPN and rkey behind each virtual one it handed out.
//
// Until an endpoint moves, none is needed: its virtual identities are a
// fixed function of the physical ones (identity.h), so peers translate
// with no lookup. After a move its migrator publishes the new mapping to
// the migrators of its peers, which hand it to their shims
// (Shim::PublishRemote); QPs and AHs toward that endpoint then translate
// through it, on the translating data path.
//
// Immutable once built and never freed while the process lives (a QP on
// another thread may still read through an older one; they are small).
// Lookups are lock-free.
#ifndef RDMAVIRT_SHIM_CORE_REMOTE_MAP_H_
#define RDMAVIRT_SHIM_CORE_REMOTE_MAP_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace rdmavirt::shim {

struct RemoteMapping {
  ibv_gid virtual_gid{};
  ibv_gid physical_gid{};
  std::vector<std::pair<uint32_t, uint32_t>> qpns;   // virtual, physical
  std::vector<std::pair<uint32_t, uint32_t>> rkeys;  // virtual, physical
  // Its RDMA CM connections waiting for their peers (cm.h): the QP's
  // virtual QPN, the port its process listens on at physical_gid.
  std::vector<std::pair<uint32_t, uint32_t>> cm_rendezvous;
};

class RemoteEndpoint {
 public:
  // nullptr when memory runs out.
  static std::unique_ptr<RemoteEndpoint> Build(const RemoteMapping& m);

  const ibv_gid& virtual_gid() const { return virtual_gid_; }
  const ibv_gid& physical_gid() const { return physical_gid_; }
  // Unknown values pass through unchanged (the hardware then reports them,
  // as it would a bad key without the shim).
  uint32_t Qpn(uint32_t v) const { return qpns_.Find(v); }
  uint32_t Rkey(uint32_t v) const { return rkeys_.Find(v); }
  // Physical QPN -> virtual (the source QPN of a UD datagram it sent).
  uint32_t VirtualQpn(uint32_t p) const { return qpns_back_.Find(p); }

  // Several endpoints can share a virtual GID (every process started on one
  // host has that host's GID), and only one of them may have moved: the
  // QPNs it published say which QPs and datagrams are its.
  bool Owns(uint32_t virtual_qpn) const { return qpns_.Has(virtual_qpn); }
  bool SentFrom(uint32_t physical_qpn) const { return qpns_back_.Has(physical_qpn); }
  // The same endpoint (a later move of it): same virtual GID, a QPN in common.
  bool SameEndpointAs(const RemoteEndpoint& o) const;
  // Its virtual QPN `v` at the same physical GID and QPN in both.
  bool SamePlaceFor(const RemoteEndpoint& o, uint32_t v) const;

 private:
  // Open addressing, at most half full, so a miss ends quickly.
  class Map {
   public:
    bool Init(const std::vector<std::pair<uint32_t, uint32_t>>& pairs);
    uint32_t Find(uint32_t v) const {
      if (mask_ == 0) return v;
      for (uint32_t i = Hash(v) & mask_;; i = (i + 1) & mask_) {
        const Slot& s = slots_[i];
        if (!s.used) return v;
        if (s.v == v) return s.p;
      }
    }
    bool Has(uint32_t v) const {
      if (mask_ == 0) return false;
      for (uint32_t i = Hash(v) & mask_;; i = (i + 1) & mask_) {
        const Slot& s = slots_[i];
        if (!s.used) return false;
        if (s.v == v) return true;
      }
    }

   private:
    struct Slot {
      uint32_t v;
      uint32_t p;
      bool used;
    };
    static uint32_t Hash(uint32_t v) { return v * 0x9e3779b1u; }
    std::unique_ptr<Slot[]> slots_;
    uint32_t mask_ = 0;
  };

  ibv_gid virtual_gid_{};
  ibv_gid physical_gid_{};
  std::vector<uint32_t> virtual_qpns_;
  Map qpns_;
  Map qpns_back_;
  Map rkeys_;
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CORE_REMOTE_MAP_H_
