// ScopedFd: a file descriptor closed when it goes out of scope. Movable,
// not copyable; -1 holds nothing.
#ifndef RDMAVIRT_MIGRATOR_HOST_SCOPED_FD_H_
#define RDMAVIRT_MIGRATOR_HOST_SCOPED_FD_H_

#include <unistd.h>

#include <utility>

namespace rdmavirt::migrator {

class ScopedFd {
 public:
  explicit ScopedFd(int fd = -1) : fd_(fd) {}
  ScopedFd(ScopedFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_HOST_SCOPED_FD_H_
