#include "shim/abi/libc_dl.h"

#include <elf.h>
#include <link.h>
#include <string.h>

#include "shim/core/log.h"

namespace rdmavirt::shim {
namespace {

// The default (non-hidden) definition of `name` in the object `info`.
void* FindDefault(const dl_phdr_info* info, const char* name) {
  const ElfW(Dyn)* dyn = nullptr;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
      dyn = reinterpret_cast<const ElfW(Dyn)*>(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
  }
  if (dyn == nullptr) return nullptr;
  const ElfW(Sym)* symtab = nullptr;
  const char* strtab = nullptr;
  const ElfW(Half)* versym = nullptr;
  for (; dyn->d_tag != DT_NULL; ++dyn) {
    // In a loaded object's dynamic section these are already relocated.
    if (dyn->d_tag == DT_SYMTAB) symtab = reinterpret_cast<const ElfW(Sym)*>(dyn->d_un.d_ptr);
    if (dyn->d_tag == DT_STRTAB) strtab = reinterpret_cast<const char*>(dyn->d_un.d_ptr);
    if (dyn->d_tag == DT_VERSYM) versym = reinterpret_cast<const ElfW(Half)*>(dyn->d_un.d_ptr);
  }
  if (symtab == nullptr || strtab == nullptr) return nullptr;
  // The string table follows the symbol table in every glibc build: the
  // distance bounds the symbol count without walking the hash table.
  const size_t count =
      (reinterpret_cast<const char*>(strtab) - reinterpret_cast<const char*>(symtab)) /
      sizeof(ElfW(Sym));
  for (size_t i = 0; i < count; ++i) {
    const ElfW(Sym)& s = symtab[i];
    if (s.st_shndx == SHN_UNDEF || ELF64_ST_TYPE(s.st_info) != STT_FUNC) continue;
    if (versym != nullptr && (versym[i] & 0x8000)) continue;  // hidden: a compat version
    if (strcmp(strtab + s.st_name, name) == 0)
      return reinterpret_cast<void*>(info->dlpi_addr + s.st_value);
  }
  return nullptr;
}

int FindLibc(dl_phdr_info* info, size_t, void* data) {
  const char* base = strrchr(info->dlpi_name, '/');
  base = base ? base + 1 : info->dlpi_name;
  if (strncmp(base, "libc.so", 7) != 0) return 0;
  auto* out = static_cast<LibcDl*>(data);
  out->dlsym = reinterpret_cast<DlsymFn>(FindDefault(info, "dlsym"));
  out->dlvsym = reinterpret_cast<DlvsymFn>(FindDefault(info, "dlvsym"));
  return 1;
}

}  // namespace

const LibcDl& Libc() {
  static const LibcDl libc = [] {
    LibcDl l;
    dl_iterate_phdr(FindLibc, &l);
    if (l.dlsym == nullptr || l.dlvsym == nullptr)
      LogOnce("cannot find libc's dlsym/dlvsym: dlopen'ed libibverbs is not shimmed");
    return l;
  }();
  return libc;
}

}  // namespace rdmavirt::shim
