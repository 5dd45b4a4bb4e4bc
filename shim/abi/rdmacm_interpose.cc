// librdmacm's channel constructor and destructor, under the shim's CM
// layer (shim/cm/cm.h): a migratable process's channels are virtual from
// their creation. librdmacm calls both through its PLT, also for the
// private channel of an id made without one, so its own uses come here
// too. The rest of librdmacm runs as it is: its commands reach the CM
// layer by write(2) (write_interpose.cc).
#include <dlfcn.h>
#include <errno.h>
#include <rdma/rdma_cma.h>

#include <atomic>

#include "shim/abi/libc_dl.h"
#include "shim/cm/channels.h"
#include "shim/core/log.h"
#include "shim/core/shim.h"
#include "shim/migration/control.h"

namespace {

// librdmacm's own `name`: the next in the global scope, or, for a
// librdmacm loaded into a local scope (UCX dlopens its rdmacm module,
// which needs librdmacm: RTLD_NEXT from the shim never sees it, and UCX
// got ENOSYS from its first rdma_create_event_channel), that library's.
// Looked up again until found: the first call may come before the
// library is loaded.
template <typename Fn>
Fn Next(std::atomic<Fn>* cache, const char* name) {
  Fn fn = cache->load(std::memory_order_acquire);
  if (fn != nullptr) return fn;
  const rdmavirt::shim::LibcDl& dl = rdmavirt::shim::Libc();
  if (dl.dlsym == nullptr) return nullptr;
  fn = reinterpret_cast<Fn>(dl.dlsym(RTLD_NEXT, name));
  if (fn == nullptr) {
    void* local = dlopen("librdmacm.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (local != nullptr) {
      fn = reinterpret_cast<Fn>(dl.dlsym(local, name));
      dlclose(local);  // NOLOAD took a reference of its own
    }
  }
  if (fn != nullptr) cache->store(fn, std::memory_order_release);
  return fn;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) rdma_event_channel* rdma_create_event_channel() {
  using Fn = rdma_event_channel* (*)();
  static std::atomic<Fn> cache{nullptr};
  const Fn real = Next<Fn>(&cache, "rdma_create_event_channel");
  if (real == nullptr) {
    errno = ENOSYS;
    return nullptr;
  }
  rdma_event_channel* channel = real();
  if (channel == nullptr || !rdmavirt::shim::MigrationEnabled()) return channel;
  if (!rdmavirt::shim::CmAdopt(channel->fd)) {
    rdmavirt::shim::LogOnce(
        "an RDMA CM channel could not be made virtual: it works, and the process cannot move");
    return channel;
  }
  // A listener that has opened no device yet (librdmacm opens one when a
  // connection comes) is an endpoint its migrator can move all the same.
  rdmavirt::shim::Shim* shim = rdmavirt::shim::Shim::Process();
  if (shim != nullptr && shim->migratable()) rdmavirt::shim::StartControl(shim);
  return channel;
}

extern "C" __attribute__((visibility("default"))) void rdma_destroy_event_channel(
    rdma_event_channel* channel) {
  using Fn = void (*)(rdma_event_channel*);
  static std::atomic<Fn> cache{nullptr};
  const Fn real = Next<Fn>(&cache, "rdma_destroy_event_channel");
  if (channel != nullptr) rdmavirt::shim::CmForget(channel->fd);
  if (real != nullptr) real(channel);
}
