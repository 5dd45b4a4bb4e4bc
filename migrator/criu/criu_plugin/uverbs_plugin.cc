// A CRIU plugin that lets a pre-dump pass over the HCA's mappings.
//
// A process under the shim maps its RDMA device (/dev/infiniband/uverbsN:
// queues, doorbells) while it runs. CRIU cannot dump such a mapping, and
// without a plugin it refuses to pre-dump the process at all, so every
// page would be copied after the process stopped. A pre-dump only copies
// memory while the process runs, so the HCA's shared mappings can be left
// out of it: this plugin claims them in the pre-dump stage. The final dump
// comes after the shim has released the device (no such mapping is left);
// if one is, the plugin refuses it, and the dump fails as it would without
// the plugin.
//
// What the HCA wrote into the process's registered memory since a
// pre-dump is not seen by the soft-dirty bits CRIU tracks: the shim writes
// every registered page once after its release (shim/migration/release.cc), so
// the final dump copies all of them again.
//
// Loaded only by rdmavirt's CRIU calls: rdmavirt-migratord points
// CRIU_LIBS_DIR at the directory holding it (--criu-plugin-dir).
#include <criu/criu-plugin.h>
#include <errno.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

namespace {

// "infiniband_verbs", Documentation/admin-guide/devices.txt.
constexpr unsigned kUverbsMajor = 231;

int g_stage = -1;

int Init(int stage) {
  g_stage = stage;
  return 0;
}

void Exit(int, int) {}

}  // namespace

CR_PLUGIN_REGISTER("rdmavirt_uverbs", Init, Exit)

extern "C" int rdmavirt_uverbs_handle_device_vma(int fd, const struct stat* st) {
  (void)fd;
  if (!S_ISCHR(st->st_mode) || major(st->st_rdev) != kUverbsMajor) return -ENOTSUP;
  if (g_stage == CR_PLUGIN_STAGE__PRE_DUMP) return 0;
  fprintf(stderr,
          "rdmavirt_uverbs: the RDMA device (char %u:%u) is still mapped at a dump: the shim "
          "must release it first\n",
          major(st->st_rdev), minor(st->st_rdev));
  return -ENOTSUP;
}

CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__HANDLE_DEVICE_VMA, rdmavirt_uverbs_handle_device_vma)
