// RenumberPtys: a dumped tree's pseudo-terminals moved off the indexes the
// restoring host holds, in images laid out as CRIU 3.17 writes them
// (magic.h, tty.proto, fdinfo.proto, regfile.proto), and put back after.
#include "migrator/criu/pty_images.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "migrator/criu/criu_images.h"
#include "tests/migrator/criu_image_bytes.h"

namespace rdmavirt::migrator {
namespace {

using image_bytes::BytesField;
using image_bytes::Le32;
using image_bytes::Varint;
using image_bytes::VarintField;

constexpr uint32_t kCommon = 0x54564319, kTtyInfoMagic = 0x59453036, kFilesMagic = 0x56303138,
                   kTtyDataMagic = 0x59413026;

std::string Image(uint32_t magic, const std::vector<std::string>& entries) {
  std::string img;
  Le32(&img, kCommon);
  Le32(&img, magic);
  for (const std::string& e : entries) {
    Le32(&img, static_cast<uint32_t>(e.size()));
    img.append(e);
  }
  return img;
}

// A TtyInfoEntry of a Unix98 pseudo-terminal's side, with termios (a
// nested message that must come through unchanged).
std::string TtyInfo(uint32_t index, bool master) {
  std::string termios;
  for (int f = 1; f <= 7; ++f) VarintField(&termios, f, 1000 + f);
  std::string pty;
  VarintField(&pty, 1, index);
  std::string m;
  VarintField(&m, 1, (index << 1) | (master ? 1 : 0));
  VarintField(&m, 2, 1);  // PTY
  VarintField(&m, 3, 0);
  VarintField(&m, 4, 0);
  VarintField(&m, 5, 0);
  VarintField(&m, 6, 77);
  VarintField(&m, 7, 78);
  VarintField(&m, 8, master ? makedev(5, 2) : makedev(136, index));
  BytesField(&m, 9, termios);
  BytesField(&m, 12, pty);
  return m;
}
// FileEntry of type REG (1) with that name, and of type TTY (7) naming
// the tty-info id and its reg entry.
std::string RegFile(uint32_t id, const std::string& name) {
  std::string reg;
  VarintField(&reg, 1, id);
  VarintField(&reg, 2, 02);
  VarintField(&reg, 3, 0);
  BytesField(&reg, 5, std::string("\x08\x00", 2));
  BytesField(&reg, 6, name);
  std::string m;
  VarintField(&m, 1, 1);
  VarintField(&m, 2, id);
  BytesField(&m, 3, reg);
  return m;
}
std::string TtyFile(uint32_t id, uint32_t info_id, uint32_t regf_id) {
  std::string tty;
  VarintField(&tty, 1, id);
  VarintField(&tty, 2, info_id);
  VarintField(&tty, 3, 02);
  BytesField(&tty, 4, std::string("\x08\x00", 2));
  VarintField(&tty, 6, regf_id);
  std::string m;
  VarintField(&m, 1, 7);
  VarintField(&m, 2, id);
  BytesField(&m, 19, tty);
  return m;
}
std::string TtyData(uint32_t tty_id, const std::string& data) {
  std::string m;
  VarintField(&m, 1, tty_id);
  BytesField(&m, 2, data);
  return m;
}

class PtyImagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/pty-images-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void Put(const std::string& name, const std::string& content) {
    std::ofstream(dir_ + "/" + name, std::ios::binary) << content;
  }
  std::string Get(const std::string& name) {
    std::ifstream in(dir_ + "/" + name, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  // Two pairs (0 and 1) whose masters and slaves the tree holds, one
  // other file, and data queued on pair 1's slave.
  void WriteTree() {
    Put("tty-info.img", Image(kTtyInfoMagic, {TtyInfo(0, true), TtyInfo(0, false), TtyInfo(1, true),
                                              TtyInfo(1, false)}));
    Put("files.img",
        Image(kFilesMagic,
              {RegFile(10, "/dev/ptmx"), TtyFile(11, 1, 10), RegFile(12, "/dev/pts/0"),
               TtyFile(13, 0, 12), RegFile(14, "/dev/ptmx"), TtyFile(15, 3, 14),
               RegFile(16, "/dev/pts/1"), TtyFile(17, 2, 16), RegFile(18, "/dev/pts/10")}));
    Put("tty-data.img", Image(kTtyDataMagic, {TtyData(2, "queued")}));
    Put("inventory.img", "not touched");
  }

  std::string dir_;
};

TEST_F(PtyImagesTest, CollidingPairsGetTheLowestFreeIndexesAndEveryReferenceFollows) {
  WriteTree();
  const std::string info = Get("tty-info.img"), files = Get("files.img"),
                    data = Get("tty-data.img");
  // The host holds 0, 1 and 3: pair 0 goes to 2, pair 1 to 4.
  absl::StatusOr<std::map<uint32_t, uint32_t>> moved = RenumberPtys(dir_, {0, 1, 3});
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(*moved, (std::map<uint32_t, uint32_t>{{0, 2}, {1, 4}}));

  EXPECT_EQ(Get("tty-info.img"), Image(kTtyInfoMagic, {TtyInfo(2, true), TtyInfo(2, false),
                                                       TtyInfo(4, true), TtyInfo(4, false)}));
  EXPECT_EQ(Get("files.img"),
            Image(kFilesMagic,
                  {RegFile(10, "/dev/ptmx"), TtyFile(11, 5, 10), RegFile(12, "/dev/pts/2"),
                   TtyFile(13, 4, 12), RegFile(14, "/dev/ptmx"), TtyFile(15, 9, 14),
                   RegFile(16, "/dev/pts/4"), TtyFile(17, 8, 16), RegFile(18, "/dev/pts/10")}));
  EXPECT_EQ(Get("tty-data.img"), Image(kTtyDataMagic, {TtyData(8, "queued")}));
  EXPECT_EQ(Get("inventory.img"), "not touched");

  ASSERT_TRUE(PutBackPtyImages(dir_).ok());
  EXPECT_EQ(Get("tty-info.img"), info);
  EXPECT_EQ(Get("files.img"), files);
  EXPECT_EQ(Get("tty-data.img"), data);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/" + kPtyOriginalsDir));
}

TEST_F(PtyImagesTest, OnlyTheCollidingPairMovesAndNotOntoAnIndexOfTheTree) {
  WriteTree();
  // 1 is taken; 0 is the tree's own, so pair 1 goes to 2.
  absl::StatusOr<std::map<uint32_t, uint32_t>> moved = RenumberPtys(dir_, {1});
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(*moved, (std::map<uint32_t, uint32_t>{{1, 2}}));
  EXPECT_EQ(Get("tty-info.img"), Image(kTtyInfoMagic, {TtyInfo(0, true), TtyInfo(0, false),
                                                       TtyInfo(2, true), TtyInfo(2, false)}));
}

TEST_F(PtyImagesTest, NothingIsWrittenWhenNoIndexIsTakenOrTheTreeHoldsNoTerminal) {
  WriteTree();
  const std::string info = Get("tty-info.img");
  absl::StatusOr<std::map<uint32_t, uint32_t>> moved = RenumberPtys(dir_, {5, 6});
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_TRUE(moved->empty());
  EXPECT_EQ(Get("tty-info.img"), info);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/" + kPtyOriginalsDir));

  std::filesystem::remove(dir_ + "/tty-info.img");
  moved = RenumberPtys(dir_, {0, 1});
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_TRUE(moved->empty());
}

TEST_F(PtyImagesTest, AMalformedImageChangesNothing) {
  WriteTree();
  std::string files = Get("files.img");
  files.resize(files.size() - 3);  // the last entry cut short
  Put("files.img", files);
  const std::string info = Get("tty-info.img");
  absl::StatusOr<std::map<uint32_t, uint32_t>> moved = RenumberPtys(dir_, {0});
  ASSERT_FALSE(moved.ok());
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kDataLoss) << moved.status();
  EXPECT_EQ(Get("tty-info.img"), info);
  EXPECT_EQ(Get("files.img"), files);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/" + kPtyOriginalsDir));

  Put("tty-info.img", "garbage");
  EXPECT_EQ(RenumberPtys(dir_, {0}).status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(PtyImagesTest, OriginalsLeftByAnInterruptedRestoreArePutBackFirst) {
  WriteTree();
  const std::string info = Get("tty-info.img");
  ASSERT_TRUE(RenumberPtys(dir_, {0}).ok());
  ASSERT_NE(Get("tty-info.img"), info);
  // No PutBack (the migrator died during the restore): the next restore
  // starts from the originals, and plans from them.
  absl::StatusOr<std::map<uint32_t, uint32_t>> moved = RenumberPtys(dir_, {1});
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(*moved, (std::map<uint32_t, uint32_t>{{1, 2}}));
  ASSERT_TRUE(PutBackPtyImages(dir_).ok());
  EXPECT_EQ(Get("tty-info.img"), info);
}

TEST_F(PtyImagesTest, PtysInUseReadsTheNumericEntriesOfDevpts) {
  std::filesystem::create_directories(dir_ + "/pts");
  for (const char* name : {"0", "3", "12", "ptmx"}) Put(std::string("pts/") + name, "");
  EXPECT_EQ(PtysInUse(dir_ + "/pts"), (std::set<uint32_t>{0, 3, 12}));
  EXPECT_TRUE(PtysInUse(dir_ + "/none").empty());
}

// pstree.img as CRIU 3.17 writes it (PSTREE_MAGIC; PstreeEntry: pid 1,
// ppid 2, pgid 3, sid 4, threads 5): the tree's pids, root first; one
// without a pid, or no pstree.img, is DATA_LOSS.
TEST_F(PtyImagesTest, DumpedTreePidsReadsThePidOfEachProcessOfTheTree) {
  constexpr uint32_t kPstreeMagic = 0x50273030;
  auto entry = [](uint32_t pid, uint32_t ppid, std::vector<uint32_t> threads) {
    std::string m;
    VarintField(&m, 1, pid);
    VarintField(&m, 2, ppid);
    VarintField(&m, 3, pid);
    VarintField(&m, 4, pid);
    for (uint32_t t : threads) VarintField(&m, 5, t);
    return m;
  };
  EXPECT_EQ(DumpedTreePids(dir_).status().code(), absl::StatusCode::kDataLoss);
  Put("pstree.img", Image(kPstreeMagic, {entry(100774, 1, {100774}),
                                         entry(100775, 100774, {100775, 100776, 100777})}));
  absl::StatusOr<std::vector<pid_t>> pids = DumpedTreePids(dir_);
  ASSERT_TRUE(pids.ok()) << pids.status();
  EXPECT_EQ(*pids, (std::vector<pid_t>{100774, 100775}));
  std::string no_pid;
  VarintField(&no_pid, 2, 1);
  Put("pstree.img", Image(kPstreeMagic, {entry(100774, 1, {}), no_pid}));
  EXPECT_EQ(DumpedTreePids(dir_).status().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace rdmavirt::migrator
