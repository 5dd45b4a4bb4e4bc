// The RDMA CM under the shim: librdmacm's channels and ids, virtual.
//
// librdmacm talks to the kernel's CM by write(2)s of UCMA_CMD_* on a
// channel fd (/dev/infiniband/rdma_cm), each keyed by the kernel's handle
// of an id, and events come back by GET_EVENT. CRIU cannot dump that file,
// and the kernel's ids cannot be made again on another host. So:
//
// - The fd the application holds (rdma_event_channel::fd) is an epoll fd
//   the shim owns, with the kernel's channel (hidden, nonblocking) and an
//   eventfd counting the events the shim holds inside it: it is readable
//   when an event waits, as the kernel's was, it keeps its number, its
//   flags and the application's epoll registrations across a move, and
//   CRIU dumps it. A write(2) to it fails with EINVAL, so the shim's
//   write() sees librdmacm's commands only after the kernel refused them
//   (write_interpose.cc): the data path's writes cost nothing more.
// - Ids have handles of the shim's (what librdmacm holds), mapped to the
//   kernel's handle of the moment; DESTROY_ID and MIGRATE_ID answer the
//   events the shim gave out for the id, which is what librdmacm waits to
//   see acknowledged.
// - Multicast groups (rdma_join_multicast) get handles of the shim's
//   too; a move joins them again on the destination.
// - A move (cm_move.cc): the moving process refuses ids between states;
//   its release reads the kernel's pending events into the shim and closes
//   the kernel's channels; its restore opens new ones, makes listeners and
//   bound ids again, and for each connected id listens on a rendezvous port
//   it publishes with its mapping. Its peers, told the endpoint moves, take
//   every event of their ids' kernel ids toward it for the move's (the
//   source's closing disconnects them; the application never sees it),
//   and when told where it went
//   connect a new kernel id to that port, without a QP (the kernel CM never
//   touches the application's QPs, which the verbs part of the move
//   reconnects), and put it under the application's id. From then on the
//   connection is the kernel's again: a disconnect by either side reaches
//   the other as DISCONNECTED, natively.
#ifndef RDMAVIRT_SHIM_CM_CM_H_
#define RDMAVIRT_SHIM_CM_CM_H_

#include <infiniband/verbs.h>
#include <rdma/rdma_user_cm.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shim/core/identity.h"
#include "shim/core/mutex.h"
#include "shim/core/remote_map.h"
#include "shim/core/status.h"
#include "shim/datapath/write_relay.h"
#include "shim/migration/endpoint_view.h"

namespace rdmavirt::shim {

// librdmacm's event numbers (enum rdma_cm_event_type, rdma_cma.h, whose
// other names collide with the kernel ABI's header): the kernel's too.
enum CmEvent : uint32_t {
  kCmAddrResolved = 0,
  kCmAddrError,
  kCmRouteResolved,
  kCmRouteError,
  kCmConnectRequest,
  kCmConnectResponse,
  kCmConnectError,
  kCmUnreachable,
  kCmRejected,
  kCmEstablished,
  kCmDisconnected,
  kCmDeviceRemoval,
  kCmMulticastJoin,
  kCmMulticastError,
  kCmAddrChange,
  kCmTimewaitExit,
};

// A multicast group's event (the kernel names the group, not an id).
inline bool IsGroupEvent(uint32_t event) {
  return event == kCmMulticastJoin || event == kCmMulticastError;
}

// A device as an RDMA CM answer names it: node GUID (network order) and
// the kernel's index of the device, which librdmacm looks up together
// (kNoDeviceIndex: an answer of an older ABI, without one).
inline constexpr uint32_t kNoDeviceIndex = 0xffffffff;
struct CmDevice {
  uint64_t guid = 0;
  uint32_t index = 0;
  bool operator==(const CmDevice& o) const { return guid == o.guid && index == o.index; }
  bool operator<(const CmDevice& o) const {
    return guid != o.guid ? guid < o.guid : index < o.index;
  }
};

// The kernel's rdma_cm, as the CM layer reaches it (a fake in tests).
class CmKernel {
 public:
  virtual ~CmKernel() = default;
  // A new kernel channel (O_RDWR | O_CLOEXEC); -1 with errno.
  virtual int Open() = 0;
  // write(2) of one command; -1 with errno.
  virtual ssize_t Write(int fd, const void* cmd, size_t n) = 0;
  virtual void Close(int fd) = 0;
  // The device as the verbs library in this process lists it, for the
  // device the kernel now reports by node GUID `physical` (network
  // order): libibverbs keeps a device's GUID from its first read for as
  // long as a device of the same name and index is listed, so on another
  // host it may still name the old one. Unchanged when no listed device
  // has it.
  virtual CmDevice LibraryDevice(CmDevice physical) { return physical; }
};

// One command as write(2) takes it: header, then `in` bytes of body, into
// `buf` (kMaxCommand bytes); its length, 0 when the body is too long.
inline constexpr size_t kMaxCommand = sizeof(rdma_ucm_cmd_hdr) + 512;
size_t FrameCommand(uint32_t cmd, const void* body, size_t in, size_t out, char* buf);

// Whether kernel channel `fd` holds an event (poll(2), no wait).
bool KernelHasEvent(int fd);

// /dev/infiniband/rdma_cm through libc.
CmKernel* RealCmKernel();

// Where an id is in librdmacm's sequence, as the commands and events the
// shim passed on say.
enum class CmState : uint8_t {
  kIdle,           // created
  kBound,          // BIND
  kResolvingAddr,  // RESOLVE_ADDR sent, no answer yet
  kAddrResolved,
  kResolvingRoute,
  kRouteResolved,
  kConnecting,  // CONNECT sent, no answer yet
  kResponded,   // CONNECT_RESPONSE given, RTU not yet sent
  kListening,
  kRequested,  // a CONNECT_REQUEST's new id, not yet accepted
  kAccepting,  // accepted, ESTABLISHED not yet come
  kEstablished,
  kDisconnected,  // DISCONNECTED given (or sent): nothing more to move
  kRendezvous,    // restored, its kernel id not yet connected again
};
const char* CmStateName(CmState s);

// The rendezvous of one moved connection: its QP's virtual QPN and the
// port the moved process listens on, on the host its mapping names.
struct CmRendezvous {
  uint32_t virtual_qpn = 0;
  uint16_t port = 0;
};

// An id without a kernel id (the kernel's handles start at 0).
inline constexpr uint32_t kNoKid = 0xffffffffu;

class Cm {
 public:
  // The process's (never destroyed: librdmacm may run from destructors).
  static Cm* Process();
  // `mode`: the shim's (offset mode: the GIDs the kernel's answers give
  // the program are virtual, as the verbs' are).
  explicit Cm(CmKernel* kernel, IdentityMode mode = IdentityMode());
  ~Cm();

  // rdma_create_event_channel just opened the kernel's channel at `fd`:
  // after this `fd` is the shim's epoll fd, the kernel's file hidden.
  // False (with errno; `fd` left as it was) when it cannot be done.
  bool Adopt(int fd);
  // rdma_destroy_event_channel, before librdmacm closes `fd`.
  void Forget(int fd);
  bool IsChannel(int fd);
  // A command librdmacm wrote to channel `fd`: carried out, with write(2)'s
  // result and errno.
  ssize_t Write(int fd, const void* buf, size_t n);

  // ---- moves (cm_move.cc)
  // The moving process's quiesce: OK when every id can move; else the
  // first that cannot, its state named. Nothing is changed.
  Status CheckMovable();
  // A peer's quiesce toward `toward` (the endpoint that moves), given the
  // peer's QPs: its connected ids over QPs toward that endpoint take the
  // events the move causes for the move's.
  void MarkToward(const ibv_gid& toward, const std::vector<QpView>& qps);
  // The moving process's release: pending events kept, kernel channels
  // closed (which ends every kernel id).
  Status Release();
  // The restore: channels opened again, listeners and bound ids made again,
  // connected ids waiting for their peers at a rendezvous port.
  Status Restore(const std::vector<QpView>& qps);
  // The rendezvous a restore opened, for the mapping it publishes.
  std::vector<CmRendezvous> Rendezvous();
  // A peer told where its moved peers are now: its marked ids connected
  // to their rendezvous and put back under the application's ids.
  Status PeerReconnect(const std::vector<RemoteMapping>& mappings, const std::vector<QpView>& qps);
  // The moved process's resume: waits (bounded) for every rendezvous.
  Status Resume();

  size_t ids();
  size_t channels();

 private:
  struct Channel;
  struct Id {
    uint32_t vid = 0;       // librdmacm's handle
    uint32_t kid = kNoKid;  // the kernel's now (the kernel's first is 0)
    uint64_t uid = 0;
    uint16_t ps = 0;
    uint8_t qp_type = 0;
    int channel = -1;  // the application's fd of its channel
    CmState state = CmState::kIdle;
    uint32_t listener = 0;  // a requested id's listener (vid)
    sockaddr_storage bound{};
    uint16_t bound_len = 0;
    uint32_t backlog = 0;
    std::vector<std::string> options;  // SET_OPTIONs: level, name, value
    // The address resolution librdmacm asked for (RESOLVE_ADDR or
    // RESOLVE_IP and its body), made again for an id joined to groups.
    uint32_t resolve_cmd = 0;
    std::string resolve;
    uint32_t qpn = 0;     // the QP number CONNECT/ACCEPT carried
    uint32_t events = 0;  // events given out for it
    // A peer's id whose remote endpoint moves: the events of its kernel id
    // are the move's.
    bool toward_moving = false;
    uint32_t remote_qpn = 0;              // the moving QP's virtual QPN
    uint32_t rendezvous_child = kNoKid;   // restore: the kernel id being connected
    uint32_t rendezvous_qpn = 0;          // restore: the QP's physical QPN, for the REP
    std::string query_addr, query_route;  // the last answers, for a restored id
    // Bound again to the any-address on the destination (its own was an
    // address of the source host's, not one that moved): its queries
    // answer what they did before the move.
    bool rebound = false;
  };
  // A multicast group joined through an id (rdma_join_multicast). Its
  // events name it by its uid (librdmacm's record of the group); the
  // kernel's handle is only in LEAVE_MCAST, which gets the shim's.
  enum class Join : uint8_t { kJoining, kJoined, kFailed };
  struct Group {
    uint32_t vmc = 0;       // librdmacm's handle
    uint32_t kmc = kNoKid;  // the kernel's now
    uint32_t vid = 0;       // the id joined through
    uint64_t uid = 0;
    uint32_t cmd = 0;     // JOIN_MCAST or JOIN_IP_MCAST, as librdmacm wrote it
    std::string body;     // and its body: the join made again after a move
    uint32_t events = 0;  // events given out for it: what LEAVE_MCAST answers
    Join state = Join::kJoining;
  };
  struct Channel {
    uint64_t serial = 0;             // which of the channels that had the fd
    int fd = -1;                     // the application's: an epoll fd
    int real = -1;                   // the kernel's channel, in `fd`; -1 while released
    int queue_fd = -1;               // eventfd in `fd`, counting `queued`
    std::deque<std::string> queued;  // event responses held by the shim
  };

  ssize_t Command(Channel* ch, const rdma_ucm_cmd_hdr& hdr, char* body, size_t in)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Id* CommandId(Channel* ch, const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ssize_t GetEvent(int fd, const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in);
  // One event taken from the shim's queue or the kernel into `out`:
  // 1 one given, 0 none waits, -1 an error (errno).
  int TakeEvent(Channel* ch, std::string* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A kernel event: translated and counted (true), or the move's (false).
  bool Translate(rdma_ucm_event_resp* ev) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Queue(Channel* ch, std::string ev) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One event fewer held: the channel's eventfd counts down with its queue.
  static void CountDown(Channel* ch);
  // The events `ch` holds that `its` takes, out of its queue.
  std::deque<std::string> TakeQueued(Channel* ch,
                                     const std::function<bool(const rdma_ucm_event_resp&)>& its)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ssize_t CreateId(Channel* ch, const rdma_ucm_cmd_hdr& hdr, char* body, size_t in)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ssize_t DestroyOrMigrate(Channel* ch, const rdma_ucm_cmd_hdr& hdr, char* body, size_t in)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ssize_t JoinGroup(Channel* ch, const rdma_ucm_cmd_hdr& hdr, char* body, size_t in)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ssize_t LeaveGroup(Channel* ch, const rdma_ucm_cmd_hdr& hdr, char* body, size_t in)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Group* GroupByKernel(uint32_t kmc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Group* GroupByUid(uint64_t uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool HasGroups(uint32_t vid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Keep(Id* id, const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in);
  ssize_t AnswerWithoutKernel(Id* id, const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in);
  ssize_t Query(Channel* ch, Id* id, const rdma_ucm_cmd_hdr& hdr, char* body, size_t in)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Advance(Id* id, const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in);
  void VirtualizeQpAttr(const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in);
  ssize_t Kernel(int fd, uint32_t cmd, const void* body, size_t in, size_t out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens a kernel channel on the calling thread, nonblocking, with its relay.
  int OpenKernelChannel() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Id* ById(uint32_t vid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Id* ByKernel(uint32_t kid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Id* ByUid(uint64_t uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Id* NewId(int channel) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  CmDevice VirtualDevice(CmDevice physical) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // cm_move.cc
  Status RemakeId(Channel* ch, Id* id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status RemakeJoined(Channel* ch, Id* id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status OpenRendezvous() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ServeRendezvous();
  Status ConnectToRendezvous(uint32_t vid, const RemoteMapping& m, uint16_t port,
                             uint32_t physical_qpn);
  void Count(const rdma_ucm_event_resp& ev) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  CmKernel* const kernel_;
  const IdentityMode mode_;
  Mutex mu_;
  CondVar changed_;
  std::map<int, std::unique_ptr<Channel>> channels_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, Id> ids_ ABSL_GUARDED_BY(mu_);
  uint32_t next_vid_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint32_t, Group> groups_ ABSL_GUARDED_BY(mu_);  // by vmc
  uint32_t next_vmc_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t serials_ ABSL_GUARDED_BY(mu_) = 0;
  // The devices the kernel's answers name now -> as librdmacm first saw
  // them.
  std::vector<CmDevice> seen_devices_ ABSL_GUARDED_BY(mu_);
  std::map<CmDevice, CmDevice> device_map_ ABSL_GUARDED_BY(mu_);
  bool moved_ ABSL_GUARDED_BY(mu_) = false;  // restored at least once
  // The restore's rendezvous: a kernel channel with one listener.
  int rv_fd_ ABSL_GUARDED_BY(mu_) = -1;
  uint32_t rv_listener_ ABSL_GUARDED_BY(mu_) = 0;
  uint16_t rv_port_ ABSL_GUARDED_BY(mu_) = 0;
  // The kernel refuses a write to an rdma_cm fd from a thread whose
  // credentials are not the opener's very object, which every thread of a
  // restored process has its own of (write_relay.h): the channels a
  // restore opened take the other threads' commands through a relay made
  // by the opener. Gone at the release (CRIU cannot dump a ring).
  std::map<int, std::unique_ptr<WriteRelay>> relays_ ABSL_GUARDED_BY(mu_);
  bool rv_stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread rv_thread_;
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CM_CM_H_
