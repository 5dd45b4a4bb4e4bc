// The gRPC face of a Migrator: Operator (for rdmavirtctl) and Transfer (for
// other migrators), protos/rdmavirt/v1/migrator.proto. Thin: requests go
// to the Migrator as they are, its absl::Status codes go back unchanged
// (they are gRPC's). Called by gRPC's threads; the Migrator is thread-safe.
#ifndef RDMAVIRT_MIGRATOR_GRPC_SERVICE_H_
#define RDMAVIRT_MIGRATOR_GRPC_SERVICE_H_

#include "migrator/migrator.h"
#include "rdmavirt/v1/migrator.grpc.pb.h"

namespace rdmavirt::migrator {

grpc::Status ToGrpc(const absl::Status& status);

class OperatorService final : public v1::Operator::Service {
 public:
  explicit OperatorService(Migrator* migrator) : m_(migrator) {}
  grpc::Status GetHostInfo(grpc::ServerContext*, const v1::HostInfoRequest*,
                           v1::HostInfo* out) override;
  grpc::Status ListEndpoints(grpc::ServerContext*, const v1::ListEndpointsRequest*,
                             v1::ListEndpointsResponse* out) override;
  grpc::Status Migrate(grpc::ServerContext*, const v1::MigrateRequest* request,
                       grpc::ServerWriter<v1::Progress>* writer) override;
  grpc::Status Checkpoint(grpc::ServerContext*, const v1::CheckpointRequest* request,
                          grpc::ServerWriter<v1::Progress>* writer) override;
  grpc::Status Restore(grpc::ServerContext*, const v1::RestoreRequest* request,
                       grpc::ServerWriter<v1::Progress>* writer) override;
  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*,
                      v1::StatusResponse* out) override;
  grpc::Status Suspend(grpc::ServerContext*, const v1::SuspendRequest* request,
                       v1::GuestReport* out) override;
  grpc::Status Resume(grpc::ServerContext*, const v1::ResumeRequest* request,
                      v1::GuestReport* out) override;
  grpc::Status GuestEvent(grpc::ServerContext*, const v1::GuestEventRequest* request,
                          v1::GuestEventResponse* out) override;
  grpc::Status AllocateGuestNic(grpc::ServerContext*, const v1::AllocateGuestNicRequest* request,
                                v1::GuestNic* out) override;

 private:
  Migrator* const m_;
};

class TransferService final : public v1::Transfer::Service {
 public:
  explicit TransferService(Migrator* migrator) : m_(migrator) {}
  grpc::Status Prepare(grpc::ServerContext*, const v1::PrepareRequest* request,
                       v1::PrepareResponse* out) override;
  grpc::Status PushImages(grpc::ServerContext*, grpc::ServerReader<v1::ImageChunk>* reader,
                          v1::PushImagesResponse* out) override;
  grpc::Status RestoreIncoming(grpc::ServerContext*, const v1::RestoreIncomingRequest* request,
                               v1::RestoreIncomingResponse* out) override;
  grpc::Status AbortIncoming(grpc::ServerContext*, const v1::AbortIncomingRequest* request,
                             v1::AbortIncomingResponse* out) override;
  grpc::Status QuiescePeers(grpc::ServerContext*, const v1::QuiescePeersRequest* request,
                            v1::QuiescePeersResponse* out) override;
  grpc::Status ReconnectPeers(grpc::ServerContext*, const v1::ReconnectPeersRequest* request,
                              v1::ReconnectPeersResponse* out) override;

 private:
  Migrator* const m_;
};

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_GRPC_SERVICE_H_
