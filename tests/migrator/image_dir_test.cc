// Checkpoint directories: the scan lists what a restore needs and refuses
// what cannot travel; verification catches every way images go wrong; the
// manifest file survives a round trip and refuses truncation and garbage.
#include "migrator/criu/image_dir.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdmavirt::migrator {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// SHA-256("abc") and SHA-256("").
// BLAKE2b-512 of "abc" and of nothing (RFC 7693; `openssl dgst -blake2b512`).
constexpr char kAbcDigest[] =
    "ba80a53f981c4d0d6a2797b69f12f6e94c212f14685ac4b74b12bb6fdbffa2d1"
    "7d87c5392aab792dc252d5de4533cc9518d38aa8dbf1925ab92386edd4009923";
constexpr char kEmptyDigest[] =
    "786a02f742015903c6c6fd852552d272912f4740e15847618a86e217f71f5419"
    "d25e1031afee585313896444934eb04b903a685b1448b755d56f701afe9be2ce";
// SHA-256 of "abc", as a manifest written before BLAKE2b has it.
constexpr char kAbcSha256[] =
    "\xba\x78\x16\xbf\x8f\x01\xcf\xea\x41\x41\x40\xde\x5d\xae\x22\x23"
    "\xb0\x03\x61\xa3\x96\x17\x7a\x9c\xb4\x10\xff\x61\xf2\x00\x15\xad";

class ImageDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* base = getenv("TEST_TMPDIR");
    std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/image_dir_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  void Write(const std::string& name, const std::string& content) {
    const fs::path p = fs::path(dir_) / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary | std::ios::trunc) << content;
  }

  std::string Read(const std::string& name) {
    std::ifstream in(fs::path(dir_) / name, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  // A directory as CRIU leaves it, and its manifest.
  v1::Manifest Sample() {
    Write("inventory.img", "abc");
    Write("pages-1.img", std::string(100000, 'p'));
    Write("empty.img", "");
    Write("sub/core-42.img", "core");
    absl::StatusOr<std::vector<v1::ImageFile>> files = ScanImages(dir_);
    EXPECT_TRUE(files.ok()) << files.status();
    v1::Manifest m;
    m.set_format_version(kManifestFormatVersion);
    m.set_migration_id("m1");
    for (auto& f : *files) *m.add_files() = f;
    return m;
  }

  std::string dir_;
};

TEST_F(ImageDirTest, ScanListsFilesRecursivelyWithSizesAndDigests) {
  Sample();
  absl::StatusOr<std::vector<v1::ImageFile>> files = ScanImages(dir_);
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_EQ(files->size(), 4u);
  EXPECT_EQ((*files)[0].name(), "empty.img");
  EXPECT_EQ((*files)[0].size(), 0u);
  EXPECT_EQ(Hex((*files)[0].digest()), kEmptyDigest);
  EXPECT_EQ((*files)[1].name(), "inventory.img");
  EXPECT_EQ((*files)[1].size(), 3u);
  EXPECT_EQ(Hex((*files)[1].digest()), kAbcDigest);
  EXPECT_EQ((*files)[2].name(), "pages-1.img");
  EXPECT_EQ((*files)[2].size(), 100000u);
  EXPECT_EQ((*files)[3].name(), "sub/core-42.img");
}

TEST_F(ImageDirTest, ScanSkipsTheManifestAndCriusParentLink) {
  const v1::Manifest m = Sample();
  ASSERT_TRUE(WriteManifest(dir_, m).ok());
  ASSERT_EQ(symlink("../pre-1", (dir_ + "/parent").c_str()), 0);
  absl::StatusOr<std::vector<v1::ImageFile>> files = ScanImages(dir_);
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_EQ(files->size(), 4u);
}

TEST_F(ImageDirTest, ScanRefusesOtherSymlinks) {
  Sample();
  ASSERT_EQ(symlink("/etc/passwd", (dir_ + "/evil.img").c_str()), 0);
  absl::StatusOr<std::vector<v1::ImageFile>> files = ScanImages(dir_);
  EXPECT_EQ(files.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(files.status().message(), HasSubstr("evil.img is a symlink"));
}

TEST_F(ImageDirTest, ScanRefusesAnAbsoluteParentLink) {
  Sample();
  ASSERT_EQ(symlink("/etc", (dir_ + "/parent").c_str()), 0);
  EXPECT_EQ(ScanImages(dir_).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ImageDirTest, ScanRefusesASymlinkedDirectory) {
  Sample();
  ASSERT_EQ(symlink("sub", (dir_ + "/sub2").c_str()), 0);
  EXPECT_EQ(ScanImages(dir_).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ImageDirTest, ScanRefusesAFifo) {
  Sample();
  ASSERT_EQ(mkfifo((dir_ + "/sub/pipe").c_str(), 0600), 0);
  absl::StatusOr<std::vector<v1::ImageFile>> files = ScanImages(dir_);
  EXPECT_EQ(files.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(files.status().message(), HasSubstr("sub/pipe is a fifo"));
}

TEST_F(ImageDirTest, ScanRefusesASocket) {
  Sample();
  const int s = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(s, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = dir_ + "/sock";
  ASSERT_LT(path.size(), sizeof(addr.sun_path));
  memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  close(s);
  absl::StatusOr<std::vector<v1::ImageFile>> files = ScanImages(dir_);
  EXPECT_EQ(files.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(files.status().message(), HasSubstr("is a socket"));
}

TEST_F(ImageDirTest, ScanOfAMissingDirIsNotFound) {
  EXPECT_EQ(ScanImages(dir_ + "/nope").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ImageDirTest, VerifyAcceptsIntactImages) {
  const v1::Manifest m = Sample();
  EXPECT_TRUE(VerifyImages(dir_, m).ok());
  // Files the manifest does not list (CRIU's stats-restore) do not matter.
  Write("stats-restore", "x");
  EXPECT_TRUE(VerifyImages(dir_, m).ok());
}

TEST_F(ImageDirTest, VerifyCatchesACorruptedByte) {
  const v1::Manifest m = Sample();
  std::string pages = Read("pages-1.img");
  pages[51234] ^= 0x01;
  Write("pages-1.img", pages);
  const absl::Status s = VerifyImages(dir_, m);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("pages-1.img has digest"));
  EXPECT_THAT(s.message(), HasSubstr("the manifest says"));
}

TEST_F(ImageDirTest, VerifyCatchesATruncatedFile) {
  const v1::Manifest m = Sample();
  ASSERT_EQ(truncate((dir_ + "/pages-1.img").c_str(), 4096), 0);
  const absl::Status s = VerifyImages(dir_, m);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("pages-1.img has 4096 bytes, the manifest says 100000"));
}

TEST_F(ImageDirTest, VerifyCatchesAMissingFile) {
  const v1::Manifest m = Sample();
  fs::remove(fs::path(dir_) / "sub/core-42.img");
  const absl::Status s = VerifyImages(dir_, m);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("sub/core-42.img is missing"));
}

TEST_F(ImageDirTest, VerifyRefusesUnsafeNames) {
  const v1::Manifest good = Sample();
  for (const char* name :
       {"../x", "/etc/passwd", "sub/../../x", "a//b", "./inventory.img", "", "sub/"}) {
    v1::Manifest m = good;
    m.mutable_files(0)->set_name(name);
    const absl::Status s = VerifyImages(dir_, m);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << name;
    EXPECT_THAT(s.message(), HasSubstr("unsafe file name")) << name;
  }
}

TEST_F(ImageDirTest, VerifyRefusesADuplicateName) {
  v1::Manifest m = Sample();
  *m.add_files() = m.files(1);
  const absl::Status s = VerifyImages(dir_, m);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("twice"));
}

TEST_F(ImageDirTest, VerifyRefusesASymlinkInPlaceOfAFile) {
  const v1::Manifest m = Sample();
  const std::string outside = dir_ + "-outside";
  fs::create_directories(outside);
  std::ofstream(outside + "/core-42.img") << "core";
  fs::remove_all(fs::path(dir_) / "sub");
  ASSERT_EQ(symlink(outside.c_str(), (dir_ + "/sub").c_str()), 0);
  const absl::Status s = VerifyImages(dir_, m);
  fs::remove_all(outside);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("symlink"));

  fs::remove(fs::path(dir_) / "sub");
  fs::remove(fs::path(dir_) / "empty.img");
  ASSERT_EQ(symlink("inventory.img", (dir_ + "/empty.img").c_str()), 0);
  EXPECT_EQ(VerifyImages(dir_, m).code(), absl::StatusCode::kDataLoss);
}

TEST_F(ImageDirTest, VerifyRefusesAShortDigest) {
  v1::Manifest m = Sample();
  m.mutable_files(1)->set_digest("abc");
  const absl::Status s = VerifyImages(dir_, m);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("3-byte digest"));
}

// A checkpoint written before BLAKE2b lists SHA-256 digests: it still
// restores, and a file that does not match one is still refused.
TEST_F(ImageDirTest, VerifyChecksAnOlderManifestsSha256Digests) {
  v1::Manifest m = Sample();
  v1::Manifest old;
  old.set_format_version(m.format_version());
  v1::ImageFile* f = old.add_files();
  f->set_name("inventory.img");
  f->set_size(3);
  f->set_digest(std::string(kAbcSha256, 32));
  EXPECT_TRUE(VerifyImages(dir_, old).ok()) << VerifyImages(dir_, old);
  Write("inventory.img", "abd");
  const absl::Status s = VerifyImages(dir_, old);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("inventory.img has digest"));
}

TEST_F(ImageDirTest, VerifyRefusesAnotherFormatVersion) {
  v1::Manifest m = Sample();
  m.set_format_version(2);
  EXPECT_EQ(VerifyImages(dir_, m).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ImageDirTest, ManifestRoundTrip) {
  v1::Manifest m = Sample();
  m.set_source_host("host1");
  m.set_created_at("2025-01-02T03:04:05Z");
  m.mutable_endpoint()->set_endpoint_id("e1");
  ASSERT_TRUE(WriteManifest(dir_, m).ok());
  struct stat st;
  ASSERT_EQ(stat((dir_ + "/manifest.pb").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_FALSE(fs::exists(fs::path(dir_) / "manifest.pb.tmp"));
  absl::StatusOr<v1::Manifest> back = ReadManifest(dir_);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), m.SerializeAsString());
  EXPECT_TRUE(VerifyImages(dir_, *back).ok());

  // A second write replaces the first.
  m.set_migration_id("m2");
  ASSERT_TRUE(WriteManifest(dir_, m).ok());
  EXPECT_EQ(ReadManifest(dir_)->migration_id(), "m2");
}

TEST_F(ImageDirTest, WriteManifestRefusesWhatReadWouldRefuse) {
  v1::Manifest m = Sample();
  m.set_format_version(0);
  EXPECT_EQ(WriteManifest(dir_, m).code(), absl::StatusCode::kInvalidArgument);
  m.set_format_version(kManifestFormatVersion);
  m.mutable_files(0)->set_name("../x");
  EXPECT_EQ(WriteManifest(dir_, m).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(fs::path(dir_) / "manifest.pb"));
}

TEST_F(ImageDirTest, ReadManifestMissingIsNotFound) {
  EXPECT_EQ(ReadManifest(dir_).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ImageDirTest, ReadManifestRefusesGarbage) {
  Write("manifest.pb", "this is not a manifest at all, just some text that is long enough");
  const absl::Status s = ReadManifest(dir_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("bad magic"));
  Write("manifest.pb", "");
  EXPECT_EQ(ReadManifest(dir_).status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(ImageDirTest, ReadManifestRefusesTruncation) {
  v1::Manifest m = Sample();
  ASSERT_TRUE(WriteManifest(dir_, m).ok());
  const std::string full = Read("manifest.pb");
  // Every cut, including those at a protobuf field boundary (which a bare
  // Manifest would parse as one with fewer files).
  for (size_t n = 0; n < full.size(); ++n) {
    ASSERT_EQ(ParseManifestFile(full.substr(0, n)).status().code(), absl::StatusCode::kDataLoss)
        << "cut at " << n;
  }
  Write("manifest.pb", full.substr(0, full.size() - 1));
  const absl::Status s = ReadManifest(dir_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("truncated"));
}

TEST_F(ImageDirTest, ReadManifestRefusesAFlippedByte) {
  ASSERT_TRUE(WriteManifest(dir_, Sample()).ok());
  const std::string full = Read("manifest.pb");
  for (size_t i = 0; i < full.size(); ++i) {
    std::string bad = full;
    bad[i] ^= 0x20;
    ASSERT_EQ(ParseManifestFile(bad).status().code(), absl::StatusCode::kDataLoss) << "byte " << i;
  }
  std::string bad = full;
  bad[full.size() - 5] ^= 0x01;
  Write("manifest.pb", bad);
  const absl::Status s = ReadManifest(dir_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("corrupted"));
}

TEST_F(ImageDirTest, ReadManifestRefusesAnotherFormatVersion) {
  v1::Manifest m = Sample();
  m.set_format_version(2);
  Write("manifest.pb", SerializeManifestFile(m));
  const absl::Status s = ReadManifest(dir_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("format_version 2"));
}

TEST_F(ImageDirTest, ReadManifestRefusesAnUnsafeName) {
  v1::Manifest m = Sample();
  m.mutable_files(2)->set_name("../x");
  Write("manifest.pb", SerializeManifestFile(m));
  const absl::Status s = ReadManifest(dir_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("\"../x\""));
}

TEST_F(ImageDirTest, ReadManifestRefusesAWellFramedBodyThatDoesNotParse) {
  // A body of protobuf garbage (a tag with wire type 7) under a header that
  // matches it: magic, length, SHA-256 (`sha256sum` of the body).
  const std::string body = "\xff\xff\xff\xff\x0f";
  const std::string sha256(
      "\xd4\x77\x15\xda\xb0\x5e\x27\xd5\xb3\x08\xb3\xb6\x4d\x23\x1d\x6c"
      "\x1b\xdb\xa6\x82\xf9\x25\x1e\xb1\xd1\x32\xf8\xaa\x13\x00\xd5\xbe",
      32);
  std::string file = SerializeManifestFile(v1::Manifest()).substr(0, 8);
  for (int i = 0; i < 8; ++i) file.push_back(static_cast<char>(i == 0 ? body.size() : 0));
  file += sha256 + body;
  const absl::Status s = ParseManifestFile(file).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("does not parse"));
}

}  // namespace
}  // namespace rdmavirt::migrator
