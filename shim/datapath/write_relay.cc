#include "shim/datapath/write_relay.h"

#include <fcntl.h>
#include <linux/capability.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

namespace rdmavirt::shim {

namespace {

std::atomic<WriteRelay*> g_relays[kMaxRelays];
std::atomic<uint64_t> g_generations{0};

// A thread's cached verdict: whether its identity matched the opener's of
// the relay of that generation. Credentials are read once per thread and
// relay, not at every doorbell.
thread_local uint64_t t_checked_generation = 0;
thread_local bool t_same = false;

}  // namespace

ThreadIdentity ThreadIdentity::OfThisThread() {
  // Raw system calls: each reads the calling thread's credentials (glibc's
  // set* wrappers act on every thread; these getters do not, but say so).
  ThreadIdentity id;
  bool ok = syscall(SYS_getresuid, &id.uid[0], &id.uid[1], &id.uid[2]) == 0 &&
            syscall(SYS_getresgid, &id.gid[0], &id.gid[1], &id.gid[2]) == 0;
  id.uid[3] = static_cast<uint32_t>(syscall(SYS_setfsuid, -1));
  id.gid[3] = static_cast<uint32_t>(syscall(SYS_setfsgid, -1));
  const long n = syscall(SYS_getgroups, 64, id.groups);
  ok = ok && n >= 0;
  id.ngroups = n > 0 ? static_cast<uint32_t>(n) : 0;
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  ok = ok && syscall(SYS_capget, &hdr, data) == 0;
  for (int i = 0; i < 2; ++i) {
    id.caps[3 * i] = data[i].effective;
    id.caps[3 * i + 1] = data[i].permitted;
    id.caps[3 * i + 2] = data[i].inheritable;
  }
  id.securebits = prctl(PR_GET_SECUREBITS, 0, 0, 0, 0);
  id.complete = ok && id.securebits >= 0;
  return id;
}

bool ThreadIdentity::Same(const ThreadIdentity& o) const {
  return complete && o.complete && std::memcmp(uid, o.uid, sizeof(uid)) == 0 &&
         std::memcmp(gid, o.gid, sizeof(gid)) == 0 && ngroups == o.ngroups &&
         std::memcmp(groups, o.groups, ngroups * sizeof(groups[0])) == 0 &&
         std::memcmp(caps, o.caps, sizeof(caps)) == 0 && securebits == o.securebits;
}

// One submission queue entry and one completion at a time: the smallest
// ring, mapped as the kernel lays it out (io_uring_setup(2)).
struct WriteRelay::Ring {
  int fd = -1;
  uint16_t personality = 0;
  void* sq_map = MAP_FAILED;
  size_t sq_bytes = 0;
  void* cq_map = MAP_FAILED;  // == sq_map with IORING_FEAT_SINGLE_MMAP
  size_t cq_bytes = 0;
  io_uring_sqe* sqes = static_cast<io_uring_sqe*>(MAP_FAILED);
  size_t sqe_bytes = 0;
  unsigned* sq_tail = nullptr;
  unsigned* sq_mask = nullptr;
  unsigned* sq_array = nullptr;
  unsigned* cq_head = nullptr;
  unsigned* cq_tail = nullptr;
  unsigned* cq_mask = nullptr;
  io_uring_cqe* cqes = nullptr;

  ~Ring() {
    if (sqes != MAP_FAILED) munmap(sqes, sqe_bytes);
    if (cq_map != MAP_FAILED && cq_map != sq_map) munmap(cq_map, cq_bytes);
    if (sq_map != MAP_FAILED) munmap(sq_map, sq_bytes);
    if (fd >= 0) close(fd);
  }

  bool Open(std::string* why) {
    io_uring_params p{};
    fd = static_cast<int>(syscall(SYS_io_uring_setup, 2, &p));
    if (fd < 0) return Fail("io_uring_setup", why);
    sq_bytes = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_bytes = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) sq_bytes = cq_bytes = std::max(sq_bytes, cq_bytes);
    sq_map = mmap(nullptr, sq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                  IORING_OFF_SQ_RING);
    if (sq_map == MAP_FAILED) return Fail("mapping io_uring's submission ring", why);
    cq_map = single ? sq_map
                    : mmap(nullptr, cq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                           IORING_OFF_CQ_RING);
    if (cq_map == MAP_FAILED) return Fail("mapping io_uring's completion ring", why);
    sqe_bytes = p.sq_entries * sizeof(io_uring_sqe);
    sqes = static_cast<io_uring_sqe*>(mmap(nullptr, sqe_bytes, PROT_READ | PROT_WRITE,
                                           MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES));
    if (sqes == MAP_FAILED) return Fail("mapping io_uring's entries", why);
    auto* sq = static_cast<char*>(sq_map);
    auto* cq = static_cast<char*>(cq_map);
    sq_tail = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask = reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    cq_head = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask = reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    // The calling thread's credentials, the very object, kept by the ring.
    const long id = syscall(SYS_io_uring_register, fd, IORING_REGISTER_PERSONALITY, nullptr, 0);
    if (id < 0) return Fail("registering an io_uring personality", why);
    personality = static_cast<uint16_t>(id);
    return true;
  }

  // One write, waited for; its result as write(2) gives it.
  ssize_t Write(int target, const void* buf, size_t n) {
    const unsigned tail = *sq_tail;
    const unsigned index = tail & *sq_mask;
    io_uring_sqe* sqe = &sqes[index];
    std::memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = IORING_OP_WRITE;
    sqe->fd = target;
    sqe->addr = reinterpret_cast<uintptr_t>(buf);
    sqe->len = static_cast<uint32_t>(n);
    sqe->off = 0;  // a character device: the position is not used
    sqe->personality = personality;
    sq_array[index] = index;
    __atomic_store_n(sq_tail, tail + 1, __ATOMIC_RELEASE);
    long rc;
    do {
      rc = syscall(SYS_io_uring_enter, fd, 1, 1, IORING_ENTER_GETEVENTS, nullptr, 0);
    } while (rc < 0 && errno == EINTR);
    if (rc < 0) return -1;
    unsigned head = *cq_head;
    while (head == __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE)) {
      rc = syscall(SYS_io_uring_enter, fd, 0, 1, IORING_ENTER_GETEVENTS, nullptr, 0);
      if (rc < 0 && errno != EINTR) return -1;
    }
    const int res = cqes[head & *cq_mask].res;
    __atomic_store_n(cq_head, head + 1, __ATOMIC_RELEASE);
    if (res < 0) {
      errno = -res;
      return -1;
    }
    return res;
  }

  static bool Fail(const char* what, std::string* why) {
    *why = std::string(what) + ": " + std::strerror(errno);
    return false;
  }
};

std::unique_ptr<WriteRelay> WriteRelay::Create(int fd, std::string* why) {
  auto ring = std::make_unique<Ring>();
  if (!ring->Open(why)) return nullptr;
  // io_uring first tries a write without blocking and, for a file that
  // does not promise to honour that, hands it to a worker thread of the
  // process (one more thread a dump would find). ib_uverbs never blocks a
  // write and ignores O_NONBLOCK, so the flag keeps the write inline.
  const int flags = fcntl(fd, F_GETFL);
  if (flags >= 0 && !(flags & O_NONBLOCK)) fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  return std::unique_ptr<WriteRelay>(
      new WriteRelay(fd, std::move(ring), ThreadIdentity::OfThisThread()));
}

WriteRelay::WriteRelay(int fd, std::unique_ptr<Ring> ring, const ThreadIdentity& opener)
    : fd_(fd), ring_(std::move(ring)), opener_(opener), generation_(++g_generations) {}

WriteRelay::~WriteRelay() = default;

bool WriteRelay::SameAsOpener() {
  if (t_checked_generation != generation_) {
    t_same = ThreadIdentity::OfThisThread().Same(opener_);
    t_checked_generation = generation_;
  }
  return t_same;
}

ssize_t WriteRelay::Write(const void* buf, size_t n) {
  if (!SameAsOpener()) {
    errno = EACCES;
    return -1;
  }
  MutexLock lock(&mu_);
  return ring_->Write(fd_, buf, n);
}

bool PublishRelay(WriteRelay* relay) {
  for (auto& slot : g_relays) {
    WriteRelay* empty = nullptr;
    if (slot.compare_exchange_strong(empty, relay)) return true;
  }
  return false;
}

void WithdrawRelay(WriteRelay* relay) {
  for (auto& slot : g_relays) {
    WriteRelay* expected = relay;
    if (slot.compare_exchange_strong(expected, nullptr)) return;
  }
}

ssize_t RelayRefusedWrite(int fd, const void* buf, size_t n) {
  for (auto& slot : g_relays) {
    WriteRelay* relay = slot.load(std::memory_order_acquire);
    if (relay != nullptr && relay->fd() == fd) return relay->Write(buf, n);
  }
  errno = EACCES;
  return -1;
}

}  // namespace rdmavirt::shim
