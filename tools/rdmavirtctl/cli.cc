#include "tools/rdmavirtctl/cli.h"

#include <chrono>

#include "google/protobuf/util/json_util.h"
#include "migrator/tls.h"

namespace rdmavirt::ctl {

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

int Client::Connect() {
  absl::StatusOr<migrator::TlsFiles> tls = migrator::LoadTls(tls_dir_, "cli.pem", "cli.key");
  if (!tls.ok()) {
    fprintf(stderr, "rdmavirtctl: %s\n", std::string(tls.status().message()).c_str());
    return kUnreachable;
  }
  channel_ = grpc::CreateChannel(target_, migrator::MutualTlsChannelCredentials(*tls));
  if (!channel_->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
    fprintf(stderr,
            "rdmavirtctl: cannot reach rdmavirt-migratord at %s (is it running there, and "
            "are its certificates and those in %s of the same CA?)\n",
            target_.c_str(), tls_dir_.c_str());
    return kUnreachable;
  }
  stub_ = v1::Operator::NewStub(channel_);
  return kOk;
}

int Client::Failed(const char* what, const grpc::Status& st) {
  fprintf(stderr, "rdmavirtctl: %s: %s (%s)\n", what, st.error_message().c_str(),
          CodeName(st.error_code()));
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE &&
      channel_->GetState(false) != GRPC_CHANNEL_READY)
    return kUnreachable;
  return kFailed;
}

const char* Client::CodeName(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

}  // namespace rdmavirt::ctl
