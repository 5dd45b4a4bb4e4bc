// The CM layer's entry points for the interposers (abi/), free of the
// kernel ABI's header, whose names collide with librdmacm's rdma_cma.h.
#ifndef RDMAVIRT_SHIM_CM_CHANNELS_H_
#define RDMAVIRT_SHIM_CM_CHANNELS_H_

#include <sys/types.h>

namespace rdmavirt::shim {

// Cm::Process()'s Adopt, Forget, IsChannel and Write (cm.h).
bool CmAdopt(int fd);
void CmForget(int fd);
bool CmIsChannel(int fd);
ssize_t CmWrite(int fd, const void* buf, size_t n);

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CM_CHANNELS_H_
