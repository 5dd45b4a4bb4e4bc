#include "migrator/criu/image_dir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <set>

#include "absl/strings/str_cat.h"
#include "migrator/host/scoped_fd.h"

namespace rdmavirt::migrator {
namespace {

constexpr char kMagic[8] = {'R', 'D', 'V', 'M', 'A', 'N', 'I', '\x01'};
constexpr size_t kHeaderBytes = sizeof(kMagic) + 8 + kSha256Bytes;
constexpr uint64_t kMaxManifestBytes = 64 << 20;
constexpr char kManifestTemp[] = "manifest.pb.tmp";
constexpr int kMaxDepth = 32;
constexpr size_t kReadChunk = 1 << 20;

// The '/'-separated components of name, empty ones included.
std::vector<std::string_view> Components(std::string_view name) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  for (;;) {
    const size_t slash = name.find('/', start);
    if (slash == std::string_view::npos) {
      parts.push_back(name.substr(start));
      return parts;
    }
    parts.push_back(name.substr(start, slash - start));
    start = slash + 1;
  }
}

struct MdCtxDeleter {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};

struct DirDeleter {
  void operator()(DIR* d) const { closedir(d); }
};

// The algorithm of a digest of `bytes` bytes: BLAKE2b-512, or SHA-256 for
// older manifests; nullptr for any other size.
const EVP_MD* DigestOfSize(size_t bytes) {
  if (bytes == kDigestBytes) return EVP_blake2b512();
  if (bytes == kSha256Bytes) return EVP_sha256();
  return nullptr;
}

// The digest (md) of everything fd has to read, and how many bytes that was.
absl::Status HashFd(int fd, const std::string& what, const EVP_MD* algorithm, std::string* digest,
                    uint64_t* bytes) {
  std::unique_ptr<EVP_MD_CTX, MdCtxDeleter> ctx(EVP_MD_CTX_new());
  if (!ctx || EVP_DigestInit_ex(ctx.get(), algorithm, nullptr) != 1) {
    return absl::InternalError("cannot set up the digest");
  }
  std::unique_ptr<char[]> buf(new char[kReadChunk]);
  *bytes = 0;
  for (;;) {
    const ssize_t n = read(fd, buf.get(), kReadChunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, absl::StrCat("reading ", what));
    if (n == 0) break;
    if (EVP_DigestUpdate(ctx.get(), buf.get(), static_cast<size_t>(n)) != 1) {
      return absl::InternalError("digest update");
    }
    *bytes += static_cast<uint64_t>(n);
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_DigestFinal_ex(ctx.get(), md, &len) != 1 ||
      len != static_cast<unsigned>(EVP_MD_get_size(algorithm))) {
    return absl::InternalError("digest final");
  }
  digest->assign(reinterpret_cast<const char*>(md), len);
  return absl::OkStatus();
}

std::string Sha256(std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(md), len);
}

const char* Kind(mode_t mode) {
  if (S_ISLNK(mode)) return "a symlink";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a fifo";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

// The entry `name` of `dirfd` (`rel` in the checkpoint, `shown` in
// errors), read whole: its size and digest. ABORTED when it changed while
// it was read.
absl::StatusOr<v1::ImageFile> HashedFile(int dirfd, const std::string& name, const std::string& rel,
                                         const std::string& shown) {
  // O_NONBLOCK: should it have become a fifo since the stat, do not hang.
  ScopedFd fd(openat(dirfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) return absl::ErrnoToStatus(errno, absl::StrCat("open ", shown));
  struct stat fst;
  if (fstat(fd.get(), &fst) != 0 || !S_ISREG(fst.st_mode)) {
    return absl::AbortedError(absl::StrCat(shown, " changed while it was scanned"));
  }
  v1::ImageFile f;
  f.set_name(rel);
  std::string digest;
  uint64_t bytes = 0;
  if (absl::Status s = HashFd(fd.get(), shown, EVP_blake2b512(), &digest, &bytes); !s.ok())
    return s;
  if (bytes != static_cast<uint64_t>(fst.st_size)) {
    return absl::AbortedError(absl::StrCat(shown, " changed size while it was read (", bytes,
                                           " bytes read, ", fst.st_size, " at open)"));
  }
  f.set_size(bytes);
  f.set_digest(digest);
  return f;
}

absl::Status ScanDir(int dirfd, const std::string& root, const std::string& prefix, int depth,
                     bool hash, std::vector<v1::ImageFile>* out) {
  if (depth > kMaxDepth) {
    return absl::FailedPreconditionError(
        absl::StrCat(root, "/", prefix, ": directories nested too deep"));
  }
  const int dup_fd = fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("dup for ", root, "/", prefix));
  std::unique_ptr<DIR, DirDeleter> d(fdopendir(dup_fd));
  if (!d) {
    close(dup_fd);
    return absl::ErrnoToStatus(errno, absl::StrCat("opendir ", root, "/", prefix));
  }
  for (;;) {
    errno = 0;
    const dirent* e = readdir(d.get());
    if (e == nullptr) {
      if (errno != 0) return absl::ErrnoToStatus(errno, absl::StrCat("readdir ", root));
      break;
    }
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    const std::string rel = prefix.empty() ? name : absl::StrCat(prefix, "/", name);
    const std::string shown = absl::StrCat(root, "/", rel);
    struct stat st;
    if (fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      return absl::ErrnoToStatus(errno, absl::StrCat("stat ", shown));
    }
    if (S_ISLNK(st.st_mode)) {
      char target[4096];
      const ssize_t n = readlinkat(dirfd, name.c_str(), target, sizeof(target) - 1);
      if (name == "parent" && n > 0 && target[0] != '/') continue;  // CRIU's parent link
      return absl::FailedPreconditionError(
          absl::StrCat(shown, " is a symlink: a checkpoint directory holds regular files only"));
    }
    if (S_ISDIR(st.st_mode)) {
      ScopedFd sub(openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (sub.get() < 0) return absl::ErrnoToStatus(errno, absl::StrCat("open ", shown));
      if (absl::Status s = ScanDir(sub.get(), root, rel, depth + 1, hash, out); !s.ok()) return s;
      continue;
    }
    if (!S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(
          shown, " is ", Kind(st.st_mode), ": a checkpoint directory holds regular files only"));
    }
    if (prefix.empty() && (name == kManifestFile || name == kManifestTemp)) continue;
    if (!hash) {
      v1::ImageFile f;
      f.set_name(rel);
      f.set_size(static_cast<uint64_t>(st.st_size));
      out->push_back(std::move(f));
      continue;
    }
    absl::StatusOr<v1::ImageFile> f = HashedFile(dirfd, name, rel, shown);
    if (!f.ok()) return f.status();
    out->push_back(*std::move(f));
  }
  return absl::OkStatus();
}

// Opens dir/name for reading with no symlink anywhere below dir. Returns
// the fd, or -1 with errno set.
int OpenBeneath(int dirfd, std::string_view name) {
  const std::vector<std::string_view> parts = Components(name);
  ScopedFd cur;
  int at = dirfd;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    const std::string part(parts[i]);
    ScopedFd next(openat(at, part.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (next.get() < 0) return -1;
    cur = std::move(next);
    at = cur.get();
  }
  const std::string last(parts.back());
  return openat(at, last.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
}

absl::Status CheckNames(const v1::Manifest& manifest, absl::StatusCode code) {
  std::set<std::string_view> seen;
  for (const v1::ImageFile& f : manifest.files()) {
    if (!SafeImageName(f.name())) {
      return absl::Status(code, absl::StrCat("manifest lists an unsafe file name \"", f.name(),
                                             "\" (absolute, empty, or with a \".\" or \"..\" "
                                             "component)"));
    }
    if (!seen.insert(f.name()).second) {
      return absl::Status(code, absl::StrCat("manifest lists \"", f.name(), "\" twice"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckVersion(const v1::Manifest& manifest) {
  if (manifest.format_version() != kManifestFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("manifest format_version ", manifest.format_version(),
                     ", this build reads version ", kManifestFormatVersion));
  }
  return absl::OkStatus();
}

}  // namespace

std::string Hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  s.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    s.push_back(kDigits[c >> 4]);
    s.push_back(kDigits[c & 15]);
  }
  return s;
}

bool SafeImageName(std::string_view name) {
  if (name.empty() || name.size() > 4096 || name.front() == '/') return false;
  if (name.find('\0') != std::string_view::npos) return false;
  for (std::string_view part : Components(name)) {
    if (part.empty() || part == "." || part == "..") return false;
  }
  return true;
}

namespace {

absl::StatusOr<std::vector<v1::ImageFile>> Scan(const std::string& dir, bool hash) {
  ScopedFd fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("no images dir ", dir));
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot open images dir ", dir));
  }
  std::vector<v1::ImageFile> files;
  if (absl::Status s = ScanDir(fd.get(), dir, "", 0, hash, &files); !s.ok()) return s;
  std::sort(files.begin(), files.end(),
            [](const v1::ImageFile& a, const v1::ImageFile& b) { return a.name() < b.name(); });
  return files;
}

}  // namespace

absl::StatusOr<std::vector<v1::ImageFile>> ScanImages(const std::string& dir) {
  return Scan(dir, /*hash=*/true);
}

absl::StatusOr<std::vector<v1::ImageFile>> ListImages(const std::string& dir) {
  return Scan(dir, /*hash=*/false);
}

DigestStream::DigestStream() : ctx_(EVP_MD_CTX_new()) {
  EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_blake2b512(), nullptr);
}

DigestStream::~DigestStream() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void DigestStream::Update(std::string_view data) {
  EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data.data(), data.size());
}

std::string DigestStream::Final() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), md, &len);
  EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_blake2b512(), nullptr);
  return std::string(reinterpret_cast<const char*>(md), len);
}

absl::Status VerifyImages(const std::string& dir, const v1::Manifest& manifest) {
  if (absl::Status s = CheckVersion(manifest); !s.ok()) return s;
  if (absl::Status s = CheckNames(manifest, absl::StatusCode::kDataLoss); !s.ok()) return s;
  for (const v1::ImageFile& f : manifest.files()) {
    if (DigestOfSize(f.digest().size()) == nullptr) {
      return absl::DataLossError(
          absl::StrCat("manifest entry ", f.name(), " has a ", f.digest().size(),
                       "-byte digest, neither BLAKE2b-512 (64) nor SHA-256 (32)"));
    }
  }
  ScopedFd dirfd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dirfd.get() < 0) {
    return absl::DataLossError(
        absl::StrCat("images dir ", dir, " cannot be opened: ", strerror(errno)));
  }
  for (const v1::ImageFile& f : manifest.files()) {
    const std::string shown = absl::StrCat(dir, "/", f.name());
    ScopedFd fd(OpenBeneath(dirfd.get(), f.name()));
    if (fd.get() < 0) {
      const int err = errno;
      if (err == ENOENT) return absl::DataLossError(absl::StrCat(shown, " is missing"));
      if (err == ELOOP || err == ENOTDIR) {
        return absl::DataLossError(
            absl::StrCat(shown, " is not a regular file below ", dir, " (a symlink on the way)"));
      }
      return absl::DataLossError(absl::StrCat(shown, " cannot be opened: ", strerror(err)));
    }
    struct stat st;
    if (fstat(fd.get(), &st) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("stat ", shown));
    if (!S_ISREG(st.st_mode)) {
      return absl::DataLossError(absl::StrCat(shown, " is ", Kind(st.st_mode)));
    }
    if (static_cast<uint64_t>(st.st_size) != f.size()) {
      return absl::DataLossError(
          absl::StrCat(shown, " has ", st.st_size, " bytes, the manifest says ", f.size()));
    }
    std::string digest;
    uint64_t bytes = 0;
    if (absl::Status s = HashFd(fd.get(), shown, DigestOfSize(f.digest().size()), &digest, &bytes);
        !s.ok())
      return s;
    if (bytes != f.size()) {
      return absl::DataLossError(
          absl::StrCat(shown, " gave ", bytes, " bytes, the manifest says ", f.size()));
    }
    if (digest != f.digest()) {
      return absl::DataLossError(absl::StrCat(shown, " has digest ", Hex(digest),
                                              ", the manifest says ", Hex(f.digest())));
    }
  }
  return absl::OkStatus();
}

std::string SerializeManifestFile(const v1::Manifest& manifest) {
  const std::string body = manifest.SerializeAsString();
  std::string out(kMagic, sizeof(kMagic));
  uint64_t n = body.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += Sha256(body);
  out += body;
  return out;
}

absl::StatusOr<v1::Manifest> ParseManifestFile(std::string_view bytes) {
  if (bytes.size() < kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("manifest is ", bytes.size(),
                                            " bytes, shorter than its header: truncated or "
                                            "not a manifest"));
  }
  if (memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError("not an rdmavirt manifest (bad magic)");
  }
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) {
    n |= uint64_t{static_cast<unsigned char>(bytes[sizeof(kMagic) + i])} << (8 * i);
  }
  const std::string_view body = bytes.substr(kHeaderBytes);
  if (n != body.size()) {
    return absl::DataLossError(absl::StrCat("manifest holds ", body.size(),
                                            " bytes of its body, its header says ", n,
                                            n > body.size() ? ": truncated" : ": trailing bytes"));
  }
  const std::string_view want = bytes.substr(sizeof(kMagic) + 8, kSha256Bytes);
  if (Sha256(body) != want) {
    return absl::DataLossError("manifest body does not match its SHA-256: corrupted");
  }
  v1::Manifest m;
  if (!m.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
    return absl::DataLossError("manifest body does not parse as a Manifest");
  }
  if (absl::Status s = CheckVersion(m); !s.ok()) return s;
  if (absl::Status s = CheckNames(m, absl::StatusCode::kDataLoss); !s.ok()) return s;
  return m;
}

absl::Status WriteManifest(const std::string& dir, const v1::Manifest& manifest) {
  if (manifest.format_version() != kManifestFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat("manifest format_version must be ",
                                                   kManifestFormatVersion, ", not ",
                                                   manifest.format_version()));
  }
  if (absl::Status s = CheckNames(manifest, absl::StatusCode::kInvalidArgument); !s.ok()) {
    return s;
  }
  const std::string bytes = SerializeManifestFile(manifest);
  ScopedFd dirfd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dirfd.get() < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", dir));
  const std::string tmp_shown = absl::StrCat(dir, "/", kManifestTemp);
  {
    ScopedFd fd(openat(dirfd.get(), kManifestTemp,
                       O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (fd.get() < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot create ", tmp_shown));
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t w = write(fd.get(), bytes.data() + done, bytes.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) {
        const int err = errno;
        unlinkat(dirfd.get(), kManifestTemp, 0);
        return absl::ErrnoToStatus(err, absl::StrCat("writing ", tmp_shown));
      }
      done += static_cast<size_t>(w);
    }
    if (fsync(fd.get()) != 0) {
      const int err = errno;
      unlinkat(dirfd.get(), kManifestTemp, 0);
      return absl::ErrnoToStatus(err, absl::StrCat("fsync ", tmp_shown));
    }
  }
  if (renameat(dirfd.get(), kManifestTemp, dirfd.get(), kManifestFile) != 0) {
    const int err = errno;
    unlinkat(dirfd.get(), kManifestTemp, 0);
    return absl::ErrnoToStatus(err, absl::StrCat("renaming ", tmp_shown));
  }
  if (fsync(dirfd.get()) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("fsync ", dir));
  return absl::OkStatus();
}

absl::StatusOr<v1::Manifest> ReadManifest(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kManifestFile);
  ScopedFd fd(open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("no manifest ", path));
    if (errno == ELOOP) return absl::DataLossError(absl::StrCat(path, " is a symlink"));
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("stat ", path));
  if (!S_ISREG(st.st_mode)) {
    return absl::DataLossError(absl::StrCat(path, " is ", Kind(st.st_mode)));
  }
  if (static_cast<uint64_t>(st.st_size) > kMaxManifestBytes) {
    return absl::DataLossError(
        absl::StrCat(path, " is ", st.st_size, " bytes: too large for a manifest"));
  }
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = read(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, absl::StrCat("reading ", path));
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  bytes.resize(done);
  absl::StatusOr<v1::Manifest> m = ParseManifestFile(bytes);
  if (!m.ok())
    return absl::Status(m.status().code(), absl::StrCat(path, ": ", m.status().message()));
  return m;
}

}  // namespace rdmavirt::migrator
