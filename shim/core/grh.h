// The 40 bytes in front of a UD receive: an IB/RoCE v1 or RoCE v2-over-IPv6
// GRH (source GID at 8, destination GID at 24), or, for RoCE v2 over IPv4,
// 20 unused bytes followed by the IPv4 header (addresses at 32 and 36).
// The shim rewrites the addresses in place between physical and virtual,
// as it does for every other identity the application sees.
#ifndef RDMAVIRT_SHIM_CORE_GRH_H_
#define RDMAVIRT_SHIM_CORE_GRH_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace rdmavirt::shim {

inline uint16_t Ipv4HeaderChecksum(const uint8_t* h) {
  uint32_t sum = 0;
  for (int i = 0; i < 20; i += 2) {
    if (i == 10) continue;  // the checksum field itself
    sum += static_cast<uint32_t>(h[i]) << 8 | h[i + 1];
  }
  while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
  return static_cast<uint16_t>(~sum);
}

enum class GrhLayout { kNone, kIpv4, kIpv6 };

// Which of the two the 40 bytes hold, by libibverbs' own rule (the one
// ibv_init_ah_from_wc applies): without an IPv6 version nibble in front,
// an IPv4 header at 20; with one, IPv4 only if that header's checksum is
// right (the 20 unused bytes need not be zero). The checksum alone cannot
// decide: rxe leaves it 0 in a packet it loops back to its own device
// (sender and receiver on one host), where the IP stack that fills it in
// is never reached.
inline GrhLayout LayoutOf(const uint8_t* grh) {
  const uint8_t* ip = grh + 20;
  if ((grh[0] >> 4) != 6) return ip[0] == 0x45 ? GrhLayout::kIpv4 : GrhLayout::kNone;
  if (ip[0] == 0x45 && (ip[10] << 8 | ip[11]) == Ipv4HeaderChecksum(ip)) return GrhLayout::kIpv4;
  return GrhLayout::kIpv6;
}

// Applies `map` (ibv_gid -> ibv_gid) to both addresses of the GRH area.
template <typename Map>
void RewriteGrh(uint8_t* grh, Map map) {
  const GrhLayout layout = LayoutOf(grh);
  uint8_t* ip = grh + 20;
  if (layout == GrhLayout::kIpv4) {
    for (int off : {12, 16}) {  // source, destination
      ibv_gid g{};
      g.raw[10] = g.raw[11] = 0xff;
      memcpy(&g.raw[12], ip + off, 4);
      const ibv_gid m = map(g);
      memcpy(ip + off, &m.raw[12], 4);
    }
    const uint16_t sum = Ipv4HeaderChecksum(ip);
    ip[10] = static_cast<uint8_t>(sum >> 8);
    ip[11] = static_cast<uint8_t>(sum);
    return;
  }
  if (layout == GrhLayout::kIpv6) {
    for (int off : {8, 24}) {
      ibv_gid g;
      memcpy(g.raw, grh + off, 16);
      const ibv_gid m = map(g);
      memcpy(grh + off, m.raw, 16);
    }
  }
}

// Which way CopyGrhArea copies.
inline constexpr bool kGrhFromSges = false;
inline constexpr bool kGrhToSges = true;

// Copies the 40-byte GRH area between `grh` and the first SGEs of a
// receive, where it may be scattered; the bytes the SGEs hold of it
// (fewer than 40: the buffers hold no GRH).
template <bool kToSges>
inline uint32_t CopyGrhArea(const ibv_sge* sge, uint32_t num_sge, uint8_t* grh) {
  constexpr uint32_t kGrh = 40;
  uint32_t got = 0;
  for (uint32_t i = 0; i < num_sge && got < kGrh; ++i) {
    const uint32_t n = sge[i].length < kGrh - got ? sge[i].length : kGrh - got;
    if constexpr (kToSges)
      memcpy(reinterpret_cast<void*>(sge[i].addr), grh + got, n);
    else
      memcpy(grh + got, reinterpret_cast<const void*>(sge[i].addr), n);
    got += n;
  }
  return got;
}

// The GRH area may be scattered over the first SGEs of the receive: rewrite
// it where it lies (in place when the first SGE holds it all).
template <typename Map>
void RewriteGrhInSges(const ibv_sge* sge, uint32_t num_sge, Map map) {
  constexpr uint32_t kGrh = 40;
  if (num_sge > 0 && sge[0].length >= kGrh) {
    RewriteGrh(reinterpret_cast<uint8_t*>(sge[0].addr), map);
    return;
  }
  uint8_t grh[kGrh];
  // Buffers too small to hold a GRH: nothing there.
  if (CopyGrhArea<kGrhFromSges>(sge, num_sge, grh) < kGrh) return;
  RewriteGrh(grh, map);
  CopyGrhArea<kGrhToSges>(sge, num_sge, grh);
}

// The source address of the GRH area at the front of a UD receive; false
// when the buffers hold none.
inline bool ReadGrhSource(const ibv_sge* sge, uint32_t num_sge, ibv_gid* out) {
  constexpr uint32_t kGrh = 40;
  uint8_t grh[kGrh];
  if (CopyGrhArea<kGrhFromSges>(sge, num_sge, grh) < kGrh) return false;
  switch (LayoutOf(grh)) {
    case GrhLayout::kIpv4:
      *out = ibv_gid{};
      out->raw[10] = out->raw[11] = 0xff;
      memcpy(&out->raw[12], grh + 20 + 12, 4);
      return true;
    case GrhLayout::kIpv6:
      memcpy(out->raw, grh + 8, 16);
      return true;
    case GrhLayout::kNone:
      break;
  }
  return false;
}

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CORE_GRH_H_
