// The RDMA devices of this host, read with libibverbs directly (the
// migrator does not run under the shim). Safe to call from any thread.
#ifndef RDMAVIRT_MIGRATOR_HOST_RDMA_DEVICES_H_
#define RDMAVIRT_MIGRATOR_HOST_RDMA_DEVICES_H_

#include <vector>

#include "rdmavirt/v1/host.pb.h"

namespace rdmavirt::migrator {

// Every device with its ports and populated GIDs; none when the host has
// no RDMA device (or libibverbs finds none).
std::vector<v1::RdmaDevice> ListRdmaDevices();

// The first device with an ACTIVE port, or nullptr.
const v1::RdmaDevice* FirstActiveDevice(const v1::HostInfo& host);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_HOST_RDMA_DEVICES_H_
