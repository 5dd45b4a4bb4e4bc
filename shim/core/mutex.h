// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable
// with clang's thread-safety annotations (absl/base/thread_annotations.h,
// macros only: the shim links no absl), so that -Wthread-safety checks
// what the shim's shared tables say of their locks. libstdc++'s own carry
// none.
//
// The same cost as the standard types they wrap: every member is inline
// and forwards to them. Any thread; nothing fails (std::mutex::lock's
// system_error cannot be thrown with -fno-exceptions: it would abort, as
// the bare std::mutex would).
#ifndef RDMAVIRT_SHIM_CORE_MUTEX_H_
#define RDMAVIRT_SHIM_CORE_MUTEX_H_

#include <absl/base/thread_annotations.h>

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace rdmavirt::shim {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // Tells the analysis this thread holds the mutex where it cannot see
  // the lock taken (a caller's scope it does not follow); checks nothing.
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` for its scope.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable whose waits take the Mutex the caller holds: it is
// released while waiting and held again on return, as with
// std::condition_variable.
class CondVar {
 public:
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  template <typename Predicate>
  void Wait(Mutex* mu, Predicate done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock, done);
    lock.release();
  }
  // False if `timeout` passed with `done` still false.
  template <typename Rep, typename Period, typename Predicate>
  bool WaitFor(Mutex* mu, std::chrono::duration<Rep, Period> timeout, Predicate done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool met = cv_.wait_for(lock, timeout, done);
    lock.release();
    return met;
  }
  void NotifyAll() { cv_.notify_all(); }
  void NotifyOne() { cv_.notify_one(); }

 private:
  std::condition_variable cv_;
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CORE_MUTEX_H_
