// A stand-in for a provider's library, built as a shared library of its
// own (thread_probe_test.cc): the probe tells a provider's frames from the
// application's by the loaded object that holds them.
#include <unistd.h>

#include <atomic>

extern "C" {

// Spins inside "the provider" until *state becomes 2; sets it to 1 first.
__attribute__((visibility("default"), noinline)) int ProbeProviderSpin(std::atomic<int>* state) {
  state->store(1);
  while (state->load() != 2) {
  }
  return 7;
}

// Writes n bytes to fd from inside "the provider" (a doorbell's write
// that blocks, as on a full pipe); what write(2) returned.
__attribute__((visibility("default"), noinline)) long ProbeProviderWrite(int fd, const void* buf,
                                                                         unsigned long n) {
  const long rc = write(fd, buf, n);
  asm volatile("" ::: "memory");  // not a tail call: this frame stays on the stack
  return rc;
}

}  // extern "C"
