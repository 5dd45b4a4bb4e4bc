// ImageReceiver: what a destination accepts from a PushImages stream.
#include "migrator/image_stream.h"

#include <unistd.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "migrator/image_dir.h"

namespace rdmavirt::migrator {
namespace {

class ImageReceiverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    src_ = absl::StrCat(::testing::TempDir(), "/image_stream_src-", getpid());
    root_ = absl::StrCat(::testing::TempDir(), "/image_stream_dst-", getpid());
    std::filesystem::remove_all(src_);
    std::filesystem::remove_all(root_);
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

  std::string src_, root_;
  v1::Manifest manifest_;
  v1::ImageChunk first_;
};

TEST_F(ImageReceiverTest, ReceivesAWholeDirectory) {
  ImageReceiver rx(root_);
  ASSERT_TRUE(rx.Begin(first_).ok());
  ASSERT_TRUE(rx.Add(Piece("pages.img", 0, "01234")).ok());
  ASSERT_TRUE(rx.Add(Piece("pages.img", 5, "56789")).ok());
  ASSERT_TRUE(rx.Add(Piece("sub/core.img", 0, "")).ok());
  ASSERT_TRUE(rx.Finish().ok());
  EXPECT_EQ(rx.bytes(), 10u);
  EXPECT_TRUE(ReadManifest(root_ + "/final").ok());
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
  EXPECT_EQ(rx.Finish().code(), absl::StatusCode::kDataLoss);
}

TEST_F(ImageReceiverTest, RefusesAStreamWithoutManifest) {
  ImageReceiver rx(root_);
  v1::ImageChunk first;
  first.set_migration_id("m");
  EXPECT_EQ(rx.Begin(first).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rdmavirt::migrator
