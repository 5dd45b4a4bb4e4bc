#include "migrator/criu/criu_images.h"

#include <errno.h>
#include <fcntl.h>
#include <google/protobuf/io/coded_stream.h>
#include <string.h>
#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace rdmavirt::migrator {
namespace criu_images {
namespace {

using google::protobuf::internal::WireFormatLite;

// criu/include/magic.h: every image opens with one of these, then its own.
constexpr uint32_t kImgCommonMagic = 0x54564319;
constexpr uint32_t kImgServiceMagic = 0x55105940;

absl::StatusOr<std::string> ReadWhole(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
  std::string out;
  char buf[1 << 16];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) != 0) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      close(fd);
      return absl::ErrnoToStatus(e, absl::StrCat("cannot read ", path));
    }
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

uint32_t Le32(const char* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

}  // namespace

bool Fields(std::string_view msg, std::vector<Field>* out) {
  const auto* data = reinterpret_cast<const uint8_t*>(msg.data());
  google::protobuf::io::CodedInputStream in(data, static_cast<int>(msg.size()));
  while (const uint32_t tag = in.ReadTag()) {
    Field f;
    f.number = WireFormatLite::GetTagFieldNumber(tag);
    f.type = WireFormatLite::GetTagWireType(tag);
    const int at = in.CurrentPosition();
    uint32_t n = 0;
    switch (f.type) {
      case WireFormatLite::WIRETYPE_VARINT:
        if (!in.ReadVarint64(&f.varint)) return false;
        break;
      case WireFormatLite::WIRETYPE_FIXED32:
        n = 4;
        break;
      case WireFormatLite::WIRETYPE_FIXED64:
        n = 8;
        break;
      case WireFormatLite::WIRETYPE_LENGTH_DELIMITED:
        if (!in.ReadVarint32(&n)) return false;
        break;
      default:  // groups: CRIU's images have none
        return false;
    }
    if (f.type != WireFormatLite::WIRETYPE_VARINT) {
      const int from =
          f.type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED ? in.CurrentPosition() : at;
      if (!in.Skip(static_cast<int>(n))) return false;
      f.bytes.assign(msg.data() + from, n);
    }
    out->push_back(std::move(f));
  }
  return in.ConsumedEntireMessage();
}

// The varint field `number` of `msg`, if it has one.
std::optional<uint64_t> VarintOf(std::string_view msg, int number) {
  std::vector<Field> fields;
  if (!Fields(msg, &fields)) return std::nullopt;
  for (const Field& f : fields)
    if (f.number == number && f.type == WireFormatLite::WIRETYPE_VARINT) return f.varint;
  return std::nullopt;
}

absl::StatusOr<std::optional<Image>> ReadImage(const std::string& dir, const char* name) {
  const std::string path = absl::StrCat(dir, "/", name);
  if (access(path.c_str(), F_OK) != 0 && errno == ENOENT) return std::nullopt;
  absl::StatusOr<std::string> raw = ReadWhole(path);
  if (!raw.ok()) return raw.status();
  if (raw->size() < 8 ||
      (Le32(raw->data()) != kImgCommonMagic && Le32(raw->data()) != kImgServiceMagic))
    return absl::DataLossError(absl::StrCat(path, ": not a CRIU image"));
  Image img{raw->substr(0, 8), {}};
  std::string_view rest(*raw);
  rest.remove_prefix(8);
  while (!rest.empty()) {
    if (rest.size() < 4 || rest.size() - 4 < Le32(rest.data()))
      return absl::DataLossError(absl::StrCat(path, ": cut short"));
    const uint32_t n = Le32(rest.data());
    img.entries.emplace_back(rest.substr(4, n));
    rest.remove_prefix(4 + n);
  }
  return img;
}

std::string Serialize(const Image& img) {
  std::string out = img.head;
  for (const std::string& e : img.entries) {
    const uint32_t n = static_cast<uint32_t>(e.size());
    out.append(reinterpret_cast<const char*>(&n), 4);
    out.append(e);
  }
  return out;
}

}  // namespace criu_images

absl::StatusOr<std::vector<pid_t>> DumpedTreePids(const std::string& dir) {
  // images/pstree.proto: PstreeEntry { required uint32 pid = 1; ... }
  constexpr int kPid = 1;
  absl::StatusOr<std::optional<criu_images::Image>> tree =
      criu_images::ReadImage(dir, "pstree.img");
  if (!tree.ok()) return tree.status();
  if (!tree->has_value()) return absl::DataLossError(absl::StrCat(dir, " has no pstree.img"));
  std::vector<pid_t> pids;
  for (const std::string& e : (*tree)->entries) {
    const std::optional<uint64_t> pid = criu_images::VarintOf(e, kPid);
    if (!pid.has_value() || *pid == 0 || *pid > 0x3fffffff)
      return absl::DataLossError(absl::StrCat(dir, "/pstree.img: an entry without a pid"));
    pids.push_back(static_cast<pid_t>(*pid));
  }
  return pids;
}

}  // namespace rdmavirt::migrator
