// The gRPC face of a Migrator: Operator (for rdmavirtctl) and Transfer (for
// other migrators), protos/rdmavirt/v1/migrator.proto. Thin: requests go
// to the Migrator as they are, its absl::Status codes go back unchanged
// (they are gRPC's). Called by gRPC's threads; the Migrator is thread-safe.
//
// Who may call: the Operator service admits operators' certificates (the
// CLI's) and the Transfer service hosts' (other migrators'), by the role of
// the certificate the caller presented (certificates.h); a refused call is
// PERMISSION_DENIED saying why, and the daemon logs it.
#ifndef RDMAVIRT_MIGRATOR_TRANSPORT_GRPC_SERVICE_H_
#define RDMAVIRT_MIGRATOR_TRANSPORT_GRPC_SERVICE_H_

#include "migrator/move/migrator.h"
#include "migrator/transport/certificates.h"
#include "rdmavirt/v1/migrator.grpc.pb.h"

namespace rdmavirt::migrator {

grpc::Status ToGrpc(const absl::Status& status);

// kByCertificate is the daemon's only mode. kAnyone skips the check, for
// servers without TLS (unit tests over unix sockets), where no caller has a
// certificate.
enum class Admission { kByCertificate, kAnyone };

// Admits the callers of one service by the role of their certificate.
class Gate {
 public:
  Gate(const char* service, CertRole role, Admission admission)
      : service_(service), role_(role), admission_(admission) {}
  // `call()` if the caller may make it, else PERMISSION_DENIED (or
  // UNAUTHENTICATED for a caller without a certificate).
  template <typename Call>
  grpc::Status Admit(const grpc::ServerContext& ctx, const char* method, Call call) const {
    grpc::Status refused = Check(ctx, method);
    return refused.ok() ? call() : refused;
  }

 private:
  grpc::Status Check(const grpc::ServerContext& ctx, const char* method) const;
  const char* const service_;
  const CertRole role_;
  const Admission admission_;
};

class OperatorService final : public v1::Operator::Service {
 public:
  explicit OperatorService(Migrator* migrator, Admission admission = Admission::kByCertificate)
      : m_(migrator), gate_("Operator", CertRole::kOperator, admission) {}
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
  grpc::Status ListHosts(grpc::ServerContext*, const v1::ListHostsRequest*,
                         v1::ListHostsResponse* out) override;
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
  const Gate gate_;
};

class TransferService final : public v1::Transfer::Service {
 public:
  explicit TransferService(Migrator* migrator, Admission admission = Admission::kByCertificate)
      : m_(migrator), gate_("Transfer", CertRole::kHost, admission) {}
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
  const Gate gate_;
};

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_TRANSPORT_GRPC_SERVICE_H_
