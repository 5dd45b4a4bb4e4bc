// Which object an asynchronous event names (ibv_async_event.element): the
// one fact the shim needs to map events between real and shadow objects.
#ifndef RDMAVIRT_SHIM_CORE_ASYNC_EVENT_H_
#define RDMAVIRT_SHIM_CORE_ASYNC_EVENT_H_

#include <infiniband/verbs.h>

namespace rdmavirt::shim {

enum class EventElement { kQp, kCq, kSrq, kOther };

inline EventElement ElementOf(ibv_event_type t) {
  switch (t) {
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
      return EventElement::kQp;
    case IBV_EVENT_CQ_ERR:
      return EventElement::kCq;
    case IBV_EVENT_SRQ_ERR:
    case IBV_EVENT_SRQ_LIMIT_REACHED:
      return EventElement::kSrq;
    default:
      return EventElement::kOther;  // port, device, WQ
  }
}

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CORE_ASYNC_EVENT_H_
