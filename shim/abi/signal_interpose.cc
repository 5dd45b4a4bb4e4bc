// The shim's sigprocmask() and pthread_sigmask(): libc's, except that
// once the thread probe is installed (thread_probe.h) its signal never
// enters a thread's mask, so that a pause can ask every thread where it
// is. Programs that block every signal in their worker threads (to take
// signals on one thread, or with signalfd) are the common case; the
// probe's handler answers and returns, so they see nothing of it. The old
// mask a call reports is the thread's real one.
//
// The probe is installed when the library is loaded, before the program
// runs (unless RDMAVIRT_MIGRATE=0 or RDMAVIRT_PAUSE=marks), and its
// signal opened in the first thread: a mask set before the first verbs
// call, or inherited across exec, would otherwise be every thread's.
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <string>

#include "shim/abi/libc_dl.h"
#include "shim/datapath/thread_probe.h"

namespace {

using MaskFn = int (*)(int, const sigset_t*, sigset_t*);

// Resolved at load (below), not in a handler that may call these first.
MaskFn g_pthread_sigmask = nullptr;
MaskFn g_sigprocmask = nullptr;

MaskFn Real(const char* name) {
  const rdmavirt::shim::LibcDl& libc = rdmavirt::shim::Libc();
  return libc.dlsym != nullptr ? reinterpret_cast<MaskFn>(libc.dlsym(RTLD_NEXT, name)) : nullptr;
}

// The system call itself, if libc's could not be found.
int RawMask(int how, const sigset_t* set, sigset_t* old) {
  return static_cast<int>(syscall(SYS_rt_sigprocmask, how, set, old, _NSIG / 8));
}

// `set` without the probe's signal, in `copy`, when it would block it.
const sigset_t* Open(int how, const sigset_t* set, sigset_t* copy) {
  const int sig = rdmavirt::shim::ThreadProbeSignal();
  if (set == nullptr || sig == 0 || how == SIG_UNBLOCK || sigismember(set, sig) != 1) return set;
  *copy = *set;
  sigdelset(copy, sig);
  return copy;
}

bool EnvIs(const char* name, const char* value) {
  const char* v = getenv(name);
  return v != nullptr && strcmp(v, value) == 0;
}

__attribute__((constructor)) void InstallAtLoad() {
  g_pthread_sigmask = Real("pthread_sigmask");
  g_sigprocmask = Real("sigprocmask");
  if (EnvIs("RDMAVIRT_MIGRATE", "0") || EnvIs("RDMAVIRT_PAUSE", "marks")) return;
  std::string why;  // said by the shim once it starts (Shim::Process)
  if (!rdmavirt::shim::InstallThreadProbe(&why)) return;
  sigset_t probe;
  sigemptyset(&probe);
  sigaddset(&probe, rdmavirt::shim::ThreadProbeSignal());
  if (g_pthread_sigmask != nullptr)
    g_pthread_sigmask(SIG_UNBLOCK, &probe, nullptr);
  else
    RawMask(SIG_UNBLOCK, &probe, nullptr);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int pthread_sigmask(int how, const sigset_t* set,
                                                                      sigset_t* old) {
  sigset_t copy;
  const sigset_t* s = Open(how, set, &copy);
  if (g_pthread_sigmask != nullptr) return g_pthread_sigmask(how, s, old);
  return RawMask(how, s, old) == 0 ? 0 : errno;
}

extern "C" __attribute__((visibility("default"))) int sigprocmask(int how, const sigset_t* set,
                                                                  sigset_t* old) {
  sigset_t copy;
  const sigset_t* s = Open(how, set, &copy);
  if (g_sigprocmask != nullptr) return g_sigprocmask(how, s, old);
  return RawMask(how, s, old);
}
