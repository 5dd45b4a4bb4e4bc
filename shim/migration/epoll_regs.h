// The application's epoll registrations of fds the shim re-creates.
//
// A release closes the device's async fd and the completion channels' fds
// (the dump must not hold them); closing an fd drops it from every epoll
// set, so after the restore the fds are back under their numbers
// (KeepFdNumber) but in no epoll set: a program that waits for completion
// events with epoll (UCX's async thread, event loops) would never be woken,
// and its epoll_ctl(DEL) at teardown fails. So the release reads where the
// fds are registered, from /proc/self/fdinfo of every epoll fd, and the
// restore adds them again with the same events and data.
//
// Called by the step that releases or restores, while the application's
// verbs wait; reads /proc, so not on the data path.
#ifndef RDMAVIRT_SHIM_MIGRATION_EPOLL_REGS_H_
#define RDMAVIRT_SHIM_MIGRATION_EPOLL_REGS_H_

#include <cstdint>
#include <vector>

namespace rdmavirt::shim {

struct EpollRegistration {
  int epfd = -1;
  int fd = -1;
  uint32_t events = 0;  // as given to epoll_ctl, EPOLLET and the like included
  uint64_t data = 0;
};

// Every registration of one of `fds` in this process's epoll sets; empty
// if /proc/self is unreadable.
std::vector<EpollRegistration> FindEpollRegistrations(const std::vector<int>& fds);

// Adds each registration again (EEXIST counts as done); how many failed.
int Reregister(const std::vector<EpollRegistration>& regs);

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_MIGRATION_EPOLL_REGS_H_
