#include "migrator/grpc_service.h"

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

grpc::Status OperatorService::GetHostInfo(grpc::ServerContext*, const v1::HostInfoRequest*,
                                          v1::HostInfo* out) {
  *out = m_->GetHostInfo();
  return grpc::Status::OK;
}

grpc::Status OperatorService::ListEndpoints(grpc::ServerContext*, const v1::ListEndpointsRequest*,
                                            v1::ListEndpointsResponse* out) {
  *out = m_->ListEndpoints();
  return grpc::Status::OK;
}

grpc::Status OperatorService::Migrate(grpc::ServerContext*, const v1::MigrateRequest* request,
                                      grpc::ServerWriter<v1::Progress>* writer) {
  return ToGrpc(m_->Migrate(*request, Sink(writer)));
}

grpc::Status OperatorService::Checkpoint(grpc::ServerContext*, const v1::CheckpointRequest* request,
                                         grpc::ServerWriter<v1::Progress>* writer) {
  return ToGrpc(m_->Checkpoint(*request, Sink(writer)));
}

grpc::Status OperatorService::Restore(grpc::ServerContext*, const v1::RestoreRequest* request,
                                      grpc::ServerWriter<v1::Progress>* writer) {
  return ToGrpc(m_->Restore(*request, Sink(writer)));
}

grpc::Status OperatorService::Status(grpc::ServerContext*, const v1::StatusRequest*,
                                     v1::StatusResponse* out) {
  *out = m_->Status();
  return grpc::Status::OK;
}

grpc::Status OperatorService::Suspend(grpc::ServerContext*, const v1::SuspendRequest* request,
                                      v1::GuestReport* out) {
  return Reply(m_->Suspend(*request), out);
}

grpc::Status OperatorService::Resume(grpc::ServerContext*, const v1::ResumeRequest* request,
                                     v1::GuestReport* out) {
  return Reply(m_->Resume(*request), out);
}

grpc::Status OperatorService::GuestEvent(grpc::ServerContext*, const v1::GuestEventRequest* request,
                                         v1::GuestEventResponse*) {
  return ToGrpc(m_->GuestEvent(*request));
}

grpc::Status OperatorService::AllocateGuestNic(grpc::ServerContext*,
                                               const v1::AllocateGuestNicRequest* request,
                                               v1::GuestNic* out) {
  return Reply(m_->AllocateGuestNic(*request), out);
}

grpc::Status TransferService::Prepare(grpc::ServerContext*, const v1::PrepareRequest* request,
                                      v1::PrepareResponse* out) {
  return Reply(m_->Prepare(*request), out);
}

grpc::Status TransferService::PushImages(grpc::ServerContext*,
                                         grpc::ServerReader<v1::ImageChunk>* reader,
                                         v1::PushImagesResponse* out) {
  return Reply(m_->PushImages([reader](v1::ImageChunk* c) { return reader->Read(c); }), out);
}

grpc::Status TransferService::RestoreIncoming(grpc::ServerContext*,
                                              const v1::RestoreIncomingRequest* request,
                                              v1::RestoreIncomingResponse* out) {
  return Reply(m_->RestoreIncoming(*request), out);
}

grpc::Status TransferService::AbortIncoming(grpc::ServerContext*,
                                            const v1::AbortIncomingRequest* request,
                                            v1::AbortIncomingResponse*) {
  return ToGrpc(m_->AbortIncoming(*request));
}

grpc::Status TransferService::QuiescePeers(grpc::ServerContext*,
                                           const v1::QuiescePeersRequest* request,
                                           v1::QuiescePeersResponse* out) {
  return Reply(m_->QuiescePeers(*request), out);
}

grpc::Status TransferService::ReconnectPeers(grpc::ServerContext*,
                                             const v1::ReconnectPeersRequest* request,
                                             v1::ReconnectPeersResponse* out) {
  return Reply(m_->ReconnectPeers(*request), out);
}

}  // namespace rdmavirt::migrator
