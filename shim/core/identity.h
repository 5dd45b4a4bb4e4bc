// Virtual identities: how the shim turns the HCA's QP numbers, keys and
// GIDs into the stable ones the application sees, and back.
//
// Two kinds:
// - lkeys never leave the process: they are dense slot numbers, so the data
//   path translates them with one array index (MrTable).
// - QP numbers, rkeys and GIDs are sent to peers out of band. Their virtual
//   value is a fixed function of the physical value at creation, so a peer
//   can translate them with no lookup while the owner has not moved: in the
//   default mode the function is the identity, in offset mode
//   (RDMAVIRT_ID_MODE=offset) it sets a marker the hardware does not use, so
//   tests see virtual != physical from the first resource on. After a move
//   the owner's migrator publishes an explicit map (RemoteEndpoint) to its
//   peers, which overrides the function.
//
// Everything here is constexpr/inline and lock-free: it runs on post/poll.
#ifndef RDMAVIRT_SHIM_CORE_IDENTITY_H_
#define RDMAVIRT_SHIM_CORE_IDENTITY_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>

namespace rdmavirt::shim {

// QPNs are 24 bits; rxe and mlx hand out numbers far below 2^23.
inline constexpr uint32_t kQpnMarker = 0x800000;
// rxe keys are index << 8 | 8 random bits, with index < 2^18.
inline constexpr uint32_t kRkeyMarker = 0x80000000;
// Offset-mode virtual GIDs set bit 7 of byte 14: for an IPv4-mapped GID
// (RoCE v2) that is the third octet of the address, so the virtual GID is
// still an IPv4 address and fits the IPv4 header of a UD receive's GRH.
// Offset mode is a test mode: it needs physical GIDs with that bit clear
// (true of the lab fabric, 10.77.0.0/24, and of link-local GIDs from MACs
// whose fifth byte is below 0x80).
inline constexpr int kGidMarkerByte = 14;
inline constexpr uint8_t kGidMarkerBit = 0x80;
// A UD send to a multicast group names this QPN (IB's permissive QPN): a
// group's, never an endpoint's, so never translated.
inline constexpr uint32_t kMulticastQpn = 0xffffff;

struct IdentityMode {
  bool offset = false;

  uint32_t VirtualQpn(uint32_t physical) const {
    return offset ? (physical | kQpnMarker) : physical;
  }
  // A number without the marker is not a virtual QPN of an unmoved peer
  // (for example a physical QPN handed out by the kernel's CM): unchanged.
  uint32_t PhysicalQpn(uint32_t virt) const {
    return offset && virt != kMulticastQpn ? (virt & ~kQpnMarker) : virt;
  }
  uint32_t VirtualRkey(uint32_t physical) const {
    return offset ? (physical | kRkeyMarker) : physical;
  }
  uint32_t PhysicalRkey(uint32_t virt) const { return virt & PhysicalRkeyMask(); }
  // PhysicalRkey as one AND: what the translating data path keeps (Qp).
  uint32_t PhysicalRkeyMask() const { return offset ? ~kRkeyMarker : ~uint32_t{0}; }
  // An empty GID-table entry (all zeros) stays empty: tools such as
  // ibv_devinfo list only the entries that are not.
  // A multicast GID names a group, not an endpoint: it is the same for
  // every member and stays as it is.
  ibv_gid VirtualGid(const ibv_gid& physical) const {
    ibv_gid v = physical;
    if (offset && !IsZero(physical) && !IsMulticast(physical))
      v.raw[kGidMarkerByte] |= kGidMarkerBit;
    return v;
  }
  static bool IsZero(const ibv_gid& g) {
    uint8_t any = 0;
    for (uint8_t b : g.raw) any |= b;
    return any == 0;
  }
  // IPv6 multicast (ff00::/8), or IPv4 multicast mapped (::ffff:224.0.0.0/4),
  // as RoCE v2 and rdma_cm's joins use.
  static bool IsMulticast(const ibv_gid& g) {
    if (g.raw[0] == 0xff) return true;
    for (int i = 0; i < 10; ++i)
      if (g.raw[i] != 0) return false;
    return g.raw[10] == 0xff && g.raw[11] == 0xff && (g.raw[12] & 0xf0) == 0xe0;
  }
  ibv_gid PhysicalGid(const ibv_gid& virt) const {
    ibv_gid p = virt;
    if (offset && !IsMulticast(virt)) p.raw[kGidMarkerByte] &= static_cast<uint8_t>(~kGidMarkerBit);
    return p;
  }
};

// Local lkeys: slot << 8 | tag. The tag is the low byte of the physical key
// at registration, so a stale or forged key rarely matches a live slot.
inline constexpr uint32_t kMaxMrs = 1u << 16;
inline constexpr uint32_t kLkeyOffsetBit = 0x40000000;

inline uint32_t MakeVirtualLkey(uint32_t slot, uint32_t physical, bool offset) {
  return (offset ? kLkeyOffsetBit : 0) | ((slot + 1) << 8) | (physical & 0xff);
}
inline uint32_t LkeySlot(uint32_t vlkey) { return ((vlkey >> 8) - 1) & (kMaxMrs - 1); }

// What the data path reads of the MR table (MrTable): one pointer, kept in
// each QP and SRQ, to entries indexed by slot + 1 (index 0 and the
// reserved slot's stay empty), so that a key's index is its bits 8..23
// with no subtraction. Unknown keys pass through unchanged, so the HCA
// reports them exactly as it would without the shim.
class MrLookup {
 public:
  MrLookup() = default;
  explicit MrLookup(const std::atomic<uint64_t>* entries) : entries_(entries) {}
  uint32_t ToPhysical(uint32_t vlkey) const {
    return Translate(vlkey, (vlkey >> 8) & (kMaxMrs - 1));
  }
  // The same for a key in memory (a work request's SGE): its index, bits
  // 8..23, is its bytes 1 and 2 on this little-endian machine, loaded as
  // they are instead of shifted out of the key.
  uint32_t ToPhysicalAt(const uint32_t* vlkey) const {
    static_assert(std::endian::native == std::endian::little);
    uint16_t index;
    std::memcpy(&index, reinterpret_cast<const unsigned char*>(vlkey) + 1, sizeof index);
    return Translate(*vlkey, index);
  }

 private:
  // One load of the whole entry (physical key above, virtual below): a
  // key is never paired with another registration's physical key, even
  // while its slot is being reused.
  uint32_t Translate(uint32_t vlkey, uint32_t index) const {
    const uint64_t e = entries_[index].load(std::memory_order_relaxed);
    return static_cast<uint32_t>(e) == vlkey ? static_cast<uint32_t>(e >> 32) : vlkey;
  }
  const std::atomic<uint64_t>* entries_ = nullptr;
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CORE_IDENTITY_H_
