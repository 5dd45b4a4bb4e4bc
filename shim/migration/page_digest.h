// Pages the destination of a move already holds, from the pre-copy's
// images, named by address and the digest of their content there.
//
// The HCA writes registered memory behind the CPU's soft-dirty bits, so a
// release must mark for the final dump every registered page the HCA may
// have written since the pre-copy copied it. Marking all of them puts all
// registered memory in the blackout. Instead the migrator hashes each page
// of the pre-dump images it sent (the bytes the destination will restore
// for a page the final dump leaves out) and hands the digests to the
// release, which runs after the HCA can no longer write: a registered
// page whose content still has its digest needs no copy, any other (not
// in the images, or changed) is marked. The CPU's own writes are the
// soft-dirty bits' business either way.
//
// The digest is XXH3-128 (libxxhash-dev's header, inlined): it only has to
// tell a page's content from its earlier content, and a peer that could
// write a colliding page could as well write the old content back.
//
// The wire form, in the Release request (control.proto): addresses
// ascending, 8 bytes each, little-endian; digests in the same order, 16
// bytes each (low half first).
#ifndef RDMAVIRT_SHIM_MIGRATION_PAGE_DIGEST_H_
#define RDMAVIRT_SHIM_MIGRATION_PAGE_DIGEST_H_

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace rdmavirt::shim {

struct PageDigest {
  uint64_t lo = 0;
  uint64_t hi = 0;
  bool operator==(const PageDigest& o) const { return lo == o.lo && hi == o.hi; }
};

inline PageDigest DigestOf(const void* data, size_t n) {
  const XXH128_hash_t h = XXH3_128bits(data, n);
  return {h.low64, h.high64};
}

class KnownPages {
 public:
  // From the wire form; false (and empty) when the two do not agree in
  // length or the addresses do not ascend.
  bool Decode(std::string_view addrs, std::string_view digests) {
    Clear();
    if (addrs.size() % 8 != 0 || digests.size() % 16 != 0 ||
        addrs.size() / 8 != digests.size() / 16)
      return false;
    const size_t n = addrs.size() / 8;
    addrs_.resize(n);
    digests_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      addrs_[i] = Le64(addrs.data() + 8 * i);
      digests_[i] = {Le64(digests.data() + 16 * i), Le64(digests.data() + 16 * i + 8)};
      if (i > 0 && addrs_[i] <= addrs_[i - 1]) {
        Clear();
        return false;
      }
    }
    return true;
  }

  // Whether the destination holds `page` with exactly this content.
  bool Unchanged(uintptr_t page, const void* content, size_t n) const {
    const auto it = std::lower_bound(addrs_.begin(), addrs_.end(), uint64_t{page});
    if (it == addrs_.end() || *it != page) return false;
    return digests_[static_cast<size_t>(it - addrs_.begin())] == DigestOf(content, n);
  }

  size_t size() const { return addrs_.size(); }
  bool empty() const { return addrs_.empty(); }

 private:
  void Clear() {
    addrs_.clear();
    digests_.clear();
  }
  static uint64_t Le64(const char* p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
    return v;
  }

  std::vector<uint64_t> addrs_;
  std::vector<PageDigest> digests_;
};

// The wire form of (address, digest) pairs given in ascending addresses.
inline void EncodeKnownPages(const std::vector<std::pair<uint64_t, PageDigest>>& pages,
                             std::string* addrs, std::string* digests) {
  addrs->clear();
  digests->clear();
  addrs->reserve(8 * pages.size());
  digests->reserve(16 * pages.size());
  auto put = [](std::string* s, uint64_t v) {
    for (int i = 0; i < 8; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
  };
  for (const auto& [addr, d] : pages) {
    put(addrs, addr);
    put(digests, d.lo);
    put(digests, d.hi);
  }
}

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_MIGRATION_PAGE_DIGEST_H_
