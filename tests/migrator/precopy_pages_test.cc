// PrecopyPages: the digests of the pages a pre-copy sent, read from CRIU's
// pagemap and pages images as CRIU 3.17 writes them (magic.h,
// pagemap.proto), and their wire form for the release.
#include "migrator/move/precopy_pages.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/migrator/criu_image_bytes.h"

namespace rdmavirt::migrator {
namespace {

using image_bytes::Le32;
using image_bytes::Message;
using image_bytes::Varint;

constexpr uint64_t kPage = 4096;
constexpr uint32_t kParent = 1, kLazy = 2, kPresent = 4;


struct PageRun {
  uint64_t vaddr;
  uint32_t nr;
  uint32_t flags;  // 0: the old form, without flags (in_parent false)
};

std::string Page(char c) { return std::string(kPage, c); }

class PrecopyPagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/precopy-pages-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A pre-dump of process 42 in DIR/NAME: its pagemap and its pages.
  std::string Write(const std::string& name, const std::vector<PageRun>& runs,
                    const std::string& pages) {
    const std::string d = dir_ + "/" + name;
    std::filesystem::create_directories(d);
    std::string map;
    Le32(&map, 0x54564319);
    Le32(&map, 0x56084025);
    std::string head;
    Varint(&head, 1 << 3);
    Varint(&head, 7);  // pages_id
    Message(&map, head);
    for (const PageRun& r : runs) {
      std::string e;
      Varint(&e, 1 << 3);
      Varint(&e, r.vaddr);
      Varint(&e, 2 << 3);
      Varint(&e, r.nr);
      if (r.flags != 0) {
        Varint(&e, 4 << 3);
        Varint(&e, r.flags);
      }
      Message(&map, e);
    }
    std::ofstream(d + "/pagemap-42.img", std::ios::binary) << map;
    std::ofstream(d + "/pages-7.img", std::ios::binary) << pages;
    return d;
  }

  static shim::KnownPages Known(const PrecopyPages& p) {
    std::string addrs, digests;
    p.Encode({{0, ~uint64_t{0} >> 1}}, 1000, &addrs, &digests);
    shim::KnownPages k;
    EXPECT_TRUE(k.Decode(addrs, digests));
    return k;
  }
  std::string dir_;
};

TEST_F(PrecopyPagesTest, EachPageHasTheDigestOfItsLatestImage) {
  PrecopyPages p;
  // Round 1: 0x10000 and 0x11000 (one run), 0x20000 (the old form).
  ASSERT_TRUE(p.AddPreDump(Write("pre-1", {{0x10000, 2, kPresent}, {0x20000, 1, 0}},
                                 Page('a') + Page('b') + Page('c')),
                           42, kPage)
                  .ok());
  // Round 2: 0x10000 unchanged (in the parent), 0x11000 rewritten (CRIU
  // flags private anonymous pages lazy as well as present).
  ASSERT_TRUE(
      p.AddPreDump(
           Write("pre-2",
                 {{0x10000, 1, kParent}, {0x11000, 1, kPresent | kLazy}, {0x40000, 1, kLazy}},
                 Page('B')),
           42, kPage)
          .ok());
  EXPECT_EQ(p.size(), 3u);
  shim::KnownPages k = Known(p);
  const std::string a = Page('a'), b = Page('b'), nb = Page('B'), c = Page('c');
  EXPECT_TRUE(k.Unchanged(0x10000, a.data(), kPage));
  EXPECT_TRUE(k.Unchanged(0x11000, nb.data(), kPage)) << "round 2's content";
  EXPECT_FALSE(k.Unchanged(0x11000, b.data(), kPage)) << "round 1's, replaced";
  EXPECT_TRUE(k.Unchanged(0x20000, c.data(), kPage));
  EXPECT_FALSE(k.Unchanged(0x12000, a.data(), kPage)) << "never sent";

  // Only the pages that overlap the registered ranges go (the end of one
  // range inside 0x11000, and a second registration of the same page).
  std::string addrs, digests;
  p.Encode({{0x10800, 0x11001}, {0x11000, 0x11800}}, 1000, &addrs, &digests);
  shim::KnownPages two;
  ASSERT_TRUE(two.Decode(addrs, digests));
  EXPECT_EQ(two.size(), 2u);
  EXPECT_TRUE(two.Unchanged(0x10000, a.data(), kPage));
  EXPECT_FALSE(two.Unchanged(0x20000, c.data(), kPage)) << "outside the ranges";
  // Over the limit: nothing is sent (every registered page is marked).
  p.Encode({{0x10000, 0x30000}}, 2, &addrs, &digests);
  EXPECT_TRUE(addrs.empty() && digests.empty());
}

TEST_F(PrecopyPagesTest, AnUnreadableRoundForgetsEverything) {
  PrecopyPages p;
  ASSERT_TRUE(p.AddPreDump(Write("pre-1", {{0x10000, 1, kPresent}}, Page('a')), 42, kPage).ok());
  // Pages shorter than the pagemap says: nothing of any round is believed.
  absl::Status st = p.AddPreDump(Write("pre-2", {{0x30000, 2, kPresent}}, Page('x')), 42, kPage);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_TRUE(p.failed());
  std::string addrs, digests;
  p.Encode({{0x10000, 0x11000}}, 1000, &addrs, &digests);
  EXPECT_TRUE(addrs.empty());
  // And later rounds add nothing.
  EXPECT_FALSE(p.AddPreDump(Write("pre-3", {{0x10000, 1, kPresent}}, Page('a')), 42, kPage).ok());
  EXPECT_EQ(p.size(), 0u);

  PrecopyPages q;
  EXPECT_EQ(q.AddPreDump(dir_ + "/pre-1", 43, kPage).code(), absl::StatusCode::kNotFound)
      << "no pagemap for that pid";
  PrecopyPages r;
  std::ofstream(dir_ + "/pre-1/pagemap-42.img", std::ios::binary) << "not an image";
  EXPECT_EQ(r.AddPreDump(dir_ + "/pre-1", 42, kPage).code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace rdmavirt::migrator
