#include "shim/migration/epoll_regs.h"

#include <dirent.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace rdmavirt::shim {

namespace {

bool IsEpoll(int fd) {
  char link[64];
  char target[64] = {};
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, target, sizeof target - 1);
  return n > 0 && std::strcmp(target, "anon_inode:[eventpoll]") == 0;
}

// The lines "tfd: N events: X data: Y ..." of one epoll fd's fdinfo.
void ReadRegistrations(int epfd, const std::vector<int>& fds, std::vector<EpollRegistration>* out) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/fdinfo/%d", epfd);
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return;
  char line[256];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    int tfd = -1;
    unsigned events = 0;
    unsigned long long data = 0;
    if (std::sscanf(line, "tfd: %d events: %x data: %llx", &tfd, &events, &data) != 3) continue;
    if (std::find(fds.begin(), fds.end(), tfd) == fds.end()) continue;
    out->push_back({epfd, tfd, events, static_cast<uint64_t>(data)});
  }
  std::fclose(f);
}

}  // namespace

std::vector<EpollRegistration> FindEpollRegistrations(const std::vector<int>& fds) {
  std::vector<EpollRegistration> out;
  if (fds.empty()) return out;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return out;
  std::vector<int> epfds;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    if (IsEpoll(static_cast<int>(fd))) epfds.push_back(static_cast<int>(fd));
  }
  closedir(dir);
  for (int epfd : epfds) ReadRegistrations(epfd, fds, &out);
  return out;
}

int Reregister(const std::vector<EpollRegistration>& regs) {
  int failed = 0;
  for (const EpollRegistration& r : regs) {
    epoll_event ev{};
    ev.events = r.events;
    ev.data.u64 = r.data;
    if (epoll_ctl(r.epfd, EPOLL_CTL_ADD, r.fd, &ev) != 0 && errno != EEXIST) ++failed;
  }
  return failed;
}

}  // namespace rdmavirt::shim
