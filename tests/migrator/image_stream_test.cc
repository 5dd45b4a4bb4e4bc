// ImageReceiver: what a destination accepts from a PushImages stream.
#include "migrator/criu/image_stream.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "migrator/criu/image_dir.h"

namespace rdmavirt::migrator {
namespace {

class ImageReceiverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A directory of this test's own, gone afterwards: the receivers below
    // refuse a destination that exists, and a name made of the pid alone
    // met one left by an earlier process of the same pid.
    std::string base = absl::StrCat(::testing::TempDir(), "/image_stream-XXXXXX");
    ASSERT_NE(mkdtemp(base.data()), nullptr);
    base_ = base;
    src_ = base_ + "/src";
    root_ = base_ + "/dst";
    std::filesystem::create_directories(src_ + "/sub");
    FILE* f = fopen((src_ + "/pages.img").c_str(), "w");
    fputs("0123456789", f);
    fclose(f);
    f = fopen((src_ + "/sub/core.img").c_str(), "w");
    fclose(f);
    absl::StatusOr<std::vector<v1::ImageFile>> files = ScanImages(src_);
    ASSERT_TRUE(files.ok());
    manifest_.set_format_version(1);
    for (const auto& x : *files) *manifest_.add_files() = x;
    first_.set_migration_id("m");
    *first_.mutable_manifest() = manifest_;
  }

  v1::ImageChunk Piece(const std::string& name, uint64_t offset, const std::string& data) {
    v1::ImageChunk c;
    c.set_migration_id("m");
    c.set_name(name);
    c.set_offset(offset);
    c.set_data(data);
    return c;
  }

  // manifest_ listing `files` instead of its own.
  v1::Manifest WithFiles(const std::vector<v1::ImageFile>& files) {
    v1::Manifest m = manifest_;
    m.clear_files();
    for (const auto& f : files) *m.add_files() = f;
    return m;
  }

  // The stream's last message: the manifest with every digest.
  v1::ImageChunk Trailer(const v1::Manifest& m) {
    v1::ImageChunk c;
    c.set_migration_id("m");
    c.set_trailer(true);
    *c.mutable_manifest() = m;
    return c;
  }

  void TearDown() override {
    if (!base_.empty()) std::filesystem::remove_all(base_);
  }

  std::string base_, src_, root_;
  v1::Manifest manifest_;
  v1::ImageChunk first_;
};

TEST_F(ImageReceiverTest, ReceivesAWholeDirectory) {
  ImageReceiver rx(root_);
  ASSERT_TRUE(rx.Begin(first_).ok());
  ASSERT_TRUE(rx.Add(Piece("pages.img", 0, "01234")).ok());
  ASSERT_TRUE(rx.Add(Piece("pages.img", 5, "56789")).ok());
  ASSERT_TRUE(rx.Add(Piece("sub/core.img", 0, "")).ok());
  ASSERT_TRUE(rx.Add(Trailer(manifest_)).ok());
  ASSERT_TRUE(rx.Finish().ok());
  EXPECT_EQ(rx.bytes(), 10u);
  EXPECT_TRUE(ReadManifest(root_ + "/final").ok());
}

// The sender lists names and sizes only; the digests come last, and the
// receiver, which hashed what it wrote, stores the trailer's manifest.
TEST_F(ImageReceiverTest, ReceivesAManifestWithoutDigestsAndItsTrailer) {
  absl::StatusOr<std::vector<v1::ImageFile>> listed = ListImages(src_);
  ASSERT_TRUE(listed.ok());
  v1::ImageChunk first = first_;
  first.mutable_manifest()->clear_files();
  for (const auto& f : *listed) {
    EXPECT_TRUE(f.digest().empty()) << f.name();
    *first.mutable_manifest()->add_files() = f;
  }
  ImageReceiver rx(root_);
  ASSERT_TRUE(rx.Begin(first).ok());
  ASSERT_TRUE(rx.Add(Piece("pages.img", 0, "0123456789")).ok());
  ASSERT_TRUE(rx.Add(Piece("sub/core.img", 0, "")).ok());
  ASSERT_TRUE(rx.Add(Trailer(manifest_)).ok());
  ASSERT_TRUE(rx.Finish().ok());
  absl::StatusOr<v1::Manifest> stored = ReadManifest(root_ + "/final");
  ASSERT_TRUE(stored.ok());
  EXPECT_EQ(stored->SerializeAsString(), manifest_.SerializeAsString());
  EXPECT_TRUE(VerifyImages(root_ + "/final", *stored).ok());
}

TEST_F(ImageReceiverTest, AStreamWithoutItsTrailerIsDataLoss) {
  ImageReceiver rx(root_);
  ASSERT_TRUE(rx.Begin(first_).ok());
  ASSERT_TRUE(rx.Add(Piece("pages.img", 0, "0123456789")).ok());
  ASSERT_TRUE(rx.Add(Piece("sub/core.img", 0, "")).ok());
  const absl::Status st = rx.Finish();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("without its trailer"), std::string::npos) << st;
}

TEST_F(ImageReceiverTest, RefusesATrailerThatIsNotTheManifests) {
  v1::Manifest bigger = manifest_;
  bigger.mutable_files(0)->set_size(11);
  v1::Manifest short_digest = manifest_;
  short_digest.mutable_files(1)->set_digest("abc");
  v1::Manifest fewer = manifest_;
  fewer.mutable_files()->RemoveLast();
  for (const v1::Manifest* m : {&bigger, &short_digest, &fewer}) {
    ImageReceiver rx(absl::StrCat(root_, "-", m->files_size(), "-", m->files(0).size()));
    ASSERT_TRUE(rx.Begin(first_).ok());
    EXPECT_EQ(rx.Add(Trailer(*m)).code(), absl::StatusCode::kInvalidArgument);
  }
  ImageReceiver rx(root_ + "-after");
  ASSERT_TRUE(rx.Begin(first_).ok());
  ASSERT_TRUE(rx.Add(Trailer(manifest_)).ok());
  EXPECT_EQ(rx.Add(Piece("pages.img", 0, "0")).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ImageReceiverTest, RefusesNamesOutsideTheDirectory) {
  for (const char* bad :
       {"../x", "/etc/passwd", "a/../../b", "", "manifest.pb", "parent", "a//b"}) {
    v1::ImageChunk first = first_;
    first.mutable_manifest()->add_files()->set_name(bad);
    ImageReceiver rx(root_ + "-" + std::to_string(std::hash<std::string>()(bad)));
    EXPECT_EQ(rx.Begin(first).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST_F(ImageReceiverTest, RefusesPiecesThatDoNotFit) {
  ImageReceiver rx(root_);
  ASSERT_TRUE(rx.Begin(first_).ok());
  EXPECT_EQ(rx.Add(Piece("other.img", 0, "x")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rx.Add(Piece("pages.img", 3, "x")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rx.Add(Piece("pages.img", 0, "0123456789AB")).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ImageReceiverTest, ShortOrCorruptedFilesAreDataLoss) {
  {
    ImageReceiver rx(root_ + "-short");
    ASSERT_TRUE(rx.Begin(first_).ok());
    ASSERT_TRUE(rx.Add(Piece("pages.img", 0, "01234")).ok());
    EXPECT_EQ(rx.Finish().code(), absl::StatusCode::kDataLoss);
  }
  ImageReceiver rx(root_ + "-bad");
  ASSERT_TRUE(rx.Begin(first_).ok());
  ASSERT_TRUE(rx.Add(Piece("pages.img", 0, "0123456780")).ok());
  ASSERT_TRUE(rx.Add(Piece("sub/core.img", 0, "")).ok());
  ASSERT_TRUE(rx.Add(Trailer(manifest_)).ok());
  const absl::Status st = rx.Finish();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("pages.img arrived with digest"), std::string::npos) << st;
}

// A destination's Transfer service that writes what it receives, as a
// migrator's does.
class ReceivingTransfer final : public v1::Transfer::Service {
 public:
  explicit ReceivingTransfer(std::string root) : root_(std::move(root)) {}
  grpc::Status PushImages(grpc::ServerContext*, grpc::ServerReader<v1::ImageChunk>* reader,
                          v1::PushImagesResponse*) override {
    ImageReceiver rx(root_);
    v1::ImageChunk c;
    absl::Status st = reader->Read(&c) ? rx.Begin(c) : absl::InvalidArgumentError("empty");
    while (st.ok() && reader->Read(&c)) st = rx.Add(c);
    if (st.ok()) st = rx.Finish();
    result = st;
    return st.ok()
               ? grpc::Status::OK
               : grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()));
  }
  absl::Status result;

 private:
  const std::string root_;
};

class SendImagesTest : public ImageReceiverTest {
 protected:
  absl::StatusOr<uint64_t> Send(const v1::Manifest& m, v1::Manifest* hashed) {
    ReceivingTransfer service(root_);
    grpc::ServerBuilder b;
    b.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = b.BuildAndStart();
    auto stub = v1::Transfer::NewStub(server->InProcessChannel(grpc::ChannelArguments()));
    absl::StatusOr<uint64_t> sent =
        SendImages(stub.get(), "m", src_, m, false, 0, absl::Seconds(10), {}, hashed);
    server->Shutdown();
    received_ = service.result;
    return sent;
  }
  absl::Status received_;  // what the receiving end said
};

// One read of each file on each side: the sender hashes as it sends, and
// both ends agree with a full scan's digests.
TEST_F(SendImagesTest, DigestsComputedWhileSendingMatchAScan) {
  absl::StatusOr<std::vector<v1::ImageFile>> listed = ListImages(src_);
  ASSERT_TRUE(listed.ok());
  const v1::Manifest m = WithFiles(*listed);
  v1::Manifest hashed;
  absl::StatusOr<uint64_t> sent = Send(m, &hashed);
  ASSERT_TRUE(sent.ok()) << sent.status();
  EXPECT_EQ(*sent, 10u);
  EXPECT_TRUE(received_.ok()) << received_;
  EXPECT_EQ(hashed.SerializeAsString(), manifest_.SerializeAsString());
  absl::StatusOr<v1::Manifest> stored = ReadManifest(root_ + "/final");
  ASSERT_TRUE(stored.ok());
  EXPECT_EQ(stored->SerializeAsString(), manifest_.SerializeAsString());
}

TEST_F(SendImagesTest, AFileThatChangedSizeIsNotSentAsListed) {
  v1::Manifest m = manifest_;
  m.mutable_files(0)->set_size(8);  // pages.img has 10
  m.mutable_files(0)->clear_digest();
  absl::StatusOr<uint64_t> sent = Send(m, nullptr);
  EXPECT_EQ(sent.status().code(), absl::StatusCode::kAborted) << sent.status();
  EXPECT_FALSE(ReadManifest(root_ + "/final").ok());
}

TEST_F(SendImagesTest, AFileWhoseDigestIsNotTheListedOneIsDataLoss) {
  v1::Manifest m = manifest_;
  m.mutable_files(0)->set_digest(std::string(64, 'x'));
  absl::StatusOr<uint64_t> sent = Send(m, nullptr);
  EXPECT_EQ(sent.status().code(), absl::StatusCode::kDataLoss) << sent.status();
  EXPECT_FALSE(ReadManifest(root_ + "/final").ok());
}

// Files of several pieces each: every byte lands where it was, in order,
// and each file's digest is the one a scan computes.
TEST_F(SendImagesTest, FilesOfManyPiecesArriveWhole) {
  std::string big(3 * kChunkBytes + 12345, '\0');
  uint32_t x = 1;
  for (char& ch : big) ch = static_cast<char>((x = x * 1103515245 + 12345) >> 24);
  for (const char* name : {"pages-1.img", "sub/pages-2.img"}) {
    FILE* f = fopen((src_ + "/" + name).c_str(), "w");
    ASSERT_EQ(fwrite(big.data(), 1, big.size(), f), big.size());
    fclose(f);
    big[7] ^= 1;  // the second file differs
  }
  absl::StatusOr<std::vector<v1::ImageFile>> listed = ListImages(src_);
  ASSERT_TRUE(listed.ok());
  const v1::Manifest m = WithFiles(*listed);
  absl::StatusOr<uint64_t> sent = Send(m, nullptr);
  ASSERT_TRUE(sent.ok()) << sent.status();
  EXPECT_EQ(*sent, 2 * big.size() + 10);
  ASSERT_TRUE(received_.ok()) << received_;
  absl::StatusOr<std::vector<v1::ImageFile>> scanned = ScanImages(src_);
  ASSERT_TRUE(scanned.ok());
  EXPECT_TRUE(VerifyImages(root_ + "/final", WithFiles(*scanned)).ok());
}

// A piece that cannot be written fails the stream, naming the file, and
// no manifest is stored.
TEST_F(ImageReceiverTest, APieceThatCannotBeWrittenFailsTheStream) {
  ImageReceiver rx(root_);
  ASSERT_TRUE(rx.Begin(first_).ok());
  // "sub" cannot be made a directory: a file holds its name.
  FILE* f = fopen((root_ + "/final/sub").c_str(), "w");
  ASSERT_NE(f, nullptr);
  fclose(f);
  absl::Status st = rx.Add(Piece("sub/core.img", 0, ""));
  if (st.ok()) st = rx.Add(Piece("pages.img", 0, "0123456789"));
  if (st.ok()) st = rx.Finish();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_NE(st.message().find("sub/core.img"), std::string::npos) << st;
  EXPECT_FALSE(std::filesystem::exists(root_ + "/final/manifest.pb"));
}

TEST_F(ImageReceiverTest, RefusesAStreamWithoutManifest) {
  ImageReceiver rx(root_);
  v1::ImageChunk first;
  first.set_migration_id("m");
  EXPECT_EQ(rx.Begin(first).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rdmavirt::migrator
