// Writes on a re-opened RDMA device's command fd from threads the kernel
// would refuse.
//
// ib_uverbs refuses write() (ib_safe_file_access: "changed security
// contexts after opening file descriptor") from a thread whose credentials
// are not the very object the file was opened with. The threads of a
// process share one object until one of them changes its credentials; CRIU
// restores each thread's with calls of its own (setresuid, capset, ...), so
// in a restored process every thread holds an object of its own, equal in
// value to the others. Providers that ring the doorbell with write() (rxe)
// could then post only from the thread that re-opened the device: any other
// got EACCES.
//
// A WriteRelay, made on the thread that opened the device right after the
// open, holds an io_uring with that thread's credentials registered as a
// personality: a write submitted with it runs under the very object the
// file knows. The shim's write() (verbs_api.cc) hands it a write the kernel
// refused with EACCES on a device fd that has a relay; the relay carries it
// out only for a thread whose credentials equal the opener's in value (ids,
// groups, capabilities, securebits), so a thread that really changed its
// identity stays refused, as the kernel means it to be. The success path
// costs nothing: the relay runs only after a refusal (a non-opening thread
// then pays one refused write and one io_uring_enter per doorbell).
//
// The ring is an fd and two mappings that CRIU cannot dump: a relay lives
// from a restore to the next release (or the device's close).
//
// Thread-safety: Write may be called from any thread at once (one ring,
// behind a mutex). Publish and Withdraw run while no verb is in flight on
// the device (a restore or release step, the device's close).
#ifndef RDMAVIRT_SHIM_DATAPATH_WRITE_RELAY_H_
#define RDMAVIRT_SHIM_DATAPATH_WRITE_RELAY_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "shim/core/mutex.h"

namespace rdmavirt::shim {

// A thread's credentials by value, read with per-thread system calls.
struct ThreadIdentity {
  uint32_t uid[4] = {};  // real, effective, saved, fs
  uint32_t gid[4] = {};
  uint32_t ngroups = 0;
  uint32_t groups[64] = {};
  uint32_t caps[6] = {};  // effective, permitted, inheritable; 2 words each
  int securebits = 0;
  bool complete = false;  // every part could be read (at most 64 groups)

  static ThreadIdentity OfThisThread();
  // Equal and both complete.
  bool Same(const ThreadIdentity& o) const;
};

class WriteRelay {
 public:
  // On the thread that opened `fd`, before its credentials change. nullptr,
  // with why, if io_uring or its personalities are unavailable.
  static std::unique_ptr<WriteRelay> Create(int fd, std::string* why);
  ~WriteRelay();
  WriteRelay(const WriteRelay&) = delete;
  WriteRelay& operator=(const WriteRelay&) = delete;

  int fd() const { return fd_; }

  // write(fd, buf, n) under the opener's credentials: what write returns,
  // -1 with errno on failure; -1 with EACCES if the calling thread's
  // identity differs from the opener's.
  ssize_t Write(const void* buf, size_t n);

 private:
  struct Ring;
  WriteRelay(int fd, std::unique_ptr<Ring> ring, const ThreadIdentity& opener);
  bool SameAsOpener();

  const int fd_;
  const std::unique_ptr<Ring> ring_ ABSL_PT_GUARDED_BY(mu_);
  const ThreadIdentity opener_;
  const uint64_t generation_;  // tells a thread's cached verdict from another relay's
  Mutex mu_;                   // one submission at a time on the ring
};

// The process-wide table the interposed write() consults: at most
// kMaxRelays devices at once (a process opens one or two). Publish fails
// (false) when the table is full.
inline constexpr int kMaxRelays = 16;
bool PublishRelay(WriteRelay* relay);
void WithdrawRelay(WriteRelay* relay);

// After write(fd, buf, n) failed with EACCES: the relayed result if `fd`
// has a relay, else -1 with errno EACCES. Async-signal-safe as far as the
// table lookup goes; the relay itself takes a mutex.
ssize_t RelayRefusedWrite(int fd, const void* buf, size_t n);

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_DATAPATH_WRITE_RELAY_H_
