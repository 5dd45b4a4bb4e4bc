#include "migrator/transport/grpc_service.h"

#include "absl/strings/str_cat.h"
#include "migrator/host/log.h"

namespace rdmavirt::migrator {
namespace {

template <typename T>
grpc::Status Reply(absl::StatusOr<T> result, T* out) {
  if (!result.ok()) return ToGrpc(result.status());
  *out = *std::move(result);
  return grpc::Status::OK;
}

// Progress goes to the client while it listens; a client that went away
// does not stop the move (it is finished or rolled back all the same).
Migrator::ProgressSink Sink(grpc::ServerWriter<v1::Progress>* writer) {
  return [writer](const v1::Progress& p) { writer->Write(p); };
}

}  // namespace

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

grpc::Status Gate::Check(const grpc::ServerContext& ctx, const char* method) const {
  if (admission_ == Admission::kAnyone) return grpc::Status::OK;
  absl::StatusOr<CertInfo> caller = CallerCertificate(ctx);
  std::string why;
  if (!caller.ok()) {
    why = std::string(caller.status().message());
  } else if (caller->role != role_) {
    why = absl::StrCat("the ", service_, " service takes ",
                       role_ == CertRole::kHost ? "a host's certificate (a migrator's)"
                                                : "an operator's certificate (the CLI's)",
                       " and ", caller->subject, " is ",
                       caller->role == CertRole::kHost ? "a host's" : "an operator's");
  } else {
    return grpc::Status::OK;
  }
  Log("refused %s.%s from %s: %s", service_, method, ctx.peer(), why);
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, why);
}

grpc::Status OperatorService::GetHostInfo(grpc::ServerContext* ctx, const v1::HostInfoRequest*,
                                          v1::HostInfo* out) {
  return gate_.Admit(*ctx, "GetHostInfo", [&] {
    *out = m_->GetHostInfo();
    return grpc::Status::OK;
  });
}

grpc::Status OperatorService::ListEndpoints(grpc::ServerContext* ctx,
                                            const v1::ListEndpointsRequest*,
                                            v1::ListEndpointsResponse* out) {
  return gate_.Admit(*ctx, "ListEndpoints", [&] {
    *out = m_->ListEndpoints();
    return grpc::Status::OK;
  });
}

grpc::Status OperatorService::Migrate(grpc::ServerContext* ctx, const v1::MigrateRequest* request,
                                      grpc::ServerWriter<v1::Progress>* writer) {
  return gate_.Admit(*ctx, "Migrate", [&] { return ToGrpc(m_->Migrate(*request, Sink(writer))); });
}

grpc::Status OperatorService::Checkpoint(grpc::ServerContext* ctx,
                                         const v1::CheckpointRequest* request,
                                         grpc::ServerWriter<v1::Progress>* writer) {
  return gate_.Admit(*ctx, "Checkpoint",
                     [&] { return ToGrpc(m_->Checkpoint(*request, Sink(writer))); });
}

grpc::Status OperatorService::Restore(grpc::ServerContext* ctx, const v1::RestoreRequest* request,
                                      grpc::ServerWriter<v1::Progress>* writer) {
  return gate_.Admit(*ctx, "Restore", [&] { return ToGrpc(m_->Restore(*request, Sink(writer))); });
}

grpc::Status OperatorService::Status(grpc::ServerContext* ctx, const v1::StatusRequest* request,
                                     v1::StatusResponse* out) {
  return gate_.Admit(*ctx, "Status", [&] {
    *out = m_->Status(request->all());
    return grpc::Status::OK;
  });
}

grpc::Status OperatorService::ListHosts(grpc::ServerContext* ctx, const v1::ListHostsRequest*,
                                        v1::ListHostsResponse* out) {
  return gate_.Admit(*ctx, "ListHosts", [&] { return Reply(m_->ListHosts(), out); });
}

grpc::Status OperatorService::Suspend(grpc::ServerContext* ctx, const v1::SuspendRequest* request,
                                      v1::GuestReport* out) {
  return gate_.Admit(*ctx, "Suspend", [&] { return Reply(m_->Suspend(*request), out); });
}

grpc::Status OperatorService::Resume(grpc::ServerContext* ctx, const v1::ResumeRequest* request,
                                     v1::GuestReport* out) {
  return gate_.Admit(*ctx, "Resume", [&] { return Reply(m_->Resume(*request), out); });
}

grpc::Status OperatorService::GuestEvent(grpc::ServerContext* ctx,
                                         const v1::GuestEventRequest* request,
                                         v1::GuestEventResponse*) {
  return gate_.Admit(*ctx, "GuestEvent", [&] { return ToGrpc(m_->GuestEvent(*request)); });
}

grpc::Status OperatorService::AllocateGuestNic(grpc::ServerContext* ctx,
                                               const v1::AllocateGuestNicRequest* request,
                                               v1::GuestNic* out) {
  return gate_.Admit(*ctx, "AllocateGuestNic",
                     [&] { return Reply(m_->AllocateGuestNic(*request), out); });
}

grpc::Status TransferService::Prepare(grpc::ServerContext* ctx, const v1::PrepareRequest* request,
                                      v1::PrepareResponse* out) {
  return gate_.Admit(*ctx, "Prepare", [&] { return Reply(m_->Prepare(*request), out); });
}

grpc::Status TransferService::PushImages(grpc::ServerContext* ctx,
                                         grpc::ServerReader<v1::ImageChunk>* reader,
                                         v1::PushImagesResponse* out) {
  return gate_.Admit(*ctx, "PushImages", [&] {
    return Reply(m_->PushImages([reader](v1::ImageChunk* c) { return reader->Read(c); }), out);
  });
}

grpc::Status TransferService::RestoreIncoming(grpc::ServerContext* ctx,
                                              const v1::RestoreIncomingRequest* request,
                                              v1::RestoreIncomingResponse* out) {
  return gate_.Admit(*ctx, "RestoreIncoming",
                     [&] { return Reply(m_->RestoreIncoming(*request), out); });
}

grpc::Status TransferService::AbortIncoming(grpc::ServerContext* ctx,
                                            const v1::AbortIncomingRequest* request,
                                            v1::AbortIncomingResponse*) {
  return gate_.Admit(*ctx, "AbortIncoming", [&] { return ToGrpc(m_->AbortIncoming(*request)); });
}

grpc::Status TransferService::QuiescePeers(grpc::ServerContext* ctx,
                                           const v1::QuiescePeersRequest* request,
                                           v1::QuiescePeersResponse* out) {
  return gate_.Admit(*ctx, "QuiescePeers", [&] { return Reply(m_->QuiescePeers(*request), out); });
}

grpc::Status TransferService::ReconnectPeers(grpc::ServerContext* ctx,
                                             const v1::ReconnectPeersRequest* request,
                                             v1::ReconnectPeersResponse* out) {
  return gate_.Admit(*ctx, "ReconnectPeers",
                     [&] { return Reply(m_->ReconnectPeers(*request), out); });
}

}  // namespace rdmavirt::migrator
