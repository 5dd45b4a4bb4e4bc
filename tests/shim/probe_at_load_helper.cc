// Run under LD_PRELOAD=librdmavirt.so by probe_at_load_test.cc: for each
// signal number given, says whether it has a handler and whether the
// main thread and a thread the main thread creates afterwards block it.
// With --block-all, the main thread first blocks every signal through
// pthread_sigmask, as programs that take signals on one thread do.
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

// The thread's mask, read by the system call (not through any interposer).
sigset_t Mask() {
  sigset_t m;
  sigemptyset(&m);
  syscall(SYS_rt_sigprocmask, SIG_BLOCK, nullptr, &m, _NSIG / 8);
  return m;
}

void* ThreadMask(void* out) {
  *static_cast<sigset_t*>(out) = Mask();
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  int first = 1;
  if (argc > 1 && strcmp(argv[1], "--block-all") == 0) {
    sigset_t all;
    sigfillset(&all);
    if (pthread_sigmask(SIG_BLOCK, &all, nullptr) != 0) return 2;
    first = 2;
  }
  const sigset_t main_mask = Mask();
  sigset_t thread_mask;
  pthread_t t;
  if (pthread_create(&t, nullptr, ThreadMask, &thread_mask) != 0 || pthread_join(t, nullptr) != 0)
    return 2;
  for (int i = first; i < argc; ++i) {
    const int sig = atoi(argv[i]);
    struct sigaction sa;
    if (sigaction(sig, nullptr, &sa) != 0) return 2;
    const bool handled =
        (sa.sa_flags & SA_SIGINFO) ? sa.sa_sigaction != nullptr : sa.sa_handler != SIG_DFL;
    printf("%d handled=%d main_blocked=%d thread_blocked=%d\n", sig, handled ? 1 : 0,
           sigismember(&main_mask, sig), sigismember(&thread_mask, sig));
  }
  return 0;
}
