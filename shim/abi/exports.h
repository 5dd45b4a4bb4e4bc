// Every function libibverbs and librdmacm export, and what the shim does
// about it: the one place that says so.
//
// A preloaded shim sees every exported call an application makes. A call
// the shim does not define reaches libibverbs with whatever the
// application holds, and what it holds are shadow objects: an export that
// would dereference one as a real object crashes the program. So every
// export (each name, with every symbol version it has) is classified:
//
//   kShim          defined by the shim (verbs_api.cc): shadows translated
//                  to the real objects, identities to physical ones;
//   kRefused       defined by the shim, failing the way a device without
//                  the feature does (errno EOPNOTSUPP);
//   kPassThrough   not defined: it never receives a verbs object, or only
//                  real ones (devices are not shadowed), or it is
//                  librdmacm, which reaches verbs only through the above;
//   kProviderAbi   not defined: libibverbs' interface to its providers,
//                  called with the providers' own real objects.
//
// tests/shim/exports_test.cc reads `nm -D` of the installed libraries and
// of librdmavirt.so and fails on an export missing here, on a version not
// listed, and on a kShim/kRefused entry the shim does not define (or a
// pass-through one it does): a new rdma-core cannot bring a crash in
// silently. Thread-safe: constant data.
#ifndef RDMAVIRT_SHIM_ABI_EXPORTS_H_
#define RDMAVIRT_SHIM_ABI_EXPORTS_H_

#include <cstddef>
#include <span>
#include <string_view>

namespace rdmavirt::shim {

enum class ExportClass { kShim, kRefused, kPassThrough, kProviderAbi };

struct ExportRule {
  const char* name;
  const char* versions;  // every version the library exports, space-separated
  ExportClass cls;
  const char* why;
};

// Every rule, libibverbs' first.
std::span<const ExportRule> ExportRules();

// The rule for `name`, or nullptr.
const ExportRule* FindExportRule(std::string_view name);

// Whether the shim defines a function of this name (kShim or kRefused).
inline bool ShimDefines(const ExportRule& r) {
  return r.cls == ExportClass::kShim || r.cls == ExportClass::kRefused;
}

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_ABI_EXPORTS_H_
