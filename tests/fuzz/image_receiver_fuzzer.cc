// The receiving end of a PushImages stream (migrator/criu/image_stream.cc
// ImageReceiver): what a remote migrator sends before a restore, names,
// offsets, sizes and data of the files its manifest lists, written into
// the incoming migration's directory.
//
// Input: messages (fuzz_util.h SplitMessages), each a serialized
// ImageChunk: the first goes to Begin (it carries the manifest), the others
// to Add, then Finish; all in a scratch directory of its own, removed
// after.
//
// Properties: no crash, leak or undefined behaviour; nothing is created
// outside the receiver's directory (which sits five levels below the
// scratch directory, so that a name that climbs out lands where it is
// seen), no symlink is created, no file grows past its manifest size and
// the bytes on disk are the bytes counted; and a stream that Finish
// accepts left exactly the files its manifest lists, with their sizes and
// the digests of its trailer, and a manifest.pb (the trailer's) that
// ReadManifest reads back.
#include <filesystem>
#include <map>
#include <string>

#include "migrator/criu/image_dir.h"
#include "migrator/criu/image_stream.h"
#include "tests/fuzz/fuzz_util.h"

namespace rdmavirt::fuzz {
namespace {

constexpr char kRootBelowScratch[] = "a/b/c/incoming/m";

// Everything under the scratch directory is the receiver's, inside its
// root; its files are no larger than listed and hold `bytes` in all.
void CheckDisk(const ScratchDir& scratch, const migrator::ImageReceiver& rx,
               const v1::Manifest& manifest) {
  int symlinks = 0;
  const std::vector<std::string> entries = scratch.List(&symlinks);
  Check(symlinks == 0, "the receiver created a symlink");
  const std::string root = kRootBelowScratch;
  std::map<std::string, uint64_t> listed;
  for (const v1::ImageFile& f : manifest.files()) listed[f.name()] = f.size();
  const std::string dir_rel =
      rx.dir().empty() ? "" : std::filesystem::relative(rx.dir(), scratch.path()).string();
  uint64_t on_disk = 0;
  for (const std::string& e : entries) {
    Check(root.starts_with(e) || e.starts_with(root + "/"),
          "the receiver created something outside its directory");
    const std::filesystem::path p = std::filesystem::path(scratch.path()) / e;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(std::filesystem::symlink_status(p, ec))) continue;
    Check(!dir_rel.empty() && e.starts_with(dir_rel + "/"),
          "a file outside the stream's directory");
    const std::string name = e.substr(dir_rel.size() + 1);
    if (name == migrator::kManifestFile) continue;
    auto it = listed.find(name);
    Check(it != listed.end(), "the receiver created a file its manifest does not list");
    const uint64_t size = std::filesystem::file_size(p, ec);
    Check(size <= it->second, "a file grew past its manifest size");
    on_disk += size;
  }
  Check(on_disk == rx.bytes(), "the bytes on disk are not the bytes the receiver counted");
}

// Finish accepted: the directory is a complete, verified checkpoint.
void CheckFinished(const migrator::ImageReceiver& rx, const v1::Manifest& manifest) {
  absl::StatusOr<v1::Manifest> stored = migrator::ReadManifest(rx.dir());
  Check(stored.ok(), "Finish accepted, but its manifest.pb does not read back");
  Check(stored->SerializeAsString() == manifest.SerializeAsString(),
        "Finish stored another manifest than the stream's");
  Check(migrator::VerifyImages(rx.dir(), *stored).ok(),
        "Finish accepted a directory that VerifyImages refuses");
  absl::StatusOr<std::vector<v1::ImageFile>> scan = migrator::ScanImages(rx.dir());
  Check(scan.ok(), "Finish accepted a directory that ScanImages refuses");
  // Name, size and digest: a manifest may carry fields this build ignores.
  std::map<std::string, std::pair<uint64_t, std::string>> want, got;
  for (const v1::ImageFile& f : manifest.files()) want[f.name()] = {f.size(), f.digest()};
  for (const v1::ImageFile& f : *scan) got[f.name()] = {f.size(), f.digest()};
  if (Tracing() && want != got) {
    for (const auto& [name, f] : want) Trace("listed: " + name);
    for (const auto& [name, f] : got) Trace("on disk: " + name);
  }
  Check(want == got, "Finish accepted, but the directory does not hold what the manifest lists");
}

}  // namespace
}  // namespace rdmavirt::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  rdmavirt::fuzz::InitTarget();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmavirt;
  const std::vector<std::string_view> messages = fuzz::SplitMessages(data, size, 48);
  if (messages.empty()) return 0;
  v1::ImageChunk first;
  if (!first.ParseFromArray(messages[0].data(), static_cast<int>(messages[0].size()))) return 0;
  fuzz::ScratchDir scratch("image_receiver");
  bool finished = false;
  v1::Manifest trailer;
  {
    migrator::ImageReceiver rx(scratch.path() + "/" + fuzz::kRootBelowScratch);
    if (rx.Begin(first).ok()) {
      bool ok = true;
      for (size_t i = 1; ok && i < messages.size(); ++i) {
        v1::ImageChunk c;
        if (!c.ParseFromArray(messages[i].data(), static_cast<int>(messages[i].size()))) continue;
        ok = rx.Add(c).ok();
        if (ok && c.trailer()) trailer = c.manifest();
      }
      finished = ok && rx.Finish().ok();
    }
    fuzz::CheckDisk(scratch, rx, first.manifest());
    if (finished) fuzz::CheckFinished(rx, trailer);
  }
  return 0;
}
