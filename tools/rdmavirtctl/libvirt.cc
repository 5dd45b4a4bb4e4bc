#include "tools/rdmavirtctl/libvirt.h"

#include <dlfcn.h>

#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace rdmavirt::ctl {

const Libvirt* lv = nullptr;

namespace {

// The libraries, by the index the list names them with: libvirt-qemu's
// one function drives the guest agent.
constexpr int kCore = 0;
constexpr int kQemu = 1;
constexpr const char* kLibvirtFiles[] = {"libvirt.so.0", "libvirt-qemu.so.0"};

// Loads both libraries (once per process) and looks their functions up.
absl::Status LoadLibvirt() {
  static const absl::Status loaded = []() -> absl::Status {
    void* handles[2];
    for (int i : {kCore, kQemu}) {
      handles[i] = dlopen(kLibvirtFiles[i], RTLD_NOW | RTLD_GLOBAL);
      if (handles[i] == nullptr)
        return absl::FailedPreconditionError(
            absl::StrCat("VM commands need libvirt (Debian: libvirt0): ", dlerror()));
    }
    static Libvirt api;
#define RDMAVIRT_LIBVIRT_FIND(lib, name)                                       \
  api.name = reinterpret_cast<decltype(api.name)>(dlsym(handles[lib], #name)); \
  if (api.name == nullptr)                                                     \
    return absl::FailedPreconditionError(absl::StrCat(kLibvirtFiles[lib], " has no ", #name));
    RDMAVIRT_LIBVIRT_FUNCTIONS(RDMAVIRT_LIBVIRT_FIND)
#undef RDMAVIRT_LIBVIRT_FIND
    lv = &api;
    return absl::OkStatus();
  }();
  return loaded;
}

// libvirt prints every error to stderr unless told otherwise; ours are
// reported once, with their context (LibvirtError).
void QuietLibvirtError(void*, virErrorPtr) {}

}  // namespace

std::string LibvirtError(absl::string_view what) {
  const char* m = lv->virGetLastErrorMessage();
  return absl::StrCat(what, ": ", m != nullptr ? m : "unknown libvirt error");
}

absl::StatusOr<Conn> Open(const std::string& uri) {
  if (absl::Status st = LoadLibvirt(); !st.ok()) return st;
  static const bool quiet = (lv->virSetErrorFunc(nullptr, QuietLibvirtError), true);
  (void)quiet;
  Conn c(lv->virConnectOpen(uri.c_str()));
  if (c == nullptr) return absl::UnavailableError(LibvirtError(absl::StrCat("libvirt at ", uri)));
  return c;
}

absl::StatusOr<std::string> DomainXml(virDomainPtr d) {
  char* x = lv->virDomainGetXMLDesc(d, 0);
  if (x == nullptr) return absl::UnavailableError(LibvirtError("the domain's XML"));
  std::string out(x);
  free(x);
  return out;
}

bool IsRdmaGuest(virDomainPtr d) {
  char* meta = lv->virDomainGetMetadata(d, VIR_DOMAIN_METADATA_ELEMENT, kGuestMetadataUri,
                                        VIR_DOMAIN_AFFECT_LIVE);
  if (meta == nullptr) return false;
  free(meta);
  return true;
}

}  // namespace rdmavirt::ctl
