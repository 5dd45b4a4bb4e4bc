// DirtyPages: after a release, every page of writable registered
// memory is written once through the process's own mapping, so a dump that
// tracks soft-dirty bits copies what the HCA wrote there. Checked on the
// kernel's own record: /proc/self/pagemap's soft-dirty bit, after
// /proc/self/clear_refs cleared it.
#include "shim/migration/dirty_pages.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "shim/core/shim.h"

namespace rdmavirt::shim {
namespace {

constexpr uint64_t kSoftDirty = uint64_t{1} << 55;

bool ClearSoftDirty() {
  const int fd = open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = write(fd, "4", 1) == 1;
  close(fd);
  return ok;
}

// The pagemap entry of the page at `p`, or 0.
uint64_t PagemapEntry(const void* p) {
  const int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  const long page = sysconf(_SC_PAGESIZE);
  uint64_t e = 0;
  const off_t off = static_cast<off_t>(reinterpret_cast<uintptr_t>(p) / page * sizeof(e));
  if (pread(fd, &e, sizeof(e), off) != sizeof(e)) e = 0;
  close(fd);
  return e;
}

// `n` private anonymous pages, or null.
uint8_t* AnonPages(size_t n) {
  void* p = mmap(nullptr, n * static_cast<size_t>(sysconf(_SC_PAGESIZE)), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

// Whether a cleared soft-dirty bit comes back with a plain write (to
// `scratch`, a writable page of the test's own); all bits cleared after.
bool KernelTracksSoftDirty(uint8_t* scratch) {
  if (!ClearSoftDirty() || (PagemapEntry(scratch) & kSoftDirty) != 0) return false;
  volatile uint8_t* v = scratch;  // a write the compiler keeps
  *v = *v;
  return (PagemapEntry(scratch) & kSoftDirty) != 0 && ClearSoftDirty();
}

TEST(DirtyPagesTest, EveryWritablePageOfTheRangesIsMarkedAndNothingElse) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  constexpr int kPages = 8;
  uint8_t* mem = AnonPages(kPages);
  ASSERT_NE(mem, nullptr);
  for (int i = 0; i < kPages; ++i) mem[i * page] = static_cast<uint8_t>(i + 1);
  // Page 6 read-only since: it must be skipped, not written (a fault would
  // kill the application).
  ASSERT_EQ(mprotect(mem + 6 * page, page, PROT_READ), 0);
  // The kernel tracks soft-dirty bits if a cleared one comes back with a
  // plain write (page 7, outside the range, written again below).
  const bool tracks = ClearSoftDirty() && (PagemapEntry(mem) & kSoftDirty) == 0 &&
                      (mem[7 * page] = 8, (PagemapEntry(mem + 7 * page) & kSoftDirty) != 0);
  if (!tracks || !ClearSoftDirty()) {
    munmap(mem, kPages * page);
    GTEST_SKIP() << "this kernel does not track soft-dirty bits";
  }
  // Registered: pages 1..6 (from the middle of page 1 to the middle of 6).
  const uintptr_t begin = reinterpret_cast<uintptr_t>(mem + page + 100);
  const uintptr_t end = reinterpret_cast<uintptr_t>(mem + 6 * page + 100);
  DirtyPages({{begin, end}});
  for (int i = 0; i < kPages; ++i) {
    const bool dirty = (PagemapEntry(mem + i * page) & kSoftDirty) != 0;
    EXPECT_EQ(dirty, i >= 1 && i <= 5) << "page " << i;
    EXPECT_EQ(mem[i * page], i + 1) << "page " << i << "'s contents changed";
  }
  munmap(mem, kPages * page);
}

// With the pages the destination holds from the pre-copy: those whose
// content is still what was sent are left alone, every other one (changed
// since, or never sent) is marked. The counts say so on any kernel; the
// soft-dirty bits where the kernel tracks them.
TEST(DirtyPagesTest, PagesTheDestinationHoldsUnchangedAreLeftAlone) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  constexpr int kPages = 6;
  uint8_t* mem = AnonPages(kPages);
  ASSERT_NE(mem, nullptr);
  for (int i = 0; i < kPages; ++i) memset(mem + i * page, 'a' + i, page);
  // Sent: pages 0..3, as they are now. Then the HCA (here: this test)
  // writes page 1 behind the pre-copy's back; pages 4 and 5 were never sent.
  std::vector<std::pair<uint64_t, PageDigest>> sent;
  for (int i = 0; i < 4; ++i)
    sent.emplace_back(reinterpret_cast<uintptr_t>(mem + i * page), DigestOf(mem + i * page, page));
  std::string addrs, digests;
  EncodeKnownPages(sent, &addrs, &digests);
  KnownPages known;
  ASSERT_TRUE(known.Decode(addrs, digests));
  mem[page + 17] = 'z';
  const bool tracks = KernelTracksSoftDirty(mem + 5 * page);
  DirtyCount count;
  DirtyPages({{reinterpret_cast<uintptr_t>(mem), reinterpret_cast<uintptr_t>(mem + kPages * page)}},
             known, &count);
  EXPECT_EQ(count.unchanged, 3u) << "pages 0, 2 and 3";
  EXPECT_EQ(count.marked, 3u) << "page 1 (changed), 4 and 5 (never sent)";
  EXPECT_EQ(mem[page + 17], 'z');
  EXPECT_EQ(mem[4 * page], 'e');
  for (int i = 0; tracks && i < kPages; ++i)
    EXPECT_EQ((PagemapEntry(mem + i * page) & kSoftDirty) != 0, i == 1 || i >= 4) << "page " << i;
  munmap(mem, kPages * page);
  // The counts were checked; the bits could not be.
  if (!tracks) GTEST_SKIP() << "this kernel does not track soft-dirty bits";
}

// Whether /proc/self/smaps says the mapping holding `p` is locked.
bool Locked(const void* p) {
  FILE* f = fopen("/proc/self/smaps", "re");
  if (f == nullptr) return false;
  const auto a = reinterpret_cast<uintptr_t>(p);
  bool in = false, locked = false;
  char line[512];
  while (fgets(line, sizeof line, f) != nullptr) {
    unsigned long lo = 0, hi = 0;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
      in = a >= lo && a < hi;
      continue;
    }
    if (in && strncmp(line, "VmFlags:", 8) == 0) locked = strstr(line, " lo") != nullptr;
  }
  fclose(f);
  return locked;
}

// A post-copy's release locks registered memory so that CRIU dumps it with
// the images rather than as lazy pages;
// what the application locked itself is neither locked again nor listed
// (the restore unlocks only what is listed).
TEST(LockUnlockedTest, LocksTheRangesButWhatTheApplicationLockedItself) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  uint8_t* mine = AnonPages(4);
  uint8_t* apps = AnonPages(2);
  ASSERT_NE(mine, nullptr);
  ASSERT_NE(apps, nullptr);
  // mlock2: the sanitizers make mlock a no-op.
  if (mlock2(apps, 2 * page, 0) != 0) GTEST_SKIP() << "mlock refused here (RLIMIT_MEMLOCK)";
  // Two pages of `mine` from the middle of a page on, and all of `apps`.
  const uintptr_t from = reinterpret_cast<uintptr_t>(mine) + page + 100;
  const std::vector<std::pair<uintptr_t, uintptr_t>> locked = LockUnlocked(
      {{from, from + page},
       {reinterpret_cast<uintptr_t>(apps), reinterpret_cast<uintptr_t>(apps) + 2 * page}});
  // What was locked, page by page (a range may span two mappings): the
  // two pages of `mine` that the range touches, nothing of `apps`.
  size_t pages = 0;
  for (const auto& [b, e] : locked) {
    EXPECT_GE(b, reinterpret_cast<uintptr_t>(mine) + page);
    EXPECT_LE(e, reinterpret_cast<uintptr_t>(mine) + 3 * page);
    pages += (e - b) / page;
  }
  EXPECT_EQ(pages, 2u);
  EXPECT_TRUE(Locked(mine + page));
  EXPECT_TRUE(Locked(mine + 2 * page));
  EXPECT_FALSE(Locked(mine));
  EXPECT_FALSE(Locked(mine + 3 * page));
  EXPECT_TRUE(Locked(apps));
  munlock(mine, 4 * page);
  munlock(apps, 2 * page);
  munmap(mine, 4 * page);
  munmap(apps, 2 * page);
}

// Locking leaves the pages' soft-dirty bits alone: a populating mlock
// writes to every page of a writable range, and CRIU then dumped all the
// registered memory again although the pre-copy held it unchanged.
TEST(LockUnlockedTest, LockingDirtiesNoPage) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  uint8_t* scratch = AnonPages(1);
  uint8_t* mem = AnonPages(4);
  ASSERT_NE(scratch, nullptr);
  ASSERT_NE(mem, nullptr);
  memset(mem, 7, 4 * page);  // present, as registered memory is
  if (!KernelTracksSoftDirty(scratch)) GTEST_SKIP() << "no soft-dirty tracking here";
  const uintptr_t a = reinterpret_cast<uintptr_t>(mem);
  const std::vector<std::pair<uintptr_t, uintptr_t>> locked = LockUnlocked({{a, a + 4 * page}});
  if (locked.empty()) GTEST_SKIP() << "mlock refused here (RLIMIT_MEMLOCK)";
  EXPECT_TRUE(Locked(mem));
  for (size_t i = 0; i < 4; ++i)
    EXPECT_EQ(PagemapEntry(mem + i * page) & kSoftDirty, 0u) << "page " << i;
  munlock(mem, 4 * page);
  munmap(mem, 4 * page);
  munmap(scratch, page);
}

}  // namespace
}  // namespace rdmavirt::shim
