// The CM layer (shim/cm) over FakeCmFabric: each "process" a Cm over its
// own host's fake kernel, driven by the UCMA commands librdmacm v44 writes
// (rdma_create_id, rdma_resolve_addr, ..., rdma_get_cm_event's GET_EVENT;
// rdma_ack_cm_event writes nothing) on the channel fd it adopted. Native
// connections, a channel across a move, a moving client and a moving
// server reconnected through the rendezvous, and the move's refusals.
#include "shim/cm/cm.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/shim/fake_cm.h"

namespace rdmavirt::shim::testing {
namespace {

constexpr uint16_t kServicePort = 7471;
constexpr uint64_t kListenerUid = 0x5100, kServerUid = 0x5200, kClientUid = 0xc100;
constexpr uint32_t kClientQpn = 0x111, kServerQpn = 0x222;

sockaddr_in Addr(const std::string& ip, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, ip.c_str(), &a.sin_addr);
  return a;
}

// One process: librdmacm's commands through its Cm, over the host it
// runs on now.
class Process {
 public:
  explicit Process(FakeCmHost* host) : kernel_(host), cm_(&kernel_) {}
  Cm& cm() { return cm_; }
  FakeCmProcessKernel& kernel() { return kernel_; }

  // rdma_create_event_channel: the kernel's fd, adopted.
  int Channel() {
    const int fd = kernel_.Open();
    EXPECT_GE(fd, 0);
    EXPECT_TRUE(cm_.Adopt(fd)) << strerror(errno);
    return fd;
  }
  // write(2) of one command: 0, or the errno it failed with.
  template <typename T>
  int Send(int fd, uint32_t cmd, const T& body, size_t out) {
    char buf[sizeof(rdma_ucm_cmd_hdr) + sizeof(T)];
    rdma_ucm_cmd_hdr hdr{cmd, sizeof(T), static_cast<uint16_t>(out)};
    memcpy(buf, &hdr, sizeof hdr);
    memcpy(buf + sizeof hdr, &body, sizeof body);
    const ssize_t rc = cm_.Write(fd, buf, sizeof buf);
    if (rc < 0) return errno;
    EXPECT_EQ(rc, static_cast<ssize_t>(sizeof buf));
    return 0;
  }
  uint32_t CreateId(int fd, uint64_t uid, uint16_t ps = RDMA_PS_TCP, uint8_t qp_type = IBV_QPT_RC) {
    rdma_ucm_create_id_resp resp{};
    rdma_ucm_create_id c{uid, reinterpret_cast<uintptr_t>(&resp), ps, qp_type, {}};
    EXPECT_EQ(Send(fd, RDMA_USER_CM_CMD_CREATE_ID, c, sizeof resp), 0);
    return resp.id;
  }
  int Bind(int fd, uint32_t id, const sockaddr_in& a) {
    rdma_ucm_bind b{};
    b.id = id;
    b.addr_size = sizeof a;
    memcpy(&b.addr, &a, sizeof a);
    return Send(fd, RDMA_USER_CM_CMD_BIND, b, 0);
  }
  int Listen(int fd, uint32_t id) {
    return Send(fd, RDMA_USER_CM_CMD_LISTEN, rdma_ucm_listen{id, 8}, 0);
  }
  int ResolveAddr(int fd, uint32_t id, const sockaddr_in& dst) {
    rdma_ucm_resolve_addr r{};
    r.id = id;
    r.timeout_ms = 2000;
    r.dst_size = sizeof dst;
    memcpy(&r.dst_addr, &dst, sizeof dst);
    return Send(fd, RDMA_USER_CM_CMD_RESOLVE_ADDR, r, 0);
  }
  int ResolveRoute(int fd, uint32_t id) {
    return Send(fd, RDMA_USER_CM_CMD_RESOLVE_ROUTE, rdma_ucm_resolve_route{id, 2000}, 0);
  }
  rdma_ucm_query_addr_resp QueryAddr(int fd, uint32_t id) {
    rdma_ucm_query_addr_resp r{};
    rdma_ucm_query q{reinterpret_cast<uintptr_t>(&r), id, RDMA_USER_CM_QUERY_ADDR};
    EXPECT_EQ(Send(fd, RDMA_USER_CM_CMD_QUERY, q, sizeof r), 0);
    return r;
  }
  rdma_ucm_query_route_resp QueryRoute(int fd, uint32_t id) {
    rdma_ucm_query_route_resp r{};
    rdma_ucm_query q{reinterpret_cast<uintptr_t>(&r), id, 0};
    EXPECT_EQ(Send(fd, RDMA_USER_CM_CMD_QUERY_ROUTE, q, sizeof r), 0);
    return r;
  }
  int Connect(int fd, uint32_t id, uint32_t qpn, const std::string& private_data) {
    rdma_ucm_connect c{};
    c.id = id;
    c.conn_param.qp_num = qpn;
    memcpy(c.conn_param.private_data, private_data.data(), private_data.size());
    c.conn_param.private_data_len = static_cast<uint8_t>(private_data.size());
    c.conn_param.responder_resources = c.conn_param.initiator_depth = 1;
    c.conn_param.retry_count = c.conn_param.rnr_retry_count = 7;
    c.conn_param.valid = 1;
    return Send(fd, RDMA_USER_CM_CMD_CONNECT, c, 0);
  }
  // The passive side's rdma_accept (uid: the new id's), or with qpn 0 the
  // active side's RTU (ucma_process_conn_resp: conn_param not valid).
  int Accept(int fd, uint32_t id, uint64_t uid, uint32_t qpn) {
    rdma_ucm_accept a{};
    a.id = id;
    if (qpn != 0) {
      a.uid = uid;
      a.conn_param.qp_num = qpn;
      a.conn_param.responder_resources = a.conn_param.initiator_depth = 1;
      a.conn_param.rnr_retry_count = 7;
      a.conn_param.valid = 1;
    }
    return Send(fd, RDMA_USER_CM_CMD_ACCEPT, a, 0);
  }
  int Disconnect(int fd, uint32_t id) {
    return Send(fd, RDMA_USER_CM_CMD_DISCONNECT, rdma_ucm_disconnect{id}, 0);
  }
  // rdma_join_multicast_ex (librdmacm's JOIN_MCAST): the group's handle
  // as librdmacm keeps it, 0 on failure.
  uint32_t Join(int fd, uint32_t id, const sockaddr_in& group, uint64_t uid) {
    rdma_ucm_create_id_resp resp{};
    rdma_ucm_join_mcast j{};
    j.response = reinterpret_cast<uintptr_t>(&resp);
    j.uid = uid;
    j.id = id;
    j.addr_size = sizeof group;
    memcpy(&j.addr, &group, sizeof group);
    if (Send(fd, RDMA_USER_CM_CMD_JOIN_MCAST, j, sizeof resp) != 0) return 0;
    return resp.id;
  }
  // rdma_leave_multicast: the events_reported it answered, -1 on failure.
  int64_t Leave(int fd, uint32_t group) {
    rdma_ucm_destroy_id_resp resp{};
    rdma_ucm_destroy_id d{reinterpret_cast<uintptr_t>(&resp), group, 0};
    if (Send(fd, RDMA_USER_CM_CMD_LEAVE_MCAST, d, sizeof resp) != 0) return -1;
    return resp.events_reported;
  }
  // GET_EVENT: 0 and `ev`, or the errno.
  int GetEvent(int fd, rdma_ucm_event_resp* ev) {
    *ev = {};
    return Send(fd, RDMA_USER_CM_CMD_GET_EVENT, rdma_ucm_get_event{reinterpret_cast<uintptr_t>(ev)},
                sizeof *ev);
  }
  // rdma_destroy_id: the events_reported it answered, -1 on failure.
  int64_t Destroy(int fd, uint32_t id) {
    rdma_ucm_destroy_id_resp resp{};
    rdma_ucm_destroy_id d{reinterpret_cast<uintptr_t>(&resp), id, 0};
    if (Send(fd, RDMA_USER_CM_CMD_DESTROY_ID, d, sizeof resp) != 0) return -1;
    return resp.events_reported;
  }

 private:
  FakeCmProcessKernel kernel_;
  Cm cm_;
};

void SetNonblocking(int fd) { ASSERT_EQ(fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK), 0); }

const char* EventName(uint32_t e) {
  static const char* const kNames[] = {
      "ADDR_RESOLVED",   "ADDR_ERROR",       "ROUTE_RESOLVED", "ROUTE_ERROR",
      "CONNECT_REQUEST", "CONNECT_RESPONSE", "CONNECT_ERROR",  "UNREACHABLE",
      "REJECTED",        "ESTABLISHED",      "DISCONNECTED",   "DEVICE_REMOVAL",
      "MULTICAST_JOIN",  "MULTICAST_ERROR",  "ADDR_CHANGE",    "TIMEWAIT_EXIT"};
  return e < sizeof kNames / sizeof *kNames ? kNames[e] : "?";
}

// The next event is `event` for the shim's handle `id`, under `uid`.
::testing::AssertionResult IsEvent(Process& p, int fd, uint32_t event, uint64_t uid, uint32_t id) {
  rdma_ucm_event_resp ev;
  if (const int rc = p.GetEvent(fd, &ev); rc != 0)
    return ::testing::AssertionFailure() << "no " << EventName(event) << ": " << strerror(rc);
  if (ev.event != event || ev.uid != uid || ev.id != id)
    return ::testing::AssertionFailure()
           << EventName(ev.event) << " uid " << std::hex << ev.uid << " id " << std::dec << ev.id
           << ", not " << EventName(event) << " uid " << std::hex << uid << " id " << std::dec
           << id;
  return ::testing::AssertionSuccess();
}

// Nothing waits on the (nonblocking) channel.
::testing::AssertionResult NoEvent(Process& p, int fd) {
  rdma_ucm_event_resp ev;
  const int rc = p.GetEvent(fd, &ev);
  if (rc == EAGAIN) return ::testing::AssertionSuccess();
  if (rc != 0) return ::testing::AssertionFailure() << "GET_EVENT: " << strerror(rc);
  return ::testing::AssertionFailure() << "unexpected " << EventName(ev.event) << " uid "
                                       << std::hex << ev.uid << " id " << std::dec << ev.id;
}

QpView Qp(uint32_t vqpn, uint32_t pqpn, const std::string& remote_ip, uint32_t remote_vqpn) {
  QpView q;
  q.virtual_qpn = vqpn;
  q.physical_qpn = pqpn;
  q.qp_type = IBV_QPT_RC;
  q.connected = true;
  q.remote_virtual_gid = MappedGid(remote_ip);
  q.remote_virtual_qpn = remote_vqpn;
  return q;
}

class CmTest : public ::testing::Test {
 protected:
  CmTest()
      : a_(fabric_.AddHost("10.0.0.1", 0xa1)),
        b_(fabric_.AddHost("10.0.0.2", 0xb2)),
        c_(fabric_.AddHost("10.0.0.3", 0xc3)) {}

  // A server on `server`'s channel: a listener on any address, the
  // service port.
  void Serve(Process* server, int sfd, uint16_t ps = RDMA_PS_TCP, uint8_t qp_type = IBV_QPT_RC) {
    listener_ = server->CreateId(sfd, kListenerUid, ps, qp_type);
    sockaddr_in any = Addr("0.0.0.0", kServicePort);
    ASSERT_EQ(server->Bind(sfd, listener_, any), 0);
    ASSERT_EQ(server->Listen(sfd, listener_), 0);
  }

  // librdmacm's rdma_connect / rdma_accept sequence, the client resolving
  // `ip`; `*cid` and `*sid` the shim's handles of the two ids. The client's
  // own events are counted in client_events_.
  void Connect(Process* client, int cfd, Process* server, int sfd, const std::string& ip,
               uint32_t* cid, uint32_t* sid, uint32_t expect_sid) {
    *cid = client->CreateId(cfd, kClientUid);
    ASSERT_EQ(client->ResolveAddr(cfd, *cid, Addr(ip, kServicePort)), 0);
    EXPECT_TRUE(IsEvent(*client, cfd, kCmAddrResolved, kClientUid, *cid));
    client->QueryAddr(cfd, *cid);
    ASSERT_EQ(client->ResolveRoute(cfd, *cid), 0);
    EXPECT_TRUE(IsEvent(*client, cfd, kCmRouteResolved, kClientUid, *cid));
    client->QueryRoute(cfd, *cid);
    ASSERT_EQ(client->Connect(cfd, *cid, kClientQpn, "hello"), 0);
    rdma_ucm_event_resp req;
    ASSERT_EQ(server->GetEvent(sfd, &req), 0);
    EXPECT_EQ(req.event, kCmConnectRequest);
    EXPECT_EQ(req.uid, kListenerUid);
    EXPECT_EQ(req.id, expect_sid);
    EXPECT_EQ(req.param.conn.qp_num, kClientQpn);
    EXPECT_EQ(std::string(reinterpret_cast<char*>(req.param.conn.private_data), 5), "hello");
    *sid = req.id;
    server->QueryAddr(sfd, *sid);
    ASSERT_EQ(server->Accept(sfd, *sid, kServerUid, kServerQpn), 0);
    rdma_ucm_event_resp rep;
    ASSERT_EQ(client->GetEvent(cfd, &rep), 0);
    EXPECT_EQ(rep.event, kCmConnectResponse);
    EXPECT_EQ(rep.uid, kClientUid);
    EXPECT_EQ(rep.id, *cid);
    EXPECT_EQ(rep.param.conn.qp_num, kServerQpn);
    ASSERT_EQ(client->Accept(cfd, *cid, 0, 0), 0);  // the RTU
    EXPECT_TRUE(IsEvent(*server, sfd, kCmEstablished, kServerUid, *sid));
  }

  // The server's QPs, toward the client's connection; and the mapping the
  // server is re-pointed with once the client moved.
  static std::vector<QpView> ServerQps() {
    return {Qp(kServerQpn, 0x8002, "10.0.0.1", kClientQpn)};
  }
  // `client` (on a_), connected to `server` (on b_): moved to c_ and
  // restored there, waiting at its rendezvous for the server.
  void MoveTheConnectedClient(Process* server, Process* client, RemoteMapping* moved) {
    server->cm().MarkToward(MappedGid("10.0.0.1"), ServerQps());
    ASSERT_TRUE(client->cm().Release().ok());
    client->kernel().MoveTo(c_);
    ASSERT_TRUE(client->cm().Restore({Qp(kClientQpn, 0x9001, "10.0.0.2", kServerQpn)}).ok());
    const std::vector<CmRendezvous> rv = client->cm().Rendezvous();
    ASSERT_EQ(rv.size(), 1u);
    moved->virtual_gid = MappedGid("10.0.0.1");
    moved->physical_gid = MappedGid("10.0.0.3");
    moved->cm_rendezvous = {{rv[0].virtual_qpn, rv[0].port}};
  }

  // An id of `p`'s that resolves an address (librdmacm then queries the
  // device, which the CM layer sees), then goes; the device's answer.
  static rdma_ucm_query_addr_resp SeeTheDevice(Process* p, int fd, uint64_t uid) {
    const uint32_t id = p->CreateId(fd, uid);
    EXPECT_EQ(p->ResolveAddr(fd, id, Addr("10.0.0.2", kServicePort)), 0);
    EXPECT_TRUE(IsEvent(*p, fd, kCmAddrResolved, uid, id));
    const rdma_ucm_query_addr_resp addr = p->QueryAddr(fd, id);
    EXPECT_EQ(p->Destroy(fd, id), 1);
    return addr;
  }

  FakeCmFabric fabric_;
  FakeCmHost* a_;
  FakeCmHost* b_;
  FakeCmHost* c_;
  uint32_t listener_ = 0;
};

TEST_F(CmTest, NativeConnectionUnderTheShimsHandles) {
  Process server(b_), client(a_);
  const int sfd = server.Channel(), cfd = client.Channel();
  Serve(&server, sfd);
  EXPECT_EQ(listener_, 1u);  // the shim's; the kernel's is 1000
  uint32_t cid, sid;
  Connect(&client, cfd, &server, sfd, "10.0.0.2", &cid, &sid, 2);
  EXPECT_EQ(cid, 1u);
  rdma_ucm_query_addr_resp addr = client.QueryAddr(cfd, cid);
  EXPECT_EQ(addr.node_guid, 0xa1u);
  sockaddr_in src;
  memcpy(&src, &addr.src_addr, sizeof src);
  EXPECT_EQ(src.sin_addr.s_addr, Addr("10.0.0.1", 0).sin_addr.s_addr);
  EXPECT_NE(src.sin_port, 0);  // the ephemeral port RESOLVE_ADDR bound

  SetNonblocking(sfd);
  EXPECT_TRUE(NoEvent(server, sfd));
  // The client's channel blocks: a GET_EVENT waits until the server's
  // disconnect reaches it.
  auto waiting = std::async(std::launch::async, [&] {
    rdma_ucm_event_resp ev{};
    const int rc = client.GetEvent(cfd, &ev);
    return rc == 0 ? ev : rdma_ucm_event_resp{};
  });
  EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout)
      << "GET_EVENT on a blocking channel returned with nothing to give";
  ASSERT_EQ(server.Disconnect(sfd, sid), 0);
  ASSERT_EQ(waiting.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  const rdma_ucm_event_resp ev = waiting.get();
  EXPECT_EQ(ev.event, kCmDisconnected);
  EXPECT_EQ(ev.uid, kClientUid);
  EXPECT_EQ(ev.id, cid);
  EXPECT_TRUE(IsEvent(server, sfd, kCmDisconnected, kServerUid, sid));
  EXPECT_TRUE(NoEvent(server, sfd));

  EXPECT_EQ(client.Destroy(cfd, cid), 4);        // ADDR, ROUTE, RESPONSE, DISCONNECTED
  EXPECT_EQ(server.Destroy(sfd, sid), 2);        // ESTABLISHED, DISCONNECTED
  EXPECT_EQ(server.Destroy(sfd, listener_), 1);  // the CONNECT_REQUEST
  EXPECT_EQ(client.cm().ids(), 0u);
  EXPECT_EQ(a_->ids() + b_->ids(), 0u);
  EXPECT_EQ(fabric_.blocking_gets(), 0);
}

TEST_F(CmTest, ChannelKeepsItsNumberFlagsAndEpollAcrossAMove) {
  Process p(a_);
  const int fd = p.Channel();
  SetNonblocking(fd);
  // An id that saw the device before the move, then went.
  EXPECT_EQ(SeeTheDevice(&p, fd, 0x11).node_guid, 0xa1u);
  const uint32_t id = p.CreateId(fd, 0x22);
  const int app_ep = epoll_create1(EPOLL_CLOEXEC);
  epoll_event reg{};
  reg.events = EPOLLIN;
  reg.data.fd = fd;
  ASSERT_EQ(epoll_ctl(app_ep, EPOLL_CTL_ADD, fd, &reg), 0);

  ASSERT_TRUE(p.cm().CheckMovable().ok());
  ASSERT_TRUE(p.cm().Release().ok());
  EXPECT_EQ(a_->files(), 0u) << "the release left a kernel channel open";
  p.kernel().MoveTo(c_);
  ASSERT_TRUE(p.cm().Restore({}).ok());
  EXPECT_TRUE(p.cm().IsChannel(fd));
  EXPECT_TRUE(fcntl(fd, F_GETFL) & O_NONBLOCK);
  epoll_event got{};
  EXPECT_EQ(epoll_wait(app_ep, &got, 1, 0), 0);

  ASSERT_EQ(p.ResolveAddr(fd, id, Addr("10.0.0.2", kServicePort)), 0);
  ASSERT_EQ(epoll_wait(app_ep, &got, 1, 5000), 1);
  EXPECT_EQ(got.data.fd, fd);
  EXPECT_TRUE(IsEvent(p, fd, kCmAddrResolved, 0x22, id));
  // The GUID librdmacm first saw, not the new host's.
  EXPECT_EQ(p.QueryAddr(fd, id).node_guid, 0xa1u);
  EXPECT_EQ(p.Destroy(fd, id), 1);
  EXPECT_EQ(c_->ids(), 0u);
  close(app_ep);
}

// A listener that had seen no device (bound to the any-address) moved:
// the first GUID its ids report is the one the verbs library lists the
// device by, which after a move may be the old host's (librdmacm found no
// device for the new host's and destroyed each client's id).
TEST_F(CmTest, AfterAMoveAFirstGuidIsTheOneTheVerbsLibraryNames) {
  Process p(a_);
  const int fd = p.Channel();
  SetNonblocking(fd);
  const uint32_t id = p.CreateId(fd, 0x33);
  ASSERT_TRUE(p.cm().CheckMovable().ok());
  ASSERT_TRUE(p.cm().Release().ok());
  p.kernel().MoveTo(c_);
  p.kernel().library_devices[c_->device()] = a_->device();
  ASSERT_TRUE(p.cm().Restore({}).ok());
  ASSERT_EQ(p.ResolveAddr(fd, id, Addr("10.0.0.2", kServicePort)), 0);
  EXPECT_TRUE(IsEvent(p, fd, kCmAddrResolved, 0x33, id));
  const rdma_ucm_query_addr_resp addr = p.QueryAddr(fd, id);
  EXPECT_EQ(addr.node_guid, a_->node_guid());
  EXPECT_EQ(addr.ibdev_index, a_->device_index());
  EXPECT_EQ(p.Destroy(fd, id), 1);
}

// A device seen before the move: its GUID and its index after it, though
// the destination made its device again (a new index): librdmacm looks
// both up (a listener moved to such a host rejected its clients).
TEST_F(CmTest, AfterAMoveTheDeviceSeenKeepsItsGuidAndIndex) {
  Process p(a_);
  const int fd = p.Channel();
  SetNonblocking(fd);
  EXPECT_EQ(SeeTheDevice(&p, fd, 0x44).ibdev_index, 1u);
  const uint32_t id = p.CreateId(fd, 0x45);
  ASSERT_TRUE(p.cm().CheckMovable().ok());
  ASSERT_TRUE(p.cm().Release().ok());
  c_->set_device_index(3);
  p.kernel().MoveTo(c_);
  ASSERT_TRUE(p.cm().Restore({}).ok());
  ASSERT_EQ(p.ResolveAddr(fd, id, Addr("10.0.0.2", kServicePort)), 0);
  EXPECT_TRUE(IsEvent(p, fd, kCmAddrResolved, 0x45, id));
  const rdma_ucm_query_addr_resp addr = p.QueryAddr(fd, id);
  EXPECT_EQ(addr.node_guid, a_->node_guid());
  EXPECT_EQ(addr.ibdev_index, 1u);
  const rdma_ucm_query_route_resp route = p.QueryRoute(fd, id);
  EXPECT_EQ(route.node_guid, a_->node_guid());
  EXPECT_EQ(route.ibdev_index, 1u);
  EXPECT_EQ(p.Destroy(fd, id), 1);
}

TEST_F(CmTest, MovedClientReconnectsThroughTheRendezvous) {
  Process server(b_), client(a_);
  const int sfd = server.Channel(), cfd = client.Channel();
  SetNonblocking(sfd);
  Serve(&server, sfd);
  uint32_t cid, sid;
  Connect(&client, cfd, &server, sfd, "10.0.0.2", &cid, &sid, 2);

  const std::vector<QpView> server_qps = {Qp(kServerQpn, 0x8002, "10.0.0.1", kClientQpn)};
  ASSERT_TRUE(client.cm().CheckMovable().ok()) << client.cm().CheckMovable().message;
  server.cm().MarkToward(MappedGid("10.0.0.1"), server_qps);
  ASSERT_TRUE(client.cm().Release().ok());
  EXPECT_EQ(a_->ids(), 0u);
  EXPECT_TRUE(NoEvent(server, sfd));  // the release's DISCONNECTED is the move's

  client.kernel().MoveTo(c_);
  const std::vector<QpView> client_qps = {Qp(kClientQpn, 0x9001, "10.0.0.2", kServerQpn)};
  ASSERT_TRUE(client.cm().Restore(client_qps).ok());
  const std::vector<CmRendezvous> rv = client.cm().Rendezvous();
  ASSERT_EQ(rv.size(), 1u);
  EXPECT_EQ(rv[0].virtual_qpn, kClientQpn);
  EXPECT_NE(rv[0].port, 0);
  RemoteMapping moved;
  moved.virtual_gid = MappedGid("10.0.0.1");
  moved.physical_gid = MappedGid("10.0.0.3");
  moved.cm_rendezvous = {{rv[0].virtual_qpn, rv[0].port}};
  const Status st = server.cm().PeerReconnect({moved}, server_qps);
  ASSERT_TRUE(st.ok()) << st.message;
  const auto resume_started = std::chrono::steady_clock::now();
  ASSERT_TRUE(client.cm().Resume().ok());
  EXPECT_LT(std::chrono::steady_clock::now() - resume_started, std::chrono::seconds(5))
      << "Resume waited for a rendezvous that had completed";

  ASSERT_EQ(client.Disconnect(cfd, cid), 0);
  EXPECT_TRUE(IsEvent(server, sfd, kCmDisconnected, kServerUid, sid));
  EXPECT_TRUE(NoEvent(server, sfd));
  SetNonblocking(cfd);
  EXPECT_TRUE(IsEvent(client, cfd, kCmDisconnected, kClientUid, cid));
  EXPECT_EQ(client.Destroy(cfd, cid), 4);  // ADDR, ROUTE, RESPONSE, DISCONNECTED
  EXPECT_EQ(server.Destroy(sfd, sid), 2);  // ESTABLISHED, DISCONNECTED
  EXPECT_EQ(server.Destroy(sfd, listener_), 1);
  EXPECT_EQ(a_->ids() + b_->ids() + c_->ids(), 0u);
  EXPECT_EQ(fabric_.blocking_gets(), 0);
}

// The fabric lost the peer's REQ to the rendezvous, or its REP, once: the
// kernel's CM sends it again after about 4.8 s, and the peer waits for it
// (it gave up after 5 s: "RDMA CM id 3 cannot reconnect to its moved peer
// (port 44701): no answer within 5000 ms", an rstream client's move in
// the lab).
TEST_F(CmTest, APeerWaitsForTheRendezvousAnswerTheFabricDelayedOnce) {
  Process server(b_), client(a_);
  const int sfd = server.Channel(), cfd = client.Channel();
  SetNonblocking(sfd);
  Serve(&server, sfd);
  uint32_t cid, sid;
  Connect(&client, cfd, &server, sfd, "10.0.0.2", &cid, &sid, 2);
  RemoteMapping moved;
  ASSERT_NO_FATAL_FAILURE(MoveTheConnectedClient(&server, &client, &moved));
  fabric_.set_rep_delay_ms(6000);
  const Status st = server.cm().PeerReconnect({moved}, ServerQps());
  ASSERT_TRUE(st.ok()) << st.message;
  ASSERT_TRUE(client.cm().Resume().ok());
  ASSERT_EQ(client.Disconnect(cfd, cid), 0);
  EXPECT_TRUE(IsEvent(server, sfd, kCmDisconnected, kServerUid, sid))
      << "the peer's connection is not the kernel's again";
}

// The moved process's resume comes while its peer still connects to the
// rendezvous (control.cc: "connect to the rendezvous now if they have not
// yet"): the resume waits for it, and the connection is the kernel's again.
TEST_F(CmTest, ResumeWaitsWhileThePeerConnectsToTheRendezvous) {
  Process server(b_), client(a_);
  const int sfd = server.Channel(), cfd = client.Channel();
  SetNonblocking(sfd);
  SetNonblocking(cfd);
  Serve(&server, sfd);
  uint32_t cid, sid;
  Connect(&client, cfd, &server, sfd, "10.0.0.2", &cid, &sid, 2);
  RemoteMapping moved;
  ASSERT_NO_FATAL_FAILURE(MoveTheConnectedClient(&server, &client, &moved));

  auto resumed = std::async(std::launch::async, [&] { return client.cm().Resume(); });
  const Status st = server.cm().PeerReconnect({moved}, ServerQps());
  EXPECT_TRUE(st.ok()) << st.message;
  ASSERT_EQ(resumed.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "Resume still waits 10 s after the peer connected";
  EXPECT_TRUE(resumed.get().ok());
  ASSERT_EQ(client.Disconnect(cfd, cid), 0);
  EXPECT_TRUE(IsEvent(server, sfd, kCmDisconnected, kServerUid, sid));
  EXPECT_TRUE(NoEvent(server, sfd));
}

// UD ids (udaddy's): after the SIDR exchange the kernel keeps no
// connection for them, and the QP's datagrams are the verbs layer's to
// re-point. Each side moves: its UD id goes on without a kernel id (its
// queries answered as before, its destroy by the shim), the listener
// listens again, and no rendezvous is published.
TEST_F(CmTest, UdIdsMoveWithoutAKernelConnection) {
  Process server(b_), client(a_);
  const int sfd = server.Channel(), cfd = client.Channel();
  SetNonblocking(sfd);
  SetNonblocking(cfd);
  Serve(&server, sfd, RDMA_PS_UDP, IBV_QPT_UD);
  const uint32_t cid = client.CreateId(cfd, kClientUid, RDMA_PS_UDP, IBV_QPT_UD);
  ASSERT_EQ(client.ResolveAddr(cfd, cid, Addr("10.0.0.2", kServicePort)), 0);
  EXPECT_TRUE(IsEvent(client, cfd, kCmAddrResolved, kClientUid, cid));
  const rdma_ucm_query_addr_resp before = client.QueryAddr(cfd, cid);
  ASSERT_EQ(client.ResolveRoute(cfd, cid), 0);
  EXPECT_TRUE(IsEvent(client, cfd, kCmRouteResolved, kClientUid, cid));
  ASSERT_EQ(client.Connect(cfd, cid, kClientQpn, "ud"), 0);
  rdma_ucm_event_resp req;
  ASSERT_EQ(server.GetEvent(sfd, &req), 0);
  ASSERT_EQ(req.event, kCmConnectRequest);
  const uint32_t sid = req.id;
  server.QueryAddr(sfd, sid);
  ASSERT_EQ(server.Accept(sfd, sid, kServerUid, kServerQpn), 0);  // the SIDR REP
  EXPECT_TRUE(IsEvent(client, cfd, kCmEstablished, kClientUid, cid));
  EXPECT_TRUE(NoEvent(server, sfd));

  for (Process* p : {&server, &client}) {
    const Status st = p->cm().CheckMovable();
    ASSERT_TRUE(st.ok()) << st.message;
  }
  ASSERT_TRUE(server.cm().Release().ok());
  server.kernel().MoveTo(c_);
  ASSERT_TRUE(server.cm().Restore({}).ok());
  EXPECT_TRUE(server.cm().Rendezvous().empty());
  EXPECT_EQ(c_->ids(), 1u) << "the listener only";
  EXPECT_EQ(server.QueryAddr(sfd, sid).src_size, sizeof(sockaddr_in));
  ASSERT_TRUE(client.cm().Release().ok());
  client.kernel().MoveTo(c_);
  ASSERT_TRUE(client.cm().Restore({}).ok());
  EXPECT_TRUE(client.cm().Rendezvous().empty());
  const rdma_ucm_query_addr_resp after = client.QueryAddr(cfd, cid);
  EXPECT_EQ(memcmp(&after.dst_addr, &before.dst_addr, sizeof before.dst_addr), 0);
  EXPECT_EQ(after.node_guid, before.node_guid);
  // A second move carries them as the first did.
  ASSERT_TRUE(client.cm().CheckMovable().ok());

  EXPECT_EQ(client.Destroy(cfd, cid), 3);  // ADDR, ROUTE, ESTABLISHED
  EXPECT_EQ(server.Destroy(sfd, sid), 0);
  EXPECT_EQ(server.Destroy(sfd, listener_), 1);  // the CONNECT_REQUEST
  EXPECT_EQ(b_->ids() + c_->ids(), 0u);
}

// mckey's receiver: a UD id resolved to a multicast address, joined to
// its group. Before, its JOIN event was known by nothing (the kernel names
// the group's handle) and a joined id was refused; now the move resolves
// its address again on the destination and joins its group again, the
// program seeing none of the move's events, and its leave and destroy
// answer the events it saw.
TEST_F(CmTest, AMulticastReceiverIsJoinedAgainOnTheDestination) {
  constexpr uint64_t kGroupUid = 0x6c00, kIdUid = 0x6100;
  Process p(a_);
  const int fd = p.Channel();
  SetNonblocking(fd);
  const uint32_t id = p.CreateId(fd, kIdUid, RDMA_PS_UDP, IBV_QPT_UD);
  const sockaddr_in group = Addr("239.1.130.3", 0);
  ASSERT_EQ(p.ResolveAddr(fd, id, group), 0);
  EXPECT_TRUE(IsEvent(p, fd, kCmAddrResolved, kIdUid, id));
  p.QueryAddr(fd, id);  // librdmacm's, at ADDR_RESOLVED
  const uint32_t mc = p.Join(fd, id, group, kGroupUid);
  ASSERT_NE(mc, 0u);
  Status st = p.cm().CheckMovable();
  EXPECT_EQ(st.code, Code::kFailedPrecondition) << "a join not yet answered";
  EXPECT_NE(st.message.find("joining a multicast group"), std::string::npos) << st.message;
  rdma_ucm_event_resp join;
  ASSERT_EQ(p.GetEvent(fd, &join), 0);
  EXPECT_EQ(join.event, kCmMulticastJoin);
  EXPECT_EQ(join.uid, kGroupUid);
  EXPECT_EQ(join.param.ud.qp_num, 0xffffffu);
  st = p.cm().CheckMovable();
  ASSERT_TRUE(st.ok()) << st.message;

  ASSERT_TRUE(p.cm().Release().ok());
  EXPECT_EQ(a_->ids() + fabric_.groups(a_), 0u);
  p.kernel().MoveTo(c_);
  st = p.cm().Restore({});
  ASSERT_TRUE(st.ok()) << st.message;
  EXPECT_EQ(c_->ids(), 1u);
  EXPECT_EQ(fabric_.groups(c_), 1u) << "the group joined again";
  EXPECT_TRUE(NoEvent(p, fd)) << "the move's ADDR_RESOLVED and MULTICAST_JOIN are the shim's";
  EXPECT_EQ(p.QueryAddr(fd, id).node_guid, a_->node_guid()) << "the device librdmacm knows";
  // A second move carries it as the first did.
  ASSERT_TRUE(p.cm().CheckMovable().ok());

  EXPECT_EQ(p.Leave(fd, mc), 1) << "the JOIN the program saw, not the move's";
  EXPECT_EQ(fabric_.groups(c_), 0u);
  EXPECT_EQ(p.Leave(fd, mc), -1) << "a group left is gone";
  EXPECT_EQ(p.Destroy(fd, id), 2);  // ADDR_RESOLVED, MULTICAST_JOIN
  EXPECT_EQ(c_->ids(), 0u);
}

// A group whose id is destroyed goes with it, in the kernel and in the
// shim: its handle is unknown after.
TEST_F(CmTest, AGroupGoesWithItsId) {
  Process p(a_);
  const int fd = p.Channel();
  SetNonblocking(fd);
  const uint32_t id = p.CreateId(fd, 0x71, RDMA_PS_UDP, IBV_QPT_UD);
  ASSERT_EQ(p.Bind(fd, id, Addr("10.0.0.1", 0)), 0);
  const uint32_t mc = p.Join(fd, id, Addr("239.1.1.1", 0), 0x72);
  ASSERT_NE(mc, 0u);
  EXPECT_EQ(p.Destroy(fd, id), 0) << "its JOIN, never given out, is not counted";
  EXPECT_EQ(fabric_.groups(a_), 0u);
  EXPECT_TRUE(NoEvent(p, fd));
  EXPECT_EQ(p.Leave(fd, mc), -1);
  EXPECT_TRUE(p.cm().CheckMovable().ok());
}

// libfabric's verbs provider binds its passive endpoint to the host's own
// address, not to one that moves. Before, the restore refused it ("cannot
// be bound again to its address here") and the move rolled back; now it
// listens on the same port on every address of the destination, and its
// queries answer what they did before the move.
TEST_F(CmTest, AListenerBoundToTheSourceHostsOwnAddressListensOnTheSamePortThere) {
  Process server(b_), later(a_);
  const int sfd = server.Channel(), lfd = later.Channel();
  SetNonblocking(sfd);
  const uint32_t listener = server.CreateId(sfd, kListenerUid);
  ASSERT_EQ(server.Bind(sfd, listener, Addr("10.0.0.2", kServicePort)), 0);
  ASSERT_EQ(server.Listen(sfd, listener), 0);
  const rdma_ucm_query_addr_resp before = server.QueryAddr(sfd, listener);
  ASSERT_TRUE(server.cm().CheckMovable().ok());
  ASSERT_TRUE(server.cm().Release().ok());
  server.kernel().MoveTo(c_);
  const Status st = server.cm().Restore({});
  ASSERT_TRUE(st.ok()) << st.message;
  const rdma_ucm_query_addr_resp after = server.QueryAddr(sfd, listener);
  EXPECT_EQ(memcmp(&after.src_addr, &before.src_addr, sizeof before.src_addr), 0)
      << "the address the program saw";
  uint32_t lid, sid;
  Connect(&later, lfd, &server, sfd, "10.0.0.3", &lid, &sid, listener + 1);
  EXPECT_EQ(server.Destroy(sfd, listener), 1);
}

TEST_F(CmTest, MovedServerListensAgainAndReconnectsItsChild) {
  Process server(b_), client(a_), later(a_);
  const int sfd = server.Channel(), cfd = client.Channel(), lfd = later.Channel();
  SetNonblocking(sfd);
  SetNonblocking(cfd);
  Serve(&server, sfd);
  uint32_t cid, sid;
  Connect(&client, cfd, &server, sfd, "10.0.0.2", &cid, &sid, 2);

  const std::vector<QpView> client_qps = {Qp(kClientQpn, 0x9001, "10.0.0.2", kServerQpn)};
  ASSERT_TRUE(server.cm().CheckMovable().ok()) << server.cm().CheckMovable().message;
  client.cm().MarkToward(MappedGid("10.0.0.2"), client_qps);
  ASSERT_TRUE(server.cm().Release().ok());
  EXPECT_EQ(b_->ids(), 0u);
  EXPECT_TRUE(NoEvent(client, cfd));  // the release's DISCONNECTED is the move's

  server.kernel().MoveTo(c_);
  const std::vector<QpView> server_qps = {Qp(kServerQpn, 0x8003, "10.0.0.1", kClientQpn)};
  const Status restored = server.cm().Restore(server_qps);
  ASSERT_TRUE(restored.ok()) << restored.message;
  const std::vector<CmRendezvous> rv = server.cm().Rendezvous();
  ASSERT_EQ(rv.size(), 1u);
  EXPECT_EQ(rv[0].virtual_qpn, kServerQpn);
  RemoteMapping moved;
  moved.virtual_gid = MappedGid("10.0.0.2");
  moved.physical_gid = MappedGid("10.0.0.3");
  moved.cm_rendezvous = {{rv[0].virtual_qpn, rv[0].port}};
  const Status st = client.cm().PeerReconnect({moved}, client_qps);
  ASSERT_TRUE(st.ok()) << st.message;
  const auto resume_started = std::chrono::steady_clock::now();
  ASSERT_TRUE(server.cm().Resume().ok());
  EXPECT_LT(std::chrono::steady_clock::now() - resume_started, std::chrono::seconds(5))
      << "Resume waited for a rendezvous that had completed";

  // The listener, made again on the new host, takes a new client.
  uint32_t lid, sid2;
  Connect(&later, lfd, &server, sfd, "10.0.0.3", &lid, &sid2, 3);

  ASSERT_EQ(client.Disconnect(cfd, cid), 0);
  EXPECT_TRUE(IsEvent(server, sfd, kCmDisconnected, kServerUid, sid));
  EXPECT_TRUE(NoEvent(server, sfd));
  EXPECT_TRUE(IsEvent(client, cfd, kCmDisconnected, kClientUid, cid));
  EXPECT_EQ(client.Destroy(cfd, cid), 4);
  EXPECT_EQ(server.Destroy(sfd, sid), 2);        // ESTABLISHED, DISCONNECTED
  EXPECT_EQ(server.Destroy(sfd, listener_), 2);  // two CONNECT_REQUESTs
  EXPECT_EQ(server.Destroy(sfd, sid2), 1);       // ESTABLISHED
}

TEST_F(CmTest, CheckMovableRefusesIdsBetweenStates) {
  Process server(b_), client(a_);
  const int sfd = server.Channel(), cfd = client.Channel();
  SetNonblocking(sfd);
  const uint32_t idle = client.CreateId(cfd, 0x31);
  EXPECT_TRUE(client.cm().CheckMovable().ok());
  ASSERT_EQ(client.Bind(cfd, idle, Addr("10.0.0.1", 0)), 0);
  EXPECT_TRUE(client.cm().CheckMovable().ok()) << "a bound id";
  Serve(&server, sfd);
  EXPECT_TRUE(server.cm().CheckMovable().ok()) << "a listener";

  const uint32_t cid = client.CreateId(cfd, kClientUid);
  ASSERT_EQ(client.ResolveAddr(cfd, cid, Addr("10.0.0.2", kServicePort)), 0);
  Status st = client.cm().CheckMovable();
  EXPECT_EQ(st.code, Code::kFailedPrecondition);
  EXPECT_NE(st.message.find("resolving an address"), std::string::npos) << st.message;
  EXPECT_TRUE(IsEvent(client, cfd, kCmAddrResolved, kClientUid, cid));
  ASSERT_EQ(client.ResolveRoute(cfd, cid), 0);
  EXPECT_TRUE(IsEvent(client, cfd, kCmRouteResolved, kClientUid, cid));
  ASSERT_EQ(client.Connect(cfd, cid, kClientQpn, "hi"), 0);
  rdma_ucm_event_resp req;
  ASSERT_EQ(server.GetEvent(sfd, &req), 0);
  ASSERT_EQ(req.event, kCmConnectRequest);
  st = server.cm().CheckMovable();
  EXPECT_EQ(st.code, Code::kFailedPrecondition);
  EXPECT_NE(st.message.find("connect request received, not yet accepted"), std::string::npos)
      << st.message;

  ASSERT_EQ(server.Accept(sfd, req.id, kServerUid, kServerQpn), 0);
  EXPECT_TRUE(IsEvent(client, cfd, kCmConnectResponse, kClientUid, cid));
  ASSERT_EQ(client.Accept(cfd, cid, 0, 0), 0);
  EXPECT_TRUE(IsEvent(server, sfd, kCmEstablished, kServerUid, req.id));
  st = server.cm().CheckMovable();
  EXPECT_TRUE(st.ok()) << st.message;
  st = client.cm().CheckMovable();
  EXPECT_TRUE(st.ok()) << st.message;
}

// The client disconnects while the server is quiesced; the server's
// DISCONNECTED, still the kernel's at its release, comes after the restore,
// once.
TEST_F(CmTest, EventPendingAtReleaseIsDeliveredOnceAfterRestore) {
  Process server(b_), client(a_);
  const int sfd = server.Channel(), cfd = client.Channel();
  SetNonblocking(sfd);
  Serve(&server, sfd);
  uint32_t cid, sid;
  Connect(&client, cfd, &server, sfd, "10.0.0.2", &cid, &sid, 2);
  ASSERT_TRUE(server.cm().CheckMovable().ok());
  ASSERT_EQ(client.Disconnect(cfd, cid), 0);
  ASSERT_TRUE(server.cm().Release().ok());
  server.kernel().MoveTo(c_);
  const Status st = server.cm().Restore({Qp(kServerQpn, 0x8003, "10.0.0.1", kClientQpn)});
  ASSERT_TRUE(st.ok()) << st.message;
  EXPECT_TRUE(server.cm().Rendezvous().empty());
  ASSERT_TRUE(server.cm().Resume().ok());
  EXPECT_TRUE(IsEvent(server, sfd, kCmDisconnected, kServerUid, sid));
  EXPECT_TRUE(NoEvent(server, sfd));
  EXPECT_EQ(server.Destroy(sfd, sid), 2);  // ESTABLISHED, DISCONNECTED
  EXPECT_EQ(server.Destroy(sfd, listener_), 1);
  EXPECT_EQ(b_->ids() + c_->ids(), 0u);
}

// xa_alloc() gives handle 0 whenever no RDMA CM id exists on the machine:
// the first id of a freshly started host's first program.
TEST_F(CmTest, KernelHandleZeroIsAnId) {
  fabric_.SetFirstHandle(0);
  Process p(a_);
  const int fd = p.Channel();
  const uint32_t id = p.CreateId(fd, 0x41);
  EXPECT_EQ(p.Bind(fd, id, Addr("10.0.0.1", 0)), 0);
  EXPECT_EQ(p.Listen(fd, id), 0);
  EXPECT_EQ(a_->ids(), 1u);
  EXPECT_EQ(p.Destroy(fd, id), 0);
  EXPECT_EQ(a_->ids(), 0u) << "DESTROY_ID never reached the kernel's id 0";
}

// rping's main thread destroys its channel while its CM thread waits in
// rdma_get_cm_event: the kernel's wait holds the file and goes on (no
// event will come) until a signal whose handler lacks SA_RESTART ends it.
// The wait ended with EINVAL, which rping printed and exited with.
TEST_F(CmTest, AWaitOnAChannelDestroyedMeanwhileLastsUntilASignalEndsIt) {
  struct sigaction sa {};
  sa.sa_handler = [](int) {};  // no SA_RESTART
  struct sigaction old {};
  ASSERT_EQ(sigaction(SIGUSR1, &sa, &old), 0);
  Process p(a_);
  const int fd = p.Channel();
  std::atomic<pthread_t> waiter{};
  std::atomic<pid_t> tid{0};
  auto waiting = std::async(std::launch::async, [&] {
    waiter = pthread_self();
    tid = gettid();
    rdma_ucm_event_resp ev{};
    return p.GetEvent(fd, &ev);
  });
  // Until the waiter is in its poll(2) (on a loaded machine its thread may
  // start late: before, the channel was destroyed before it asked, and
  // its EINVAL failed the test).
  const auto started = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto in_poll = [&tid] {
    if (tid.load() == 0) return false;
    std::ifstream f("/proc/self/task/" + std::to_string(tid.load()) + "/syscall");
    long nr = -1;
    f >> nr;
    return nr == SYS_poll || nr == SYS_ppoll;
  };
  while (!in_poll() && std::chrono::steady_clock::now() < started)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(in_poll()) << "the waiter never waited";
  EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  p.cm().Forget(fd);  // rdma_destroy_event_channel, then librdmacm's close
  close(fd);
  EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "the wait ended when its channel was destroyed";
  // A signal ends it as it would end the kernel's; repeated, since the
  // thread may be between two waits when one comes.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (waiting.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready &&
         std::chrono::steady_clock::now() < deadline)
    pthread_kill(waiter.load(), SIGUSR1);
  ASSERT_EQ(waiting.wait_for(std::chrono::seconds(0)), std::future_status::ready);
  EXPECT_EQ(waiting.get(), EINTR);
  sigaction(SIGUSR1, &old, nullptr);
}

}  // namespace
}  // namespace rdmavirt::shim::testing
