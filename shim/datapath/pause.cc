#include "shim/datapath/pause.h"

#include <errno.h>
#include <linux/membarrier.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "shim/core/log.h"

namespace rdmavirt::shim {

__thread ThreadMark tls_thread_mark __attribute__((tls_model("initial-exec")));

namespace {

// The marks of the live threads that have made a gated call. A thread
// leaves it (its key's destructor) before its thread-local storage goes;
// the control thread holds the mutex while it reads marks.
struct Registry {
  std::mutex mu;
  std::vector<ThreadMark*> marks;
  pthread_key_t key;
  bool key_ok = false;
};

Registry& Marks();

void Unregister(void* p) {
  ThreadMark* m = static_cast<ThreadMark*>(p);
  Registry& r = Marks();
  std::lock_guard<std::mutex> lock(r.mu);
  r.marks.erase(std::remove(r.marks.begin(), r.marks.end(), m), r.marks.end());
  m->registered = false;
  m->marked_word = ThreadMark::kUnregistered;
  m->translated_word = ThreadMark::kUnregistered;
}

long Membarrier(int cmd) { return syscall(SYS_membarrier, cmd, 0, 0); }

uint64_t NowMs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000u + static_cast<uint64_t>(ts.tv_nsec) / 1000000u;
}

Registry& Marks() {
  // Leaked on purpose: threads exit after static destructors have run.
  static Registry* r = [] {
    Registry* reg = new Registry;
    reg->key_ok = pthread_key_create(&reg->key, Unregister) == 0;
    // A forked child has one thread: the others' marks are gone, and the
    // mutex is not held by a thread that does not exist there.
    pthread_atfork([] { Marks().mu.lock(); }, [] { Marks().mu.unlock(); },
                   [] {
                     Registry& regs = Marks();
                     regs.marks.clear();
                     if (tls_thread_mark.registered) regs.marks.push_back(&tls_thread_mark);
                     regs.mu.unlock();
                   });
    return reg;
  }();
  return *r;
}

}  // namespace

void RegisterThreadMark() {
  Registry& r = Marks();
  ThreadMark* m = &tls_thread_mark;
  if (!r.key_ok || pthread_setspecific(r.key, m) != 0) {
    // Registered all the same: a pause must see this thread's calls. Its
    // mark stays listed after it exits (memory the thread no longer owns).
    LogOnce("no exit hook for a thread's data-path mark (pthread_setspecific failed)");
  }
  std::lock_guard<std::mutex> lock(r.mu);
  r.marks.push_back(m);
  m->registered = true;
  m->marked_word = static_cast<uint16_t>(Path::kMarked);
  m->translated_word = static_cast<uint16_t>(Path::kTranslated);
}

bool AsymmetricFenceAvailable() {
  const long cmds = Membarrier(MEMBARRIER_CMD_QUERY);
  if (cmds < 0 || !(cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED)) return false;
  return Membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0;
}

bool FenceOtherThreads() {
  long rc = Membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED);
  if (rc != 0 && errno == EPERM) {
    // Not registered in this process image (a CRIU restore keeps memory,
    // not always the kernel's registration): register and fence again.
    if (Membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0)
      rc = Membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED);
  }
  return rc == 0;
}

bool PauseGate::Close(uint32_t timeout_ms, std::string* error) {
  closed_.store(true, std::memory_order_seq_cst);
  if (!FenceOtherThreads()) {
    Open();
    *error = "membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) failed: the data path cannot be paused";
    return false;
  }
  Registry& r = Marks();
  std::lock_guard<std::mutex> lock(r.mu);
  const uint64_t deadline = NowMs() + timeout_ms;
  for (const ThreadMark* m : r.marks) {
    if (m == &tls_thread_mark) continue;
    while (m->depth.load(std::memory_order_acquire) != 0 ||
           m->batches.load(std::memory_order_acquire) != 0) {
      if (NowMs() > deadline) {
        Open();
        *error = "a thread stayed inside a post, poll or polling batch for " +
                 std::to_string(timeout_ms) + " ms";
        return false;
      }
      sched_yield();
    }
  }
  return true;
}

}  // namespace rdmavirt::shim
