#include "migrator/criu/image_stream.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "migrator/criu/image_dir.h"

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

namespace {

// A message of the stream of move `migration_id`'s pre-dump `iteration`
// (or its final dump).
v1::ImageChunk StreamChunk(const std::string& migration_id, bool pre_dump, uint32_t iteration) {
  v1::ImageChunk c;
  c.set_migration_id(migration_id);
  c.set_pre_dump(pre_dump);
  c.set_iteration(iteration);
  return c;
}

// A stream's files on their way out.
struct Sender {
  grpc::ClientWriterInterface<v1::ImageChunk>* writer;
  // One message for every piece, read into in place: its data's buffer is
  // allocated once and each piece is copied once on its way out (by
  // gRPC's serialization).
  v1::ImageChunk chunk;
  DigestStream hash;
  bool open = true;  // the destination still takes messages
  uint64_t sent = 0;
  uint64_t total = 0;
  const BytesProgress& progress;
};

// dir/f sent piece by piece, hashed as it goes; f gets the digest. A file
// that cannot be read, changed size, or disagrees with the manifest's
// digest is an error (the caller cancels the stream).
absl::Status SendFile(Sender* s, const std::string& dir, v1::ImageFile* f) {
  const std::string path = absl::StrCat(dir, "/", f->name());
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::string* buf = s->chunk.mutable_data();
  uint64_t offset = 0;
  s->chunk.set_name(f->name());
  do {
    buf->resize(kChunkBytes);
    in.read(buf->data(), static_cast<std::streamsize>(buf->size()));
    const size_t n = static_cast<size_t>(in.gcount());
    buf->resize(n);
    if (offset + n > f->size()) break;  // grew: said below
    s->hash.Update(*buf);
    s->chunk.set_offset(offset);
    s->open = s->writer->Write(s->chunk);
    offset += n;
    s->sent += n;
    if (s->progress) s->progress(s->sent, s->total);
    if (n == 0) break;
  } while (s->open && in);
  if (s->open && (offset != f->size() || in.peek() != std::ifstream::traits_type::eof()))
    return absl::AbortedError(
        absl::StrCat(path, " changed size while it was sent (", f->size(), " bytes listed)"));
  std::string digest = s->hash.Final();
  if (!f->digest().empty() && f->digest() != digest)
    return absl::DataLossError(
        absl::StrCat(path, " has digest ", Hex(digest), ", the manifest says ", Hex(f->digest())));
  f->set_digest(std::move(digest));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> SendImages(v1::Transfer::StubInterface* stub,
                                    const std::string& migration_id, const std::string& dir,
                                    const v1::Manifest& manifest, bool pre_dump, uint32_t iteration,
                                    absl::Duration timeout, const BytesProgress& progress,
                                    v1::Manifest* hashed) {
  uint64_t total = 0;
  for (const v1::ImageFile& f : manifest.files()) total += f.size();
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::PushImagesResponse response;
  std::unique_ptr<grpc::ClientWriterInterface<v1::ImageChunk>> writer =
      stub->PushImages(&ctx, &response);
  v1::ImageChunk first = StreamChunk(migration_id, pre_dump, iteration);
  *first.mutable_manifest() = manifest;
  Sender s{writer.get(), StreamChunk(migration_id, pre_dump, iteration), {}, true, 0, total,
           progress};
  s.open = writer->Write(first);
  v1::ImageChunk trailer = StreamChunk(migration_id, pre_dump, iteration);
  trailer.set_trailer(true);
  *trailer.mutable_manifest() = manifest;
  for (v1::ImageFile& f : *trailer.mutable_manifest()->mutable_files()) {
    if (!s.open) break;
    if (absl::Status st = SendFile(&s, dir, &f); !st.ok()) {
      ctx.TryCancel();
      return st;
    }
  }
  bool open = s.open;
  if (open) open = writer->Write(trailer);
  if (open) writer->WritesDone();
  const grpc::Status st = writer->Finish();
  if (!st.ok())
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                        absl::StrCat("pushing images: ", st.error_message()));
  if (!open) return absl::UnavailableError("the destination closed the image stream");
  if (hashed != nullptr) *hashed = trailer.manifest();
  return s.sent;
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
    if (!f.digest().empty() && f.digest().size() != kDigestBytes)
      return absl::InvalidArgumentError(
          absl::StrCat(f.name(), ": a ", f.digest().size(),
                       "-byte digest, not BLAKE2b-512 (a migrator of another version?)"));
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

void ImageReceiver::CloseCurrent() {
  if (current_.empty()) return;
  computed_[current_] = hash_.Final();
  current_.clear();
}

absl::Status ImageReceiver::Open(const std::string& name) {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  CloseCurrent();
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

absl::Status ImageReceiver::AddTrailer(const v1::ImageChunk& c) {
  if (!c.has_manifest()) return absl::InvalidArgumentError("a trailer without its manifest");
  const auto& want = manifest_.files();
  const auto& got = c.manifest().files();
  if (got.size() != want.size())
    return absl::InvalidArgumentError(
        absl::StrCat("the trailer lists ", got.size(), " files, the manifest ", want.size()));
  for (int i = 0; i < got.size(); ++i) {
    if (got[i].name() != want[i].name() || got[i].size() != want[i].size())
      return absl::InvalidArgumentError(absl::StrCat("the trailer's file ", i, " (\"",
                                                     got[i].name(), "\", ", got[i].size(),
                                                     " bytes) is not the manifest's"));
    if (got[i].digest().size() != kDigestBytes)
      return absl::InvalidArgumentError(
          absl::StrCat("the trailer's digest of ", got[i].name(),
                       " is not BLAKE2b-512 (a migrator of another version?)"));
  }
  trailer_ = c.manifest();
  trailer_seen_ = true;
  return absl::OkStatus();
}

absl::Status ImageReceiver::Add(const v1::ImageChunk& c) {
  if (dir_.empty()) return absl::FailedPreconditionError("no manifest yet");
  if (trailer_seen_) return absl::InvalidArgumentError("a message after the trailer");
  if (c.trailer()) return AddTrailer(c);
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
  hash_.Update(d);
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
  CloseCurrent();
  for (const auto& [name, size] : expected_) {
    auto w = written_.find(name);
    if (w == written_.end()) return absl::DataLossError(absl::StrCat(name, ": never received"));
    if (w->second != size)
      return absl::DataLossError(
          absl::StrCat(name, ": received ", w->second, " of its ", size, " bytes"));
  }
  if (!trailer_seen_)
    return absl::DataLossError("the image stream ended without its trailer (the digests)");
  for (int i = 0; i < trailer_.files_size(); ++i) {
    const v1::ImageFile& f = trailer_.files(i);
    const std::string& got = computed_[f.name()];
    const std::string& first = manifest_.files(i).digest();
    if (got != f.digest() || (!first.empty() && first != f.digest()))
      return absl::DataLossError(absl::StrCat(dir_, "/", f.name(), " arrived with digest ",
                                              Hex(got), ", the sender's is ", Hex(f.digest())));
  }
  return WriteManifest(dir_, trailer_);
}

}  // namespace rdmavirt::migrator
