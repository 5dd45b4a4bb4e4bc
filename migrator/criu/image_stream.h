// Moving a directory of CRIU images from one migrator to another over
// Transfer.PushImages (protos/rdmavirt/v1/migrator.proto): the sender
// streams the files its Manifest lists, hashing each as it reads it, and
// ends with a trailer that carries every file's digest (BLAKE2b-512); the receiver
// checks every name, offset and size against the manifest before writing a
// byte, hashes what it writes, and compares with the trailer at the end.
// So each file is read once on each side: no pass over the images before
// the transfer, none after it.
#ifndef RDMAVIRT_MIGRATOR_CRIU_IMAGE_STREAM_H_
#define RDMAVIRT_MIGRATOR_CRIU_IMAGE_STREAM_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "migrator/criu/image_dir.h"
#include "rdmavirt/v1/migrator.grpc.pb.h"

namespace rdmavirt::migrator {

inline constexpr size_t kChunkBytes = 1 << 20;
inline constexpr uint32_t kMaxPreDumpIterations = 64;

// A name a manifest may list: relative, no "..", "." or empty component,
// not one of the names the migrator writes itself (manifest.pb, parent).
bool ValidImageName(const std::string& name);

// Where a stream's files go under an incoming migration's directory:
// "pre-K" for pre-dump iteration K, "final" otherwise.
std::string StreamSubdir(bool pre_dump, uint32_t iteration);

using BytesProgress = std::function<void(uint64_t done, uint64_t total)>;

// Streams the files of `manifest` (names and sizes: ListImages; digests,
// if it has them, must match), read from `dir`, to `stub`, then the
// trailer. Returns the bytes sent; `hashed`, when given, gets the manifest
// with every digest. UNAVAILABLE when the destination cannot be reached or
// breaks the stream; ABORTED when a file's size is not the listed one;
// DATA_LOSS when a file's digest is not the one `manifest` lists; the
// destination's own code when it refuses.
absl::StatusOr<uint64_t> SendImages(v1::Transfer::StubInterface* stub,
                                    const std::string& migration_id, const std::string& dir,
                                    const v1::Manifest& manifest, bool pre_dump, uint32_t iteration,
                                    absl::Duration timeout, const BytesProgress& progress,
                                    v1::Manifest* hashed = nullptr);

// The receiving end of one PushImages stream. Not thread-safe: one stream.
class ImageReceiver {
 public:
  // `root`: the incoming migration's directory.
  explicit ImageReceiver(std::string root) : root_(std::move(root)) {}
  ~ImageReceiver();

  // The stream's first message: it must carry the manifest.
  // INVALID_ARGUMENT on a missing manifest, a name it may not list, or a
  // digest that is neither empty nor 32 bytes.
  absl::Status Begin(const v1::ImageChunk& first);
  // A piece of a file, or the trailer. INVALID_ARGUMENT when it is not the
  // next piece of a manifest file or goes past the file's size, when it
  // follows the trailer, or when the trailer lists other files or sizes
  // than the manifest, or digests that are not BLAKE2b-512.
  absl::Status Add(const v1::ImageChunk& chunk);
  // Every file complete and its digest (computed as it was written) the
  // trailer's and the first manifest's if it had one (DATA_LOSS otherwise,
  // naming the file; also without a trailer); the trailer's manifest
  // written beside them.
  absl::Status Finish();

  uint64_t bytes() const { return bytes_; }
  const std::string& dir() const { return dir_; }

 private:
  absl::Status Open(const std::string& name);
  // The digest of the file being written, into computed_.
  void CloseCurrent();
  absl::Status AddTrailer(const v1::ImageChunk& chunk);

  const std::string root_;
  std::string dir_;
  v1::Manifest manifest_;
  std::map<std::string, uint64_t> expected_;  // name -> size
  std::map<std::string, uint64_t> written_;
  std::string current_;
  DigestStream hash_;                            // of current_, so far
  std::map<std::string, std::string> computed_;  // name -> digest of what was written
  bool trailer_seen_ = false;
  v1::Manifest trailer_;
  int fd_ = -1;
  uint64_t bytes_ = 0;
};

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_CRIU_IMAGE_STREAM_H_
