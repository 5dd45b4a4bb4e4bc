// DirtyPages: after a release, every page of writable registered
// memory is written once through the process's own mapping, so a dump that
// tracks soft-dirty bits copies what the HCA wrote there. Checked on the
// kernel's own record: /proc/self/pagemap's soft-dirty bit, after
// /proc/self/clear_refs cleared it.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "shim/shim.h"

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

TEST(DirtyPagesTest, EveryWritablePageOfTheRangesIsMarkedAndNothingElse) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  constexpr int kPages = 8;
  uint8_t* mem = static_cast<uint8_t*>(
      mmap(nullptr, kPages * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(mem, MAP_FAILED);
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

}  // namespace
}  // namespace rdmavirt::shim
