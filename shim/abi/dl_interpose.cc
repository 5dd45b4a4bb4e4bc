// Programs that dlopen libibverbs and look its symbols up on that handle
// (NCCL: dlopen("libibverbs.so.1") then dlvsym(h, name, "IBVERBS_1.1"))
// bypass LD_PRELOAD: a lookup on a handle searches only that object. The
// shim therefore defines dlsym and dlvsym too. A lookup on libibverbs'
// handle for a name the shim defines returns the shim's definition;
// everything else goes to libc's, as a tail call, so that the caller glibc
// sees (which RTLD_NEXT depends on) is still the application.
//
// libc's own functions come from libc_dl.h.
#include <dlfcn.h>
#include <string.h>

#include "shim/abi/libc_dl.h"

namespace {

using rdmavirt::shim::Libc;

// The shim's own definition of a verbs name, if `handle` is libibverbs'.
void* ShimSymbolFor(void* handle, const char* name) {
  if (handle == RTLD_NEXT || handle == RTLD_DEFAULT || name == nullptr) return nullptr;
  if (strncmp(name, "ibv_", 4) != 0 && strncmp(name, "_ibv_", 5) != 0) return nullptr;
  void* verbs = dlopen("libibverbs.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (verbs == nullptr) return nullptr;
  dlclose(verbs);  // NOLOAD took a reference
  if (verbs != handle) return nullptr;
  Dl_info self;
  if (dladdr(reinterpret_cast<void*>(&ShimSymbolFor), &self) == 0) return nullptr;
  void* shim = dlopen(self.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (shim == nullptr) return nullptr;
  dlclose(shim);
  return Libc().dlsym != nullptr ? Libc().dlsym(shim, name) : nullptr;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void* dlsym(void* handle, const char* name) {
  if (void* f = ShimSymbolFor(handle, name)) return f;
  return Libc().dlsym(handle, name);  // a tail call: RTLD_NEXT keeps its caller
}

extern "C" __attribute__((visibility("default"))) void* dlvsym(void* handle, const char* name,
                                                               const char* version) {
  // The shim's verbs are unversioned: they stand for every version.
  if (void* f = ShimSymbolFor(handle, name)) return f;
  return Libc().dlvsym(handle, name, version);
}
