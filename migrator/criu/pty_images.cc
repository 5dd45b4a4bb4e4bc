#include "migrator/criu/pty_images.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <google/protobuf/wire_format_lite.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "migrator/criu/criu_images.h"

namespace rdmavirt::migrator {
namespace {

using criu_images::Field;
using criu_images::Fields;
using criu_images::Image;
using criu_images::ReadImage;
using criu_images::Serialize;
using criu_images::VarintOf;
using google::protobuf::internal::WireFormatLite;
using IndexMap = std::map<uint32_t, uint32_t>;

constexpr char kTtyInfo[] = "tty-info.img";
constexpr char kTtyData[] = "tty-data.img";
constexpr char kFiles[] = "files.img";
constexpr const char* kRewritten[] = {kTtyInfo, kTtyData, kFiles};
// images/tty.proto's TtyType PTY; Unix98 slave majors (the index is
// (major - 136) * 256 + minor).
constexpr uint64_t kTtyTypePty = 1;
constexpr uint32_t kPtsMajor = 136, kPtsMajors = 8;
constexpr absl::string_view kPtsPrefix = "/dev/pts/";

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

void Put(const Field& f, std::string* out) {
  PutVarint(WireFormatLite::MakeTag(f.number, f.type), out);
  if (f.type == WireFormatLite::WIRETYPE_VARINT) return PutVarint(f.varint, out);
  if (f.type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) PutVarint(f.bytes.size(), out);
  out->append(f.bytes);
}

// `msg` with `edit` applied to each of its fields (false: it does not parse).
template <typename Edit>
bool Rewrite(std::string_view msg, Edit&& edit, std::string* out) {
  std::vector<Field> fields;
  if (!Fields(msg, &fields)) return false;
  out->clear();
  for (Field& f : fields) {
    if (!edit(f)) return false;
    Put(f, out);
  }
  return true;
}

uint32_t MapId(uint64_t id, const IndexMap& m) {
  const auto it = m.find(static_cast<uint32_t>(id >> 1));
  return it == m.end() ? static_cast<uint32_t>(id) : (it->second << 1) | (id & 1);
}

// The indexes of the tree's pseudo-terminals (tty-info.img's PTY entries).
std::optional<std::set<uint32_t>> TreeIndexes(const Image& info) {
  std::set<uint32_t> out;
  for (const std::string& e : info.entries) {
    std::vector<Field> fields;
    if (!Fields(e, &fields)) return std::nullopt;
    bool pty_type = false;
    std::optional<uint64_t> index;
    for (const Field& f : fields) {
      if (f.number == 2 && f.type == WireFormatLite::WIRETYPE_VARINT)
        pty_type = f.varint == kTtyTypePty;
      if (f.number == 12 && f.type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED &&
          !(index = VarintOf(f.bytes, 1)))
        return std::nullopt;
    }
    if (pty_type && index) out.insert(static_cast<uint32_t>(*index));
  }
  return out;
}

IndexMap Plan(const std::set<uint32_t>& tree, const std::set<uint32_t>& taken) {
  IndexMap out;
  uint32_t next = 0;
  for (const uint32_t index : tree) {
    if (!taken.contains(index)) continue;
    while (taken.contains(next) || tree.contains(next)) ++next;
    out[index] = next++;
  }
  return out;
}

bool RewriteTtyInfo(const std::string& e, const IndexMap& m, std::string* out) {
  return Rewrite(
      e,
      [&](Field& f) {
        if (f.number == 1 && f.type == WireFormatLite::WIRETYPE_VARINT)
          f.varint = MapId(f.varint, m);
        if (f.number == 8 && f.type == WireFormatLite::WIRETYPE_VARINT) {
          const dev_t rdev = static_cast<dev_t>(f.varint);
          const uint32_t index = (major(rdev) - kPtsMajor) * 256 + minor(rdev);
          const auto it = m.find(index);
          if (major(rdev) >= kPtsMajor && major(rdev) < kPtsMajor + kPtsMajors && it != m.end())
            f.varint =
                static_cast<uint32_t>(makedev(kPtsMajor + it->second / 256, it->second % 256));
        }
        if (f.number == 12 && f.type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
          std::string pty;
          if (!Rewrite(
                  f.bytes,
                  [&](Field& g) {
                    if (g.number == 1 && g.type == WireFormatLite::WIRETYPE_VARINT)
                      g.varint = MapId(g.varint << 1, m) >> 1;
                    return true;
                  },
                  &pty))
            return false;
          f.bytes = std::move(pty);
        }
        return true;
      },
      out);
}

bool RewriteTtyData(const std::string& e, const IndexMap& m, std::string* out) {
  return Rewrite(
      e,
      [&](Field& f) {
        if (f.number == 1 && f.type == WireFormatLite::WIRETYPE_VARINT)
          f.varint = MapId(f.varint, m);
        return true;
      },
      out);
}

// files.img: FileEntry.reg (3) and .tty (19).
bool RewriteFile(const std::string& e, const IndexMap& m, std::string* out) {
  return Rewrite(
      e,
      [&](Field& f) {
        if (f.type != WireFormatLite::WIRETYPE_LENGTH_DELIMITED ||
            (f.number != 3 && f.number != 19))
          return true;
        std::string inner;
        const bool ok = Rewrite(
            f.bytes,
            [&](Field& g) {
              if (f.number == 19 && g.number == 2 && g.type == WireFormatLite::WIRETYPE_VARINT)
                g.varint = MapId(g.varint, m);
              absl::string_view name = g.bytes;
              uint32_t index;
              if (f.number == 3 && g.number == 6 &&
                  g.type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED &&
                  absl::ConsumePrefix(&name, kPtsPrefix) && absl::SimpleAtoi(name, &index) &&
                  m.contains(index))
                g.bytes = absl::StrCat(kPtsPrefix, m.at(index));
              return true;
            },
            &inner);
        f.bytes = std::move(inner);
        return ok;
      },
      out);
}

absl::Status WriteWhole(const std::string& path, const std::string& content) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    return absl::InternalError(absl::StrCat("cannot create ", path, ": ", strerror(errno)));
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      close(fd);
      return absl::InternalError(absl::StrCat("cannot write ", path, ": ", strerror(e)));
    }
    done += static_cast<size_t>(n);
  }
  if (close(fd) != 0)
    return absl::InternalError(absl::StrCat("cannot write ", path, ": ", strerror(errno)));
  return absl::OkStatus();
}

// Puts `content` in place of dir/name, the original moved to the originals.
absl::Status Replace(const std::string& dir, const char* name, const std::string& content) {
  const std::string path = absl::StrCat(dir, "/", name);
  const std::string tmp = absl::StrCat(path, ".renumbered");
  const std::string kept = absl::StrCat(dir, "/", kPtyOriginalsDir, "/", name);
  if (absl::Status s = WriteWhole(tmp, content); !s.ok()) return s;
  if (rename(path.c_str(), kept.c_str()) != 0 || rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat("cannot replace ", path, ": ", strerror(e)));
  }
  return absl::OkStatus();
}

}  // namespace

std::set<uint32_t> PtysInUse(const std::string& devpts) {
  std::set<uint32_t> out;
  DIR* d = opendir(devpts.c_str());
  if (d == nullptr) return out;
  while (const dirent* e = readdir(d)) {
    uint32_t index;
    if (absl::SimpleAtoi(e->d_name, &index)) out.insert(index);
  }
  closedir(d);
  return out;
}

absl::StatusOr<std::map<uint32_t, uint32_t>> RenumberPtys(const std::string& dir,
                                                          const std::set<uint32_t>& taken) {
  if (absl::Status s = PutBackPtyImages(dir); !s.ok()) return s;
  absl::StatusOr<std::optional<Image>> info = ReadImage(dir, kTtyInfo);
  if (!info.ok()) return info.status();
  if (!info->has_value()) return IndexMap{};
  const std::optional<std::set<uint32_t>> tree = TreeIndexes(**info);
  if (!tree)
    return absl::DataLossError(absl::StrCat(dir, "/", kTtyInfo, ": an entry does not parse"));
  const IndexMap plan = Plan(*tree, taken);
  if (plan.empty()) return plan;

  // Everything rewritten in memory first: an image that does not parse
  // changes nothing.
  std::map<const char*, std::string> rewritten;
  for (const char* name : kRewritten) {
    absl::StatusOr<std::optional<Image>> img =
        name == kTtyInfo ? std::move(info) : ReadImage(dir, name);
    if (!img.ok()) return img.status();
    if (!img->has_value()) continue;
    for (std::string& e : (*img)->entries) {
      std::string out;
      const bool ok = name == kTtyInfo   ? RewriteTtyInfo(e, plan, &out)
                      : name == kTtyData ? RewriteTtyData(e, plan, &out)
                                         : RewriteFile(e, plan, &out);
      if (!ok)
        return absl::DataLossError(absl::StrCat(dir, "/", name, ": an entry does not parse"));
      e = std::move(out);
    }
    rewritten[name] = Serialize(**img);
  }
  const std::string kept = absl::StrCat(dir, "/", kPtyOriginalsDir);
  if (mkdir(kept.c_str(), 0700) != 0)
    return absl::InternalError(absl::StrCat("cannot create ", kept, ": ", strerror(errno)));
  for (const auto& [name, content] : rewritten) {
    if (absl::Status s = Replace(dir, name, content); !s.ok()) {
      (void)PutBackPtyImages(dir);
      return s;
    }
  }
  return plan;
}

absl::Status PutBackPtyImages(const std::string& dir) {
  const std::string kept = absl::StrCat(dir, "/", kPtyOriginalsDir);
  struct stat st;
  if (lstat(kept.c_str(), &st) != 0 && errno == ENOENT) return absl::OkStatus();
  for (const char* name : kRewritten) {
    const std::string from = absl::StrCat(kept, "/", name);
    const std::string to = absl::StrCat(dir, "/", name);
    if (rename(from.c_str(), to.c_str()) != 0 && errno != ENOENT)
      return absl::InternalError(absl::StrCat("cannot put ", from, " back: ", strerror(errno)));
    unlink(absl::StrCat(to, ".renumbered").c_str());
  }
  if (rmdir(kept.c_str()) != 0)
    return absl::InternalError(absl::StrCat("cannot remove ", kept, ": ", strerror(errno)));
  return absl::OkStatus();
}

}  // namespace rdmavirt::migrator
