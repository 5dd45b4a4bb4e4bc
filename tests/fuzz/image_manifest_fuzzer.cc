// Image manifests (migrator/criu/image_dir.cc): the manifest.pb of a checkpoint
// directory, read back by ReadManifest/ParseManifestFile (a restore, a
// destination that received images), and VerifyImages, which checks a
// directory against one before anything is restored from it.
//
// Input: a first byte of options, then either (bit 0 clear) the bytes of a
// manifest.pb file, or (bit 0 set) a serialized Manifest that the
// project's writer (SerializeManifestFile) wraps first, so that what the
// header's SHA-256 guards is reached too.
//
// Properties: no crash, leak or undefined behaviour; ReadManifest and
// ParseManifestFile agree; a manifest accepted lists only safe, distinct
// names and format_version 1, and survives a round trip; and VerifyImages,
// over a directory that holds symlinks (to a file, to a directory, out of
// it), a fifo and a subdirectory beside the real images, accepts only
// names of regular files below it, with their real sizes and digests
// (BLAKE2b-512, or SHA-256 for a manifest of an older migrator: both kinds
// verify, each against its own).
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "migrator/criu/image_dir.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/fuzz/image_fixture.h"

namespace rdmavirt::fuzz {
namespace {

struct Fixture {
  ScratchDir dir{"image_manifest"};
  std::string images;                          // the checkpoint directory
  std::map<std::string, v1::ImageFile> files;  // what it really holds (BLAKE2b-512)
  std::map<std::string, std::string> sha256;   // and each file's SHA-256
  std::string manifest_dir;                    // where inputs are written as manifest.pb
};

Fixture& TheFixture() {
  static Fixture* f = [] {
    auto* f = new Fixture;
    f->images = f->dir.path() + "/images";
    f->manifest_dir = f->dir.path() + "/manifest";
    WriteImageFixture(f->images);
    absl::StatusOr<std::vector<v1::ImageFile>> scan = migrator::ScanImages(f->images);
    Check(scan.ok(), "ScanImages of the fixture");
    for (const v1::ImageFile& x : *scan) {
      f->files[x.name()] = x;
      std::ifstream in(f->images + "/" + x.name(), std::ios::binary);
      const std::string data((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      unsigned char md[EVP_MAX_MD_SIZE];
      unsigned int len = 0;
      Check(EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr) == 1,
            "SHA-256 of a fixture file");
      f->sha256[x.name()] = std::string(reinterpret_cast<const char*>(md), len);
    }
    // Traps beside the images: none of them may pass for one.
    const std::string& d = f->images;
    Check(symlink((d + "/inventory.img").c_str(), (d + "/link.img").c_str()) == 0, "symlink");
    Check(symlink((d + "/sub").c_str(), (d + "/ldir").c_str()) == 0, "symlink");
    Check(symlink("/etc", (d + "/etc").c_str()) == 0, "symlink");
    Check(symlink("../empty.img", (d + "/sub/up.img").c_str()) == 0, "symlink");
    Check(mkfifo((d + "/fifo.img").c_str(), 0600) == 0, "mkfifo");
    std::filesystem::create_directories(d + "/dir.img");
    std::filesystem::create_directories(f->manifest_dir);
    return f;
  }();
  return *f;
}

void CheckManifest(const v1::Manifest& m) {
  Check(m.format_version() == migrator::kManifestFormatVersion,
        "a manifest of another format_version accepted");
  std::set<std::string> names;
  for (const v1::ImageFile& x : m.files()) {
    Check(migrator::SafeImageName(x.name()), "a manifest with an unsafe name accepted");
    Check(names.insert(x.name()).second, "a manifest listing a name twice accepted");
  }
  absl::StatusOr<v1::Manifest> again =
      migrator::ParseManifestFile(migrator::SerializeManifestFile(m));
  Check(again.ok() && again->SerializeAsString() == m.SerializeAsString(),
        "a manifest accepted does not survive a round trip");
}

void CheckVerify(const v1::Manifest& m) {
  const Fixture& f = TheFixture();
  if (!migrator::VerifyImages(f.images, m).ok()) return;
  for (const v1::ImageFile& x : m.files()) {
    auto it = f.files.find(x.name());
    Check(it != f.files.end(), "VerifyImages accepted a name that is not a regular image file");
    const std::string& real =
        x.digest().size() == migrator::kSha256Bytes ? f.sha256.at(x.name()) : it->second.digest();
    Check(it->second.size() == x.size() && real == x.digest(),
          "VerifyImages accepted a wrong size or digest");
  }
}

}  // namespace
}  // namespace rdmavirt::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  rdmavirt::fuzz::InitTarget();
  rdmavirt::fuzz::TheFixture();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmavirt;
  if (size == 0) return 0;
  const fuzz::Fixture& f = fuzz::TheFixture();
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::string file;
  if (data[0] & 1) {
    v1::Manifest body;
    if (!body.ParseFromArray(rest.data(), static_cast<int>(rest.size()))) return 0;
    file = migrator::SerializeManifestFile(body);
  } else {
    file = std::string(rest);
  }
  absl::StatusOr<v1::Manifest> parsed = migrator::ParseManifestFile(file);
  {
    std::ofstream out(f.manifest_dir + "/" + migrator::kManifestFile,
                      std::ios::binary | std::ios::trunc);
    out << file;
  }
  absl::StatusOr<v1::Manifest> read = migrator::ReadManifest(f.manifest_dir);
  fuzz::Check(read.status().code() == parsed.status().code(),
              "ReadManifest and ParseManifestFile disagree");
  if (!parsed.ok()) return 0;
  fuzz::Check(read->SerializeAsString() == parsed->SerializeAsString(),
              "ReadManifest and ParseManifestFile read different manifests");
  fuzz::CheckManifest(*parsed);
  fuzz::CheckVerify(*parsed);
  return 0;
}
