#include "migrator/move/precopy_pages.h"

#include <fcntl.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "migrator/host/scoped_fd.h"

namespace rdmavirt::migrator {
namespace {

// CRIU's criu/include/magic.h and images/pagemap.proto.
constexpr uint32_t kImgCommonMagic = 0x54564319;
constexpr uint32_t kPagemapMagic = 0x56084025;
// A run's bytes are in the pages image when it is PE_PRESENT, whatever
// else it is (PE_LAZY: it could be restored lazily; PE_PARENT: an earlier
// image has it).
constexpr uint32_t kPeParent = 1u << 0, kPePresent = 1u << 2;

struct Entry {
  uint64_t vaddr = 0;
  uint32_t nr_pages = 0;
  uint32_t flags = 0;
};

// Up to `n` bytes into `buf`, fewer only at the end of the file.
absl::StatusOr<size_t> ReadUpTo(int fd, char* buf, size_t n, const std::string& path) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = read(fd, buf + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return absl::InternalError(absl::StrCat(path, ": ", strerror(errno)));
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return got;
}

absl::Status ReadFile(const std::string& path, std::string* out) {
  ScopedFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return absl::NotFoundError(absl::StrCat(path, ": ", strerror(errno)));
  char buf[1 << 16];
  for (;;) {
    absl::StatusOr<size_t> n = ReadUpTo(fd.get(), buf, sizeof buf, path);
    if (!n.ok()) return n.status();
    out->append(buf, *n);
    if (*n < sizeof buf) return absl::OkStatus();
  }
}

uint32_t Le32(const char* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

// One message of a CRIU image after its 4-byte length; false at the end.
bool NextMessage(std::string_view* rest, std::string_view* msg, bool* malformed) {
  if (rest->empty()) return false;
  if (rest->size() < 4 || rest->size() - 4 < Le32(rest->data())) return *malformed = true, false;
  const uint32_t n = Le32(rest->data());
  *msg = rest->substr(4, n);
  rest->remove_prefix(4 + n);
  return true;
}

// The varint fields of a message (`want` of them by number), others skipped.
bool Varints(std::string_view msg, std::initializer_list<std::pair<int, uint64_t*>> want) {
  using google::protobuf::internal::WireFormatLite;
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(msg.data()),
                                            static_cast<int>(msg.size()));
  while (const uint32_t tag = in.ReadTag()) {
    const auto it = std::find_if(want.begin(), want.end(), [&](const auto& w) {
      return w.first == WireFormatLite::GetTagFieldNumber(tag);
    });
    if (it == want.end() ||
        WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_VARINT) {
      if (!WireFormatLite::SkipField(&in, tag)) return false;
      continue;
    }
    if (!in.ReadVarint64(it->second)) return false;
  }
  return in.ConsumedEntireMessage();
}

}  // namespace

absl::Status PrecopyPages::AddPreDump(const std::string& dir, pid_t pid, uint64_t page_size) {
  if (failed_) return absl::FailedPreconditionError("an earlier pre-dump's pages were unreadable");
  if (page_size == 0 || (page_size & (page_size - 1)) != 0)
    return absl::InvalidArgumentError("the page size is not a power of two");
  page_size_ = page_size;
  absl::Status st = Read(dir, pid);
  if (!st.ok()) {
    failed_ = true;
    pages_.clear();
  }
  return st;
}

absl::Status PrecopyPages::Read(const std::string& dir, pid_t pid) {
  const uint64_t page_size = page_size_;
  const std::string map_path = absl::StrCat(dir, "/pagemap-", pid, ".img");
  std::string map;
  if (absl::Status st = ReadFile(map_path, &map); !st.ok()) return st;
  if (map.size() < 8 || Le32(map.data()) != kImgCommonMagic ||
      Le32(map.data() + 4) != kPagemapMagic)
    return absl::DataLossError(absl::StrCat(map_path, ": not a CRIU pagemap image"));
  std::string_view rest(map);
  rest.remove_prefix(8);
  std::string_view msg;
  bool malformed = false;
  uint64_t pages_id = 0;
  if (!NextMessage(&rest, &msg, &malformed) || !Varints(msg, {{1, &pages_id}}))
    return absl::DataLossError(absl::StrCat(map_path, ": no pagemap head"));
  std::vector<Entry> entries;
  while (NextMessage(&rest, &msg, &malformed)) {
    uint64_t vaddr = 0, nr = 0, in_parent = 0, flags = ~uint64_t{0};
    if (!Varints(msg, {{1, &vaddr}, {2, &nr}, {3, &in_parent}, {4, &flags}}))
      return absl::DataLossError(absl::StrCat(map_path, ": a malformed pagemap entry"));
    // Images from before the flags: in_parent or present.
    if (flags == ~uint64_t{0}) flags = in_parent ? kPeParent : kPePresent;
    if (vaddr % page_size != 0 || nr > (uint64_t{1} << 40) / page_size)
      return absl::DataLossError(absl::StrCat(map_path, ": a pagemap entry out of range"));
    entries.push_back({vaddr, static_cast<uint32_t>(nr), static_cast<uint32_t>(flags)});
  }
  if (malformed) return absl::DataLossError(absl::StrCat(map_path, ": cut short"));

  const std::string pages_path = absl::StrCat(dir, "/pages-", pages_id, ".img");
  ScopedFd fd(open(pages_path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return absl::NotFoundError(absl::StrCat(pages_path, ": ", strerror(errno)));
  // Pages are read in chunks of up to 256 of them.
  std::vector<char> buf(page_size * 256);
  for (const Entry& e : entries) {
    if (!(e.flags & kPePresent)) continue;
    for (uint64_t done = 0; done < e.nr_pages;) {
      const uint64_t n = std::min<uint64_t>(e.nr_pages - done, 256);
      absl::StatusOr<size_t> got = ReadUpTo(fd.get(), buf.data(), n * page_size, pages_path);
      if (!got.ok()) return got.status();
      if (*got < n * page_size)
        return absl::DataLossError(absl::StrCat(pages_path, ": shorter than its pagemap"));
      for (uint64_t i = 0; i < n; ++i)
        pages_[e.vaddr + (done + i) * page_size] =
            shim::DigestOf(buf.data() + i * page_size, page_size);
      done += n;
    }
  }
  return absl::OkStatus();
}

void PrecopyPages::Encode(const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                          size_t max_pages, std::string* addrs, std::string* digests) const {
  addrs->clear();
  digests->clear();
  if (failed_ || pages_.empty()) return;
  // The ranges sorted and merged (two registrations of one buffer overlap),
  // then one pass over the pages in address order.
  std::vector<std::pair<uint64_t, uint64_t>> merged;
  for (const auto& r : ranges)
    if (r.first < r.second) merged.push_back(r);
  std::sort(merged.begin(), merged.end());
  size_t n = 0;
  for (const auto& r : merged) {
    if (n > 0 && r.first <= merged[n - 1].second)
      merged[n - 1].second = std::max(merged[n - 1].second, r.second);
    else
      merged[n++] = r;
  }
  merged.resize(n);
  std::vector<std::pair<uint64_t, shim::PageDigest>> sorted(pages_.begin(), pages_.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::pair<uint64_t, shim::PageDigest>> wanted;
  size_t r = 0;
  for (const auto& page : sorted) {
    while (r < merged.size() && merged[r].second <= page.first) ++r;
    if (r == merged.size()) break;
    if (merged[r].first < page.first + page_size_) wanted.push_back(page);
  }
  if (wanted.size() > max_pages) return;
  shim::EncodeKnownPages(wanted, addrs, digests);
}

}  // namespace rdmavirt::migrator
