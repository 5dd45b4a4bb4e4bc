// FakeCmFabric: the kernel's RDMA CM (drivers/infiniband/core/ucma.c and
// cma.c) in memory, for the CM layer's unit tests (shim/cm).
//
// A fabric holds hosts, each with one IPv4 address and one device's node
// GUID. A host is a CmKernel: Open() makes a channel ("file") on it, and
// Write() carries out one UCMA command on a channel the way ucma_write()
// does. Ids are the kernel's contexts: their handles are global across the
// fabric (the kernel's ctx_table is one xarray), events go to the file of
// the id they are reported on, and a connection's two ids may live on two
// hosts. What the fake does as the kernel does, because the CM layer
// relies on it:
// - a channel is a real fd, readable while events wait (a pipe: one byte
//   per queued event), so it can sit in the CM layer's epoll. Files are
//   known by the pipe's inode, not by fd number: the CM layer dup()s the
//   fd it adopts and writes to the copy;
// - GET_EVENT never blocks (the CM layer sets every kernel channel
//   nonblocking; one it forgot is counted in blocking_gets()): EAGAIN when
//   nothing waits. It counts the event for the id it is reported on, a
//   CONNECT_REQUEST for its listener;
// - events for a passive side's new id are dropped while its uid is 0
//   (until ACCEPT sets it), as ucma_event_handler() drops them;
// - DESTROY_ID and MIGRATE_ID answer events_reported; destroying an
//   established id (or closing its file) sends a DREQ: the peer gets
//   DISCONNECTED; destroying a listener drops its pending requests;
// - RESOLVE_ADDR to an address no host has queues ADDR_ERROR; CONNECT to
//   a port nobody listens on queues REJECTED (status 8, invalid service ID);
// - the active side's ACCEPT with conn_param.valid == 0 is the RTU: the
//   passive side gets ESTABLISHED, the active side nothing;
// - RESOLVE_ADDR to an IPv4 multicast address resolves on the id's own
//   host; JOIN_MCAST on a bound or resolved id makes a group (its handle
//   from a table of its own, as the kernel's multicast_table) whose
//   MULTICAST_JOIN names the group's handle and uid; GET_EVENT counts a
//   group's events for its id and for the group, LEAVE_MCAST answers the
//   group's count and drops its pending events, and a group goes with its
//   id (MIGRATE_ID, DESTROY_ID).
// Events are queued at once (the kernel's resolutions are asynchronous,
// but nothing in the CM layer can tell the difference but timing).
// Not modelled: RESOLVE_IP, BIND_IP, JOIN_IP_MCAST, options, INIT_QP_ATTR,
// QUERY_PATH/GID, NOTIFY, TIMEWAIT_EXIT, IB addresses (AF_IB), timeouts.
//
// Thread-safe: one mutex for the fabric (the CM layer's rendezvous thread
// writes commands while a test's thread does).
#ifndef RDMAVIRT_TESTS_SHIM_FAKE_CM_H_
#define RDMAVIRT_TESTS_SHIM_FAKE_CM_H_

#include <netinet/in.h>
#include <rdma/rdma_user_cm.h>
#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shim/cm/cm.h"

namespace rdmavirt::shim::testing {

class FakeCmFabric;

class FakeCmHost : public CmKernel {
 public:
  FakeCmHost(FakeCmFabric* fabric, uint32_t ip, uint64_t node_guid)
      : fabric_(fabric), ip_(ip), node_guid_(node_guid) {}
  int Open() override;
  ssize_t Write(int fd, const void* cmd, size_t n) override;
  void Close(int fd) override;

  uint32_t ip() const { return ip_; }  // network order
  uint64_t node_guid() const { return node_guid_; }
  // The kernel's index of its device (grows each time one is made).
  uint32_t device_index() const { return device_index_; }
  void set_device_index(uint32_t i) { device_index_ = i; }
  CmDevice device() const { return {node_guid_, device_index_}; }
  // Live kernel ids on this host, and open channels.
  size_t ids();
  size_t files();

 private:
  FakeCmFabric* const fabric_;
  const uint32_t ip_;
  const uint64_t node_guid_;
  uint32_t device_index_ = 1;
};

// A process's view of the kernel: the host it runs on now. Open() makes
// channels there; Write() and Close() reach a channel wherever it is (a
// moved process closes nothing of its old host's but what it still holds).
class FakeCmProcessKernel : public CmKernel {
 public:
  explicit FakeCmProcessKernel(FakeCmHost* host) : host_(host) {}
  void MoveTo(FakeCmHost* host) { host_ = host; }
  FakeCmHost* host() const { return host_; }
  int Open() override { return host_->Open(); }
  ssize_t Write(int fd, const void* cmd, size_t n) override { return host_->Write(fd, cmd, n); }
  void Close(int fd) override { host_->Close(fd); }
  // As libibverbs may: a device's GUID as first read, on another host.
  CmDevice LibraryDevice(CmDevice physical) override {
    auto it = library_devices.find(physical);
    return it == library_devices.end() ? physical : it->second;
  }
  std::map<CmDevice, CmDevice> library_devices;  // the kernel's -> the library's

 private:
  FakeCmHost* host_;
};

class FakeCmFabric {
 public:
  // `ip` as "10.0.0.1".
  FakeCmHost* AddHost(const std::string& ip, uint64_t node_guid);
  // The kernel gives the lowest free handle from 0 (xa_alloc(): 0
  // whenever no id exists on the machine). The fake gives the lowest free
  // from `first`, 1000 by default: a kernel's handle that leaks to the
  // application then never equals one of the shim's (which count from 1),
  // and only the test of handle 0 depends on handle 0.
  void SetFirstHandle(uint32_t first);
  // GET_EVENTs written to a channel left blocking.
  int blocking_gets();
  // Multicast groups joined on `host`'s ids.
  size_t groups(FakeCmHost* host);
  // A passive side's REP reaches the active side this long after its
  // ACCEPT: as when the fabric lost the REQ or the REP once, and the
  // kernel's CM sent it again (about 4.8 s later on RoCE). 0: at once.
  void set_rep_delay_ms(int ms);
  ~FakeCmFabric();

 private:
  friend class FakeCmHost;
  enum class St : uint8_t {
    kIdle,
    kBound,
    kListen,
    kAddrResolved,
    kRouteResolved,
    kConnect,
    kResponded,
    kRequested,
    kAccepted,
    kEstablished,
    kDisconnected,
  };
  struct Ctx {
    uint32_t handle = 0;
    uint64_t uid = 0;
    uint16_t ps = 0;
    ino_t file = 0;
    FakeCmHost* host = nullptr;
    St state = St::kIdle;
    sockaddr_in src{}, dst{};
    bool bound = false;
    uint32_t peer = 0;      // the other id of its connection
    uint32_t listener = 0;  // a requested id's listener
    uint32_t qp_num = 0;
    uint32_t backlog = 0;  // a listener's requests it may still queue
    uint32_t events_reported = 0;
  };
  struct Mc {
    uint32_t ctx = 0;
    uint64_t uid = 0;
    uint32_t events_reported = 0;
  };
  struct Event {
    uint32_t ctx = 0;  // what it is counted for (a request: the listener)
    uint32_t mc = 0;   // a group's event: its handle (+1; 0: none)
    rdma_ucm_event_resp resp{};
  };
  struct File {
    FakeCmHost* host = nullptr;
    int drain = -1;  // the pipe's read end, a description of the fake's
    int wr = -1;
    std::deque<Event> events;
  };
  using Hdr = rdma_ucm_cmd_hdr;

  int Open(FakeCmHost* host);
  ssize_t Write(int fd, const void* cmd, size_t n);
  void Close(int fd);
  size_t Ids(FakeCmHost* host);
  size_t Files(FakeCmHost* host);

  ssize_t Dispatch(ino_t file, int fd, const Hdr& hdr, const char* body);
  int CreateId(ino_t file, const Hdr& hdr, const char* body);
  int DestroyId(ino_t file, const Hdr& hdr, const char* body);
  int MigrateId(ino_t file, const Hdr& hdr, const char* body);
  int Bind(ino_t file, const char* body);
  int Listen(ino_t file, const char* body);
  int ResolveAddr(ino_t file, const char* body);
  int ResolveRoute(ino_t file, const char* body);
  int Connect(ino_t file, const char* body);
  int Accept(ino_t file, const char* body);
  int Disconnect(ino_t file, const char* body);
  int Query(ino_t file, const Hdr& hdr, const char* body);
  int QueryRoute(ino_t file, const Hdr& hdr, const char* body);
  int GetEvent(ino_t file, int fd, const Hdr& hdr, const char* body);
  int Join(ino_t file, const Hdr& hdr, const char* body);
  int Leave(ino_t file, const Hdr& hdr, const char* body);

  Ctx* Find(ino_t file, uint32_t handle, int* err);
  bool PortTaken(FakeCmHost* host, uint16_t ps, uint16_t port);
  int BindTo(Ctx* c, sockaddr_in addr);
  FakeCmHost* HostOf(uint32_t ip);
  Ctx* ListenerAt(FakeCmHost* host, uint16_t ps, uint16_t port);
  void QueueEvent(Ctx* c, uint32_t event, int32_t status, const rdma_ucm_conn_param* p,
                  uint32_t counted_for = 0);
  void SendDreq(Ctx* c);
  void DestroyCtx(uint32_t handle);
  void DropEvents(File* f, uint32_t ctx);

  std::mutex mu_;
  std::vector<std::unique_ptr<FakeCmHost>> hosts_;
  std::map<ino_t, File> files_;
  std::map<uint32_t, Ctx> ctxs_;
  std::map<uint32_t, Mc> mcs_;
  uint32_t first_handle_ = 1000;
  uint16_t next_port_ = 40000;
  int blocking_gets_ = 0;
  int rep_delay_ms_ = 0;
  std::vector<std::thread> late_reps_;
};

// "a.b.c.d" -> its IPv4-mapped GID (::ffff:a.b.c.d), as RoCE numbers it.
ibv_gid MappedGid(const std::string& ip);

}  // namespace rdmavirt::shim::testing

#endif  // RDMAVIRT_TESTS_SHIM_FAKE_CM_H_
