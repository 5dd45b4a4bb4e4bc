// Where the application's threads are, asked of each thread by a signal:
// the half of the pause (pause.h) that lets a migratable process's posts
// and polls tail-call the provider with nothing to undo after the call.
//
// A post or poll on the probed path (data_path.cc) checks its object's
// path-and-pause word and jumps into the provider: no mark is raised, so
// the pause cannot read from memory whether a thread is still inside the
// provider's code. After setting the objects' pause flags (and the fence
// that makes every later check see them), the control thread asks each
// other thread instead: a signal whose handler unwinds the interrupted
// thread's own stack and answers "inside" when it finds a frame of a
// provider's library among its innermost frames (frames of libc,
// libibverbs, the dynamic loader, the vDSO and the shim are passed over:
// a provider's call goes through them; 8 frames of other code end the
// search), or a frame of the probed
// path's own functions (they have a section of their own: a thread there
// has passed its check, or is about to; a translating queue's call keeps
// that frame while it translates and calls the provider). A thread found outside cannot get in
// again: its next check sees the flag. A thread found inside is asked
// again until it has left.
//
// So that a signal interrupts nothing the application waits for, threads
// blocked in a system call no provider makes on its data path (poll,
// epoll_wait, nanosleep, read, accept, ...; /proc/self/task/TID/syscall)
// are outside without being asked: every system call such a wait could be
// interrupted in with EINTR is among them. The handler is installed with
// SA_RESTART, and the shim keeps its signal out of the masks the
// application sets (signal_interpose.cc), so every thread can be asked.
//
// Thread safety: Install once, before the threads it must see use the
// probed path; WaitOutside from one control thread at a time.
#ifndef RDMAVIRT_SHIM_DATAPATH_THREAD_PROBE_H_
#define RDMAVIRT_SHIM_DATAPATH_THREAD_PROBE_H_

#include <cstdint>
#include <string>
#include <vector>

namespace rdmavirt::shim {

// Installs the handler of the probe's signal: RDMAVIRT_PROBE_SIGNAL (a
// number) if set, else SIGRTMAX - 2. False (`error` says why) when that
// signal already has a handler of the application's or cannot be set.
bool InstallThreadProbe(std::string* error);

// The probe's signal once installed, else 0. Read by the mask interposers.
int ThreadProbeSignal();

// How many times the probe's signal was taken by the calling thread: a
// wait that the signal ended (poll(2) returns EINTR after any handler)
// tells the probe's from the application's by it.
uint32_t ThreadProbeTakenHere();

// Whether a signal handled by the calling thread since `probes` (its
// ThreadProbeTakenHere() then) would have ended a read(2) of a kernel
// channel: the probe's does not; another does when any signal the thread
// can take has a handler without SA_RESTART (defined in shim.cc).
bool EndsTheRead(uint32_t probes);

// How many times a thread asked answered that it was inside (or could not
// tell): for tests and diagnostics.
uint64_t ThreadProbeInsideAnswers();

// Waits until no thread of the process but the caller is inside the code
// of the libraries that hold `provider_entries` (the providers' data-path
// functions the probed path jumps to) by way of the probed path. False
// (`error` says which thread, and why) when a thread is still inside at
// `timeout_ms`, or a thread cannot be asked (the signal blocked by a
// mask the shim did not see, the handler replaced).
bool WaitOutsideProviders(const std::vector<const void*>& provider_entries, uint32_t timeout_ms,
                          std::string* error);

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_DATAPATH_THREAD_PROBE_H_
