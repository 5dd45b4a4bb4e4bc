#include "tests/bench/data_path_fixture.h"

#include <errno.h>
#include <string.h>

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace rdmavirt::bench {
namespace {

constexpr uint32_t kMessage = 64;

absl::Status VerbError(const char* verb) {
  const int err = errno;
  return absl::ErrnoToStatus(err, absl::StrCat(verb, ": ", strerror(err)));
}

// Builds the stack with `api`: the NullBackend itself or a Shim over it,
// which have the same verbs under the same names.
template <typename Api>
absl::Status Build(Api* api, ibv_device* device, char* buffer, size_t length, DataPathStack* s) {
  s->ctx = api->OpenDevice(device);
  if (s->ctx == nullptr) return VerbError("ibv_open_device");
  s->pd = api->AllocPd(s->ctx);
  if (s->pd == nullptr) return VerbError("ibv_alloc_pd");
  const unsigned int access =
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  s->mr = api->RegMr(s->pd, buffer, length, reinterpret_cast<uintptr_t>(buffer), access);
  if (s->mr == nullptr) return VerbError("ibv_reg_mr");
  s->send_cq = api->CreateCq(s->ctx, kQueueDepth, nullptr, nullptr, 0);
  if (s->send_cq == nullptr) return VerbError("ibv_create_cq");
  s->recv_cq = api->CreateCq(s->ctx, kQueueDepth, nullptr, nullptr, 0);
  if (s->recv_cq == nullptr) return VerbError("ibv_create_cq");
  ibv_qp_init_attr init{};
  init.send_cq = s->send_cq;
  init.recv_cq = s->recv_cq;
  init.cap.max_send_wr = kQueueDepth;
  init.cap.max_recv_wr = kQueueDepth;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.qp_type = IBV_QPT_RC;
  s->qp = api->CreateQp(s->pd, &init);
  if (s->qp == nullptr) return VerbError("ibv_create_qp");

  const uint64_t addr = reinterpret_cast<uintptr_t>(buffer);
  s->send_sge = {.addr = addr, .length = kMessage, .lkey = s->mr->lkey};
  s->write_sge = s->send_sge;
  s->recv_sge = {.addr = addr + kMessage, .length = kMessage, .lkey = s->mr->lkey};

  s->send.wr_id = 1;
  s->send.sg_list = &s->send_sge;
  s->send.num_sge = 1;
  s->send.opcode = IBV_WR_SEND;
  s->send.send_flags = IBV_SEND_SIGNALED;

  s->write.wr_id = 2;
  s->write.sg_list = &s->write_sge;
  s->write.num_sge = 1;
  s->write.opcode = IBV_WR_RDMA_WRITE;
  s->write.send_flags = IBV_SEND_SIGNALED;
  s->write.wr.rdma.remote_addr = addr + 2 * kMessage;
  s->write.wr.rdma.rkey = s->mr->rkey;

  s->recv.wr_id = 3;
  s->recv.sg_list = &s->recv_sge;
  s->recv.num_sge = 1;
  return absl::OkStatus();
}

// Undoes Build, from whatever point it reached.
template <typename Api>
void Destroy(Api* api, DataPathStack* s) {
  if (s->qp != nullptr) api->DestroyQp(s->qp);
  if (s->recv_cq != nullptr) api->DestroyCq(s->recv_cq);
  if (s->send_cq != nullptr) api->DestroyCq(s->send_cq);
  if (s->mr != nullptr) api->DeregMr(s->mr);
  if (s->pd != nullptr) api->DeallocPd(s->pd);
  if (s->ctx != nullptr) api->CloseDevice(s->ctx);
  *s = DataPathStack{};
}

}  // namespace

DataPathFixture::DataPathFixture()
    : shim_(&backend_, shim::IdentityMode{.offset = false}),
      offset_shim_(&backend_, shim::IdentityMode{.offset = true}),
      migratable_shim_(&backend_, shim::IdentityMode{}, /*migratable=*/true, /*probed=*/true),
      migratable_offset_shim_(&backend_, shim::IdentityMode{.offset = true}, /*migratable=*/true,
                              /*probed=*/true) {}

DataPathFixture::~DataPathFixture() {
  for (int i = kThreads - 1; i >= 0; --i) {
    Destroy(&migratable_shim_, &migratable_threads_[i]);
    Destroy(&backend_, &direct_threads_[i]);
  }
  Destroy(&migratable_offset_shim_, &migratable_offset_stack_);
  Destroy(&migratable_shim_, &migratable_stack_);
  Destroy(&offset_shim_, &offset_stack_);
  Destroy(&shim_, &shim_stack_);
  Destroy(&backend_, &direct_);
}

absl::StatusOr<std::unique_ptr<DataPathFixture>> DataPathFixture::Create() {
  std::unique_ptr<DataPathFixture> f(new DataPathFixture());
  int num = 0;
  ibv_device** devices = f->backend_.GetDeviceList(&num);
  if (devices == nullptr || num < 1) return absl::NotFoundError("null backend: no device");
  ibv_device* device = devices[0];
  f->backend_.FreeDeviceList(devices);
  // Separate parts of the buffer, so the stacks' work requests never alias.
  char* part = f->buffer_;
  auto next = [&part] { return std::exchange(part, part + kPart); };
  absl::Status st = Build(&f->backend_, device, next(), kPart, &f->direct_);
  if (!st.ok()) return absl::Status(st.code(), absl::StrCat("direct stack: ", st.message()));
  st = Build(&f->shim_, device, next(), kPart, &f->shim_stack_);
  if (!st.ok()) return absl::Status(st.code(), absl::StrCat("shim stack: ", st.message()));
  st = Build(&f->offset_shim_, device, next(), kPart, &f->offset_stack_);
  if (!st.ok()) return absl::Status(st.code(), absl::StrCat("offset stack: ", st.message()));
  st = Build(&f->migratable_shim_, device, next(), kPart, &f->migratable_stack_);
  if (!st.ok()) return absl::Status(st.code(), absl::StrCat("migratable stack: ", st.message()));
  st = Build(&f->migratable_offset_shim_, device, next(), kPart, &f->migratable_offset_stack_);
  if (!st.ok())
    return absl::Status(st.code(), absl::StrCat("migratable offset stack: ", st.message()));
  for (int i = 0; i < kThreads; ++i) {
    st = Build(&f->backend_, device, next(), kPart, &f->direct_threads_[i]);
    if (st.ok())
      st = Build(&f->migratable_shim_, device, next(), kPart, &f->migratable_threads_[i]);
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat("thread stack: ", st.message()));
  }
  return f;
}

}  // namespace rdmavirt::bench
