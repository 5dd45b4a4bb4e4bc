// The shim's write(): libc's, except that a write the kernel refused with
// EACCES goes to the write relay (write_relay.h), which carries it out if
// the fd is a re-opened RDMA device's and the calling thread's identity is
// the opener's, and one refused with EINVAL goes to the CM layer (cm.h),
// which carries it out if the fd is a virtual RDMA CM channel's (an epoll
// fd, which the kernel refuses every write). A write that succeeds, or
// fails otherwise, costs one call more than libc's; the shim adds nothing
// else to it.
#include <errno.h>
#include <unistd.h>

#include "shim/cm/channels.h"
#include "shim/datapath/write_relay.h"

// libc's own write, under the name glibc exports beside "write".
extern "C" ssize_t __write(int fd, const void* buf, size_t n);

extern "C" __attribute__((visibility("default"))) ssize_t write(int fd, const void* buf, size_t n) {
  const ssize_t rc = __write(fd, buf, n);
  if (rc >= 0) return rc;
  const int err = errno;
  if (err == EACCES) return rdmavirt::shim::RelayRefusedWrite(fd, buf, n);
  if (err == EINVAL && rdmavirt::shim::CmIsChannel(fd)) return rdmavirt::shim::CmWrite(fd, buf, n);
  errno = err;
  return rc;
}
