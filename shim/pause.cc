#include "shim/pause.h"

#include <errno.h>
#include <linux/membarrier.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <new>
#include <vector>

#include "shim/log.h"

namespace rdmavirt::shim {

__thread ThreadMark* tls_thread_mark __attribute__((tls_model("initial-exec"))) = nullptr;

namespace {

// Every mark ever handed out. Never freed: the control thread reads marks
// of threads that may be exiting.
struct Registry {
  std::mutex mu;
  std::vector<ThreadMark*> marks;
  pthread_key_t key;
  bool key_ok = false;
  // Used when no mark can be allocated: shared, so a pause may miss a
  // call of such a thread; said once in the log.
  ThreadMark fallback;
};

Registry& Marks() {
  // Leaked on purpose: threads exit after static destructors have run.
  static Registry* r = [] {
    Registry* reg = new Registry;
    reg->key_ok = pthread_key_create(&reg->key, [](void* p) {
                    ThreadMark* m = static_cast<ThreadMark*>(p);
                    Registry& regs = Marks();
                    std::lock_guard<std::mutex> lock(regs.mu);
                    m->depth.store(0, std::memory_order_release);
                    m->in_use = false;
                  }) == 0;
    // A forked child has one thread: the others' marks are free, and the
    // registry's mutex is not held by a thread that does not exist there.
    pthread_atfork([] { Marks().mu.lock(); }, [] { Marks().mu.unlock(); },
                   [] {
                     Registry& regs = Marks();
                     for (ThreadMark* m : regs.marks) {
                       if (m == tls_thread_mark) continue;
                       m->depth.store(0, std::memory_order_relaxed);
                       m->in_use = false;
                     }
                     regs.mu.unlock();
                   });
    return reg;
  }();
  return *r;
}

long Membarrier(int cmd) { return syscall(SYS_membarrier, cmd, 0, 0); }

uint64_t NowMs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000u + static_cast<uint64_t>(ts.tv_nsec) / 1000000u;
}

}  // namespace

ThreadMark* RegisterThreadMark() {
  Registry& r = Marks();
  ThreadMark* mark = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    for (ThreadMark* m : r.marks) {
      if (!m->in_use) {
        mark = m;
        break;
      }
    }
    if (mark == nullptr) {
      mark = new (std::nothrow) ThreadMark;
      if (mark != nullptr) r.marks.push_back(mark);
    }
    if (mark == nullptr) {
      LogOnce("out of memory for a thread's data-path mark: pauses may miss its calls");
      return &r.fallback;
    }
    mark->in_use = true;
  }
  if (r.key_ok) pthread_setspecific(r.key, mark);
  tls_thread_mark = mark;
  return mark;
}

bool AsymmetricFenceAvailable() {
  const long cmds = Membarrier(MEMBARRIER_CMD_QUERY);
  if (cmds < 0 || !(cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED)) return false;
  return Membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0;
}

bool PauseGate::Close(uint32_t timeout_ms, std::string* error) {
  closed_.store(true, std::memory_order_seq_cst);
  long rc = Membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED);
  if (rc != 0 && errno == EPERM) {
    // Not registered in this process image (a CRIU restore keeps memory,
    // not always the kernel's registration): register and fence again.
    if (Membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0)
      rc = Membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED);
  }
  if (rc != 0) {
    Open();
    *error = "membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) failed: the data path cannot be paused";
    return false;
  }
  std::vector<ThreadMark*> marks;
  {
    Registry& r = Marks();
    std::lock_guard<std::mutex> lock(r.mu);
    marks = r.marks;
    marks.push_back(&r.fallback);
  }
  const ThreadMark* self = tls_thread_mark;
  const uint64_t deadline = NowMs() + timeout_ms;
  for (const ThreadMark* m : marks) {
    if (m == self) continue;
    while (m->depth.load(std::memory_order_acquire) != 0) {
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
