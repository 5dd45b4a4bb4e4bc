#include "migrator/image_stream.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "migrator/image_dir.h"

namespace rdmavirt::migrator {

bool ValidImageName(const std::string& name) {
  if (!SafeImageName(name)) return false;
  // manifest.pb.tmp: WriteManifest's temporary (image_dir.cc), which
  // Finish would write over the image and rename to manifest.pb.
  return name != kManifestFile && name != "manifest.pb.tmp" && name != "parent" &&
         name != "record.pb";
}

std::string StreamSubdir(bool pre_dump, uint32_t iteration) {
  return pre_dump ? absl::StrCat("pre-", iteration) : "final";
}

absl::StatusOr<uint64_t> SendImages(v1::Transfer::StubInterface* stub,
                                    const std::string& migration_id, const std::string& dir,
                                    const v1::Manifest& manifest, bool pre_dump, uint32_t iteration,
                                    absl::Duration timeout, const BytesProgress& progress) {
  uint64_t total = 0;
  for (const v1::ImageFile& f : manifest.files()) total += f.size();
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::PushImagesResponse response;
  std::unique_ptr<grpc::ClientWriterInterface<v1::ImageChunk>> writer =
      stub->PushImages(&ctx, &response);
  v1::ImageChunk first;
  first.set_migration_id(migration_id);
  *first.mutable_manifest() = manifest;
  first.set_pre_dump(pre_dump);
  first.set_iteration(iteration);
  bool open = writer->Write(first);
  uint64_t sent = 0;
  std::string buf(kChunkBytes, '\0');
  for (const v1::ImageFile& f : manifest.files()) {
    if (!open) break;
    std::ifstream in(dir + "/" + f.name(), std::ios::binary);
    if (!in) {
      ctx.TryCancel();
      return absl::NotFoundError(absl::StrCat("cannot read ", dir, "/", f.name()));
    }
    uint64_t offset = 0;
    do {
      in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
      const size_t n = static_cast<size_t>(in.gcount());
      v1::ImageChunk c;
      c.set_migration_id(migration_id);
      c.set_name(f.name());
      c.set_offset(offset);
      c.set_data(buf.data(), n);
      c.set_pre_dump(pre_dump);
      c.set_iteration(iteration);
      open = writer->Write(c);
      offset += n;
      sent += n;
      if (progress) progress(sent, total);
      if (n == 0) break;
    } while (open && in);
  }
  if (open) writer->WritesDone();
  const grpc::Status st = writer->Finish();
  if (!st.ok())
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                        absl::StrCat("pushing images: ", st.error_message()));
  if (!open) return absl::UnavailableError("the destination closed the image stream");
  return sent;
}

ImageReceiver::~ImageReceiver() {
  if (fd_ >= 0) close(fd_);
}

absl::Status ImageReceiver::Begin(const v1::ImageChunk& first) {
  if (!first.has_manifest())
    return absl::InvalidArgumentError("an image stream must begin with its manifest");
  if (first.pre_dump() && (first.iteration() == 0 || first.iteration() > kMaxPreDumpIterations))
    return absl::InvalidArgumentError(
        absl::StrCat("pre-dump iteration ", first.iteration(), " out of range"));
  manifest_ = first.manifest();
  for (const v1::ImageFile& f : manifest_.files()) {
    if (!ValidImageName(f.name()))
      return absl::InvalidArgumentError(absl::StrCat("invalid image name \"", f.name(), "\""));
    if (f.size() > (uint64_t{1} << 40))
      return absl::InvalidArgumentError(absl::StrCat(f.name(), ": size ", f.size(), " too large"));
    if (!expected_.emplace(f.name(), f.size()).second)
      return absl::InvalidArgumentError(absl::StrCat(f.name(), " listed twice"));
  }
  dir_ = root_ + "/" + StreamSubdir(first.pre_dump(), first.iteration());
  std::error_code ec;
  if (std::filesystem::exists(dir_, ec))
    return absl::AlreadyExistsError(absl::StrCat(dir_, " was received already"));
  std::filesystem::create_directories(dir_, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("creating ", dir_, ": ", ec.message()));
  return absl::OkStatus();
}

absl::Status ImageReceiver::Open(const std::string& name) {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  const std::string path = dir_ + "/" + name;
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec) return absl::UnavailableError(absl::StrCat("creating the directory of ", path));
  fd_ = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd_ < 0)
    return absl::UnavailableError(absl::StrCat("creating ", path, ": ", strerror(errno)));
  current_ = name;
  return absl::OkStatus();
}

absl::Status ImageReceiver::Add(const v1::ImageChunk& c) {
  if (dir_.empty()) return absl::FailedPreconditionError("no manifest yet");
  auto it = expected_.find(c.name());
  if (it == expected_.end())
    return absl::InvalidArgumentError(absl::StrCat("\"", c.name(), "\" is not in the manifest"));
  auto [w, fresh] = written_.emplace(c.name(), 0);
  if (c.offset() != w->second)
    return absl::InvalidArgumentError(
        absl::StrCat(c.name(), ": piece at offset ", c.offset(), ", expected ", w->second));
  if (w->second + c.data().size() > it->second)
    return absl::InvalidArgumentError(
        absl::StrCat(c.name(), ": more than the manifest's ", it->second, " bytes"));
  if (fresh || current_ != c.name()) {
    if (!fresh) return absl::InvalidArgumentError(absl::StrCat(c.name(), ": pieces out of order"));
    if (absl::Status st = Open(c.name()); !st.ok()) return st;
  }
  const std::string& d = c.data();
  size_t done = 0;
  while (done < d.size()) {
    const ssize_t n = write(fd_, d.data() + done, d.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      return absl::UnavailableError(absl::StrCat("writing ", c.name(), ": ", strerror(errno)));
    done += static_cast<size_t>(n);
  }
  w->second += d.size();
  bytes_ += d.size();
  return absl::OkStatus();
}

absl::Status ImageReceiver::Finish() {
  if (dir_.empty()) return absl::InvalidArgumentError("an empty image stream");
  if (fd_ >= 0) {
    if (fsync(fd_) != 0) return absl::UnavailableError(absl::StrCat("syncing ", current_));
    close(fd_);
    fd_ = -1;
  }
  for (const auto& [name, size] : expected_) {
    auto w = written_.find(name);
    const uint64_t got = w == written_.end() ? 0 : w->second;
    if (got != size)
      return absl::DataLossError(
          absl::StrCat(name, ": received ", got, " of its ", size, " bytes"));
  }
  if (absl::Status st = VerifyImages(dir_, manifest_); !st.ok()) return st;
  return WriteManifest(dir_, manifest_);
}

}  // namespace rdmavirt::migrator
