// The serialized endpoint state keeps every field across a round trip,
// and bytes that are not a state are refused by the parser.
#include <string>

#include "gtest/gtest.h"
#include "rdmavirt/v1/endpoint_state.pb.h"

namespace rdmavirt {
namespace {

v1::EndpointState SampleState() {
  v1::EndpointState s;
  s.set_format_version(v1::STATE_FORMAT_V1);
  s.set_endpoint_id("host1/4242");
  auto* mr = s.add_mrs();
  mr->set_vhandle(3);
  mr->set_addr(0x7f0000001000);
  mr->set_length(1 << 20);
  mr->set_virtual_lkey(0x10000301);
  auto* qp = s.add_qps();
  qp->set_virtual_qpn(0x100011);
  auto* t = qp->add_transitions();
  t->set_qp_state(3);  // RTR
  t->mutable_ah_attr()->mutable_grh()->mutable_dgid()->set_raw(std::string(16, '\x7f'));
  auto* wr = qp->add_outstanding_recvs();
  wr->set_wr_id(77);
  wr->add_sg_list()->set_lkey(0x10000301);
  return s;
}

TEST(EndpointStateTest, RoundTripKeepsEveryField) {
  const v1::EndpointState s = SampleState();
  std::string bytes;
  ASSERT_TRUE(s.SerializeToString(&bytes));
  v1::EndpointState back;
  ASSERT_TRUE(back.ParseFromString(bytes));
  EXPECT_EQ(back.SerializeAsString(), bytes);
  EXPECT_EQ(back.qps(0).transitions(0).ah_attr().grh().dgid().raw(), std::string(16, '\x7f'));
  EXPECT_EQ(back.qps(0).outstanding_recvs(0).sg_list(0).lkey(), 0x10000301u);
}

TEST(EndpointStateTest, TruncatedBytesAreRefused) {
  std::string bytes = SampleState().SerializeAsString();
  bytes.resize(bytes.size() - 3);  // cuts into the last field
  v1::EndpointState back;
  EXPECT_FALSE(back.ParseFromString(bytes));
}

}  // namespace
}  // namespace rdmavirt
