// Preloaded into Open MPI's orted (tools/lab/mpi.py): its openpty(3)
// fails, so that orted gives each rank's output a pipe instead of a
// pseudo-terminal (ORTE falls back to pipes when openpty fails). CRIU
// restores a pseudo-terminal only at the index it had, and the orted of
// the host a tree moves to has given out the same indexes to its own
// ranks; a pipe has no such number. docs/mpi.md says why.
#include <errno.h>
#include <pty.h>

extern "C" __attribute__((visibility("default"))) int openpty(int*, int*, char*,
                                                              const struct termios*,
                                                              const struct winsize*) {
  errno = ENOENT;
  return -1;
}
