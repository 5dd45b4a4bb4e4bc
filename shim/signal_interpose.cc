// The shim's sigprocmask() and pthread_sigmask(): libc's, except that
// once the thread probe is installed (thread_probe.h) its signal never
// enters a thread's mask, so that a pause can ask every thread where it
// is. Programs that block every signal in their worker threads (to take
// signals on one thread, or with signalfd) are the common case; the
// probe's handler answers and returns, so they see nothing of it. The old
// mask a call reports is the thread's real one.
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>

#include "shim/libc_dl.h"
#include "shim/thread_probe.h"

namespace {

using MaskFn = int (*)(int, const sigset_t*, sigset_t*);

MaskFn Real(const char* name) {
  const rdmavirt::shim::LibcDl& libc = rdmavirt::shim::Libc();
  return libc.dlsym != nullptr ? reinterpret_cast<MaskFn>(libc.dlsym(RTLD_NEXT, name)) : nullptr;
}

// `set` without the probe's signal, in `copy`, when it would block it.
const sigset_t* Open(int how, const sigset_t* set, sigset_t* copy) {
  const int sig = rdmavirt::shim::ThreadProbeSignal();
  if (set == nullptr || sig == 0 || how == SIG_UNBLOCK || sigismember(set, sig) != 1) return set;
  *copy = *set;
  sigdelset(copy, sig);
  return copy;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int pthread_sigmask(int how, const sigset_t* set,
                                                                      sigset_t* old) {
  static const MaskFn real = Real("pthread_sigmask");
  if (real == nullptr) return ENOSYS;
  sigset_t copy;
  return real(how, Open(how, set, &copy), old);
}

extern "C" __attribute__((visibility("default"))) int sigprocmask(int how, const sigset_t* set,
                                                                  sigset_t* old) {
  static const MaskFn real = Real("sigprocmask");
  if (real == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  sigset_t copy;
  return real(how, Open(how, set, &copy), old);
}
