// Checkpoint directories: what a directory of CRIU images holds (names,
// sizes, digests: a v1::Manifest), the check a destination runs before it
// restores from one, and the manifest file stored beside the images.
//
// Every function is thread-safe (no shared state); concurrent writers of
// the same directory are the caller's problem.
//
// manifest.pb layout (so that truncation and garbage are told apart from a
// valid manifest, which protobuf alone cannot do: a Manifest cut at a
// field boundary still parses, with fewer files):
//   8 bytes   magic "RDVMANI\x01"
//   8 bytes   length N of the serialized Manifest, little-endian
//   32 bytes  SHA-256 of those N bytes
//   N bytes   the serialized v1::Manifest
#ifndef RDMAVIRT_MIGRATOR_CRIU_IMAGE_DIR_H_
#define RDMAVIRT_MIGRATOR_CRIU_IMAGE_DIR_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rdmavirt/v1/migrator.pb.h"

namespace rdmavirt::migrator {

inline constexpr char kManifestFile[] = "manifest.pb";
inline constexpr uint32_t kManifestFormatVersion = 1;
// A file's digest: BLAKE2b-512, cryptographic like SHA-256 and several
// times faster without SHA instructions (the transfer hashes every byte on
// both hosts). Manifests written before it carry SHA-256, still verified.
inline constexpr size_t kDigestBytes = 64;
inline constexpr size_t kSha256Bytes = 32;  // older manifests; manifest.pb's header

// Whether a manifest may list `name`: relative, no empty, "." or ".."
// component, no NUL, at most 4096 bytes.
bool SafeImageName(std::string_view name);

// Every regular file under dir, recursively, sorted by name: its name
// relative to dir, its size and its digest (BLAKE2b-512). Leaves out the manifest itself
// (dir/manifest.pb and its temporary) and CRIU's `parent` links (a symlink
// named `parent` with a relative target: it points at the previous
// iteration, which is scanned on its own).
// NOT_FOUND: dir missing. FAILED_PRECONDITION: any other symlink, or a
// device, fifo or socket (named in the message). ABORTED: a file changed
// size while it was read. Other errors as errno says.
absl::StatusOr<std::vector<v1::ImageFile>> ScanImages(const std::string& dir);

// As ScanImages, without reading the files: names and sizes, digests
// empty (for a sender that hashes them as it streams them).
absl::StatusOr<std::vector<v1::ImageFile>> ListImages(const std::string& dir);

// An image file's digest (BLAKE2b-512) over data given piece by piece.
class DigestStream {
 public:
  DigestStream();
  ~DigestStream();
  DigestStream(const DigestStream&) = delete;
  DigestStream& operator=(const DigestStream&) = delete;
  void Update(std::string_view data);
  // The digest (kDigestBytes) of everything given since the start or the
  // last Final; starts again.
  std::string Final();

 private:
  void* ctx_;  // EVP_MD_CTX
};

// Checks dir against manifest: every listed file present under dir (no
// symlink on the way), regular, with the listed size and digest (BLAKE2b-512, or SHA-256 for a
// 32-byte digest). Files
// not listed are not looked at.
// FAILED_PRECONDITION: format_version is not kManifestFormatVersion.
// DATA_LOSS (naming the file and what differs): an unsafe or duplicate
// name, a digest that is not 32 bytes, a missing or non-regular file, a
// size or digest mismatch.
absl::Status VerifyImages(const std::string& dir, const v1::Manifest& manifest);

// Writes dir/manifest.pb atomically: a temporary file, fsync, rename, fsync
// of dir. INVALID_ARGUMENT: format_version is not kManifestFormatVersion or
// a name is unsafe (nothing is written).
absl::Status WriteManifest(const std::string& dir, const v1::Manifest& manifest);

// Reads dir/manifest.pb. NOT_FOUND: no manifest. DATA_LOSS: not a manifest
// file, truncated, its digest does not match, it does not parse, or it
// lists an unsafe name. FAILED_PRECONDITION: a format_version this build
// does not read.
absl::StatusOr<v1::Manifest> ReadManifest(const std::string& dir);

// The file format alone (what WriteManifest writes and ReadManifest
// checks), for tests and fuzzers. Serialize does not validate.
std::string SerializeManifestFile(const v1::Manifest& manifest);
absl::StatusOr<v1::Manifest> ParseManifestFile(std::string_view bytes);

// Lower-case hex of bytes (digests in messages and JSON).
std::string Hex(std::string_view bytes);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_CRIU_IMAGE_DIR_H_
