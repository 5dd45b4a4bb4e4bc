// libc's own dlsym and dlvsym. The shim exports functions of those names
// (dl_interpose.cc), so inside the shim the names bind to its own
// versions; code that needs the real lookup (the real backend, the
// interposers' pass-through) calls these. Found once, in libc's dynamic
// symbol table, by default version. Thread-safe.
#ifndef RDMAVIRT_SHIM_ABI_LIBC_DL_H_
#define RDMAVIRT_SHIM_ABI_LIBC_DL_H_

namespace rdmavirt::shim {

using DlsymFn = void* (*)(void*, const char*);
using DlvsymFn = void* (*)(void*, const char*, const char*);

struct LibcDl {
  DlsymFn dlsym = nullptr;  // nullptr if libc could not be read
  DlvsymFn dlvsym = nullptr;
};

const LibcDl& Libc();

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_ABI_LIBC_DL_H_
