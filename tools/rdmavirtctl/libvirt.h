// libvirt as rdmavirtctl's VM commands use it: the library, loaded at the
// first connection, and owners of its connections, domains and snapshots.
//
// rdmavirtctl is not linked with libvirt: its libraries (47 more, glib,
// gnutls and krb5 among them) made every command, VM or not, load them at
// start (68 million instructions before main against 26 million without,
// most of them symbol lookups; on a lab host, 0.50 to 0.70 s per `--help`
// against 0.66 to 1.0 s). Open loads it (once per process) and looks its
// functions up; every other use of `lv` follows an Open that succeeded.
// Not thread-safe: the CLI runs its commands on the main thread.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_LIBVIRT_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_LIBVIRT_H_

#include <libvirt/libvirt-qemu.h>
#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rdmavirt::ctl {

// The namespace of the <metadata> element that marks a domain as an RDMA
// guest (its NIC is the <interface> with alias migrator::kGuestNicAlias).
inline constexpr char kGuestMetadataUri[] = "urn:rdmavirt:guest:1";

#define RDMAVIRT_LIBVIRT_FUNCTIONS(X)     \
  X(kCore, virConnectClose)               \
  X(kCore, virConnectListAllDomains)      \
  X(kCore, virConnectOpen)                \
  X(kCore, virDomainAttachDeviceFlags)    \
  X(kCore, virDomainDetachDeviceAlias)    \
  X(kCore, virDomainFree)                 \
  X(kCore, virDomainGetMetadata)          \
  X(kCore, virDomainGetName)              \
  X(kCore, virDomainGetXMLDesc)           \
  X(kCore, virDomainInterfaceAddresses)   \
  X(kCore, virDomainInterfaceFree)        \
  X(kCore, virDomainIsActive)             \
  X(kCore, virDomainIsPersistent)         \
  X(kCore, virDomainLookupByName)         \
  X(kCore, virDomainMigrate3)             \
  X(kCore, virDomainRevertToSnapshot)     \
  X(kCore, virDomainSnapshotCreateXML)    \
  X(kCore, virDomainSnapshotDelete)       \
  X(kCore, virDomainSnapshotFree)         \
  X(kCore, virDomainSnapshotGetXMLDesc)   \
  X(kCore, virDomainSnapshotLookupByName) \
  X(kCore, virDomainSnapshotNum)          \
  X(kCore, virGetLastErrorMessage)        \
  X(kCore, virSetErrorFunc)               \
  X(kCore, virTypedParamsAddString)       \
  X(kCore, virTypedParamsFree)            \
  X(kQemu, virDomainQemuAgentCommand)

// libvirt's functions, by the names libvirt gives them.
struct Libvirt {
#define RDMAVIRT_LIBVIRT_FIELD(lib, name) decltype(&::name) name = nullptr;
  RDMAVIRT_LIBVIRT_FUNCTIONS(RDMAVIRT_LIBVIRT_FIELD)
#undef RDMAVIRT_LIBVIRT_FIELD
};
// Set by the first Open that loads libvirt; null before.
extern const Libvirt* lv;

struct ConnDeleter {
  void operator()(virConnectPtr c) const { lv->virConnectClose(c); }
};
struct DomainDeleter {
  void operator()(virDomainPtr d) const { lv->virDomainFree(d); }
};
struct SnapshotDeleter {
  void operator()(virDomainSnapshotPtr s) const { lv->virDomainSnapshotFree(s); }
};
using Conn = std::unique_ptr<virConnect, ConnDeleter>;
using Domain = std::unique_ptr<virDomain, DomainDeleter>;
using Snap = std::unique_ptr<virDomainSnapshot, SnapshotDeleter>;

// A connection to the libvirt at `uri`: FAILED_PRECONDITION when libvirt
// cannot be loaded, UNAVAILABLE with libvirt's reason when it does not
// answer.
absl::StatusOr<Conn> Open(const std::string& uri);
// `what` and libvirt's last error ("unknown libvirt error" without one).
std::string LibvirtError(absl::string_view what);
// The live XML of `d`; UNAVAILABLE with libvirt's reason.
absl::StatusOr<std::string> DomainXml(virDomainPtr d);
// Whether `d` carries the <metadata> element of kGuestMetadataUri.
bool IsRdmaGuest(virDomainPtr d);

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_LIBVIRT_H_
