// Small helpers the migration steps share (release.cc, restore.cc): names
// of verbs constants and errno text for the steps' error messages. Pure
// functions, safe on any thread.
#ifndef RDMAVIRT_SHIM_MIGRATION_STEP_UTIL_H_
#define RDMAVIRT_SHIM_MIGRATION_STEP_UTIL_H_

#include <infiniband/verbs.h>
#include <string.h>

#include <cstdint>
#include <string>

namespace rdmavirt::shim {

inline const char* QpTypeName(uint32_t type) {
  switch (type) {
    case IBV_QPT_RC:
      return "RC";
    case IBV_QPT_UC:
      return "UC";
    case IBV_QPT_UD:
      return "UD";
    default:
      return "other";
  }
}

inline std::string Errno(const char* what, int err) {
  std::string s = what;
  s += ": ";
  s += strerror(err);
  return s;
}

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_MIGRATION_STEP_UTIL_H_
