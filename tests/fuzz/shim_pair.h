// Two migratable endpoints for the shim's fuzz targets and their seeds: P
// and Q, Shims over one FakeBackend (as tests/shim/migration_test.cc has
// them), each with an open device, a PD, a CQ and a registered buffer. Q
// also holds an RC and a UC QP connected to P's, a UD QP with an AH toward
// P, and an SRQ with a QP on it, receives posted on each. The control
// requests of an input act on Q; P is the peer whose moves they announce.
//
// Single-threaded, like a fuzz target.
#ifndef RDMAVIRT_TESTS_FUZZ_SHIM_PAIR_H_
#define RDMAVIRT_TESTS_FUZZ_SHIM_PAIR_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <string>
#include <vector>

#include "shim/core/shim.h"
#include "tests/shim/fake_backend.h"

namespace rdmavirt::fuzz {

class ShimPair {
 public:
  // Fail()s when a verb the setup needs fails.
  ShimPair();
  // Destroys what Close() has not.
  ~ShimPair();
  ShimPair(const ShimPair&) = delete;
  ShimPair& operator=(const ShimPair&) = delete;

  shim::Shim& p() { return p_.shim; }
  shim::Shim& q() { return q_.shim; }

  // One step of Q's application, chosen by `op`: a send, an RDMA write or a
  // UD send posted, a receive posted (QP or SRQ), the CQ polled. Whatever
  // the verb returns is the shim's business; a crash is not.
  void AppStep(uint8_t op);

  // Destroys every object of both endpoints through their shims, then
  // Fail()s if any verb of the teardown failed or the shims did not give
  // every real object back to the device.
  void CloseAndCheck();

 private:
  struct Side {
    explicit Side(shim::VerbsBackend* backend) : shim(backend, shim::IdentityMode{}, true) {}
    shim::Shim shim;
    ibv_context* ctx = nullptr;
    ibv_pd* pd = nullptr;
    ibv_cq* cq = nullptr;
    ibv_mr* mr = nullptr;
    ibv_srq* srq = nullptr;
    std::vector<ibv_qp*> qps;
    std::vector<ibv_ah*> ahs;
    ibv_gid gid{};
    char buf[8192] = {};
  };

  void Open(Side* s);
  ibv_qp* Qp(Side* s, ibv_qp_type type, ibv_srq* srq = nullptr);
  // Fail()s unless every call returned 0.
  static void ToRts(Side* s, ibv_qp* qp, uint32_t dest_qpn, const ibv_gid& dgid);
  void PostRecv(ibv_qp* qp, uint64_t wr_id);
  // Destroys the side's objects; the first verb that failed, and why.
  static std::string Destroy(Side* s);

  shim::FakeBackend fake_;
  Side p_{&fake_};
  Side q_{&fake_};
  ibv_qp* q_rc_ = nullptr;
  ibv_qp* q_uc_ = nullptr;
  ibv_qp* q_ud_ = nullptr;
  ibv_qp* q_srq_qp_ = nullptr;
  ibv_qp* p_ud_ = nullptr;
  ibv_ah* q_ah_ = nullptr;
  uint64_t next_wr_id_ = 1;
  bool closed_ = false;
};

}  // namespace rdmavirt::fuzz

#endif  // RDMAVIRT_TESTS_FUZZ_SHIM_PAIR_H_
