// Writes the fuzz targets' seed corpora, DIR/TARGET/NAME, from the
// project's own encoders and flows: the shim's EncodeHello/EncodeReply and
// a real move of a Shim over FakeBackend, the migrator's WriteFrame,
// SendImages (into an in-process gRPC server that records the stream),
// SerializeManifestFile, and the records a Migrator over a FakeHost writes
// at every phase of a checkpoint, a failed migration and an incoming move;
// tools/rdmavirt-certs for the certificates.
//
// usage: fuzz_corpus_writer DIR      (tools/fuzz --write-corpus)
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "migrator/criu/image_dir.h"
#include "migrator/criu/image_stream.h"
#include "migrator/move/record_store.h"
#include "migrator/transport/frame.h"
#include "rdmavirt/v1/control.pb.h"
#include "rdmavirt/v1/migrator.grpc.pb.h"
#include "shim/migration/control.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/fuzz/image_fixture.h"
#include "tests/fuzz/migrator_fixture.h"
#include "tests/fuzz/shim_pair.h"

namespace rdmavirt::fuzz {
namespace {

using migrator::testing::FakeHost;

std::string g_out;

void Seed(const std::string& target, const std::string& name, const std::string& bytes) {
  const std::string dir = g_out + "/" + target;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/" + name, std::ios::binary | std::ios::trunc) << bytes;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// ---- the shim: requests, replies, frames --------------------------------

// An endpoint's mapping as its migrator carries it: from the shim's reply.
v1::Mapping MappingOf(shim::Shim& s) {
  v1::ShimToMigrator m;
  Check(m.ParseFromString(shim::EncodeReply(1, {}, s.Describe(), "ep", 1, 0, 0)),
        "a reply that does not parse");
  return m.reply().summary().mapping();
}

std::string Request(uint64_t id, const std::function<void(v1::MigratorToShim*)>& fill) {
  v1::MigratorToShim m;
  m.set_request_id(id);
  fill(&m);
  return m.SerializeAsString();
}

void ShimSeeds() {
  ShimPair pair;
  const v1::Mapping in_place = MappingOf(pair.p());
  // P moves: a new physical identity for each of its QPs and keys.
  uint32_t drained = 0;
  Check(pair.p().Quiesce(2, &drained).ok() && pair.p().Release().ok() &&
            pair.p().Restore("", {}).ok() && pair.p().Resume().ok(),
        "moving P");
  const v1::Mapping moved = MappingOf(pair.p());

  const std::string describe = Request(1, [](auto* m) { m->mutable_describe(); });
  const std::string quiesce =
      Request(2, [](auto* m) { m->mutable_quiesce()->set_drain_timeout_ms(1); });
  const std::string release = Request(3, [](auto* m) { m->mutable_release(); });
  const std::string restore = Request(4, [&](auto* m) {
    m->mutable_restore()->set_device("fake0");
    *m->mutable_restore()->add_peers() = moved;
  });
  const std::string restore_bare = Request(4, [](auto* m) { m->mutable_restore(); });
  const std::string resume = Request(5, [](auto* m) { m->mutable_resume(); });
  const std::string peer_quiesce = Request(6, [&](auto* m) {
    m->mutable_peer_quiesce()->set_virtual_gid(moved.virtual_gid());
    m->mutable_peer_quiesce()->set_drain_timeout_ms(1);
  });
  const std::string peer_reconnect =
      Request(7, [&](auto* m) { *m->mutable_peer_reconnect()->mutable_mapping() = moved; });
  const std::string reconnect_in_place =
      Request(8, [&](auto* m) { *m->mutable_peer_reconnect()->mutable_mapping() = in_place; });
  for (const auto& [name, bytes] : std::vector<std::pair<std::string, std::string>>{
           {"describe", describe},
           {"quiesce", quiesce},
           {"release", release},
           {"restore_with_peer", restore},
           {"restore", restore_bare},
           {"resume", resume},
           {"peer_quiesce", peer_quiesce},
           {"peer_reconnect", peer_reconnect},
           {"peer_reconnect_in_place", reconnect_in_place}})
    Seed("shim_control", name, bytes);

  const std::string send(1, '\0'), write(1, '\3'), post_recv(1, '\4'), poll(1, '\5');
  Seed("shim_restore", "own_move", JoinMessages({quiesce, release, restore_bare, resume}));
  Seed("shim_restore", "own_move_with_peer", JoinMessages({quiesce, release, restore, resume}));
  Seed("shim_restore", "own_move_with_traffic",
       JoinMessages(
           {send, quiesce, send, write, post_recv, release, send, restore, poll, resume, poll}));
  Seed("shim_restore", "peer_moved", JoinMessages({peer_quiesce, send, peer_reconnect, poll}));
  Seed("shim_restore", "peer_restored_in_place",
       JoinMessages({peer_quiesce, write, reconnect_in_place, poll}));
  Seed("shim_restore", "quiesce_then_rollback", JoinMessages({send, quiesce, send, resume, poll}));
  Seed("shim_restore", "describe", JoinMessages({describe}));

  // What a shim writes on its socket: Hello, then replies.
  uint32_t d = 0;
  (void)pair.q().Quiesce(2, &d);
  const std::string hello = shim::EncodeHello(4242, "0123456789abcdef", false, "integrity");
  const std::string hello_released =
      shim::EncodeHello(4242, "0123456789abcdef", true, "ib_send_bw");
  const std::string reply =
      shim::EncodeReply(1, {}, pair.q().Describe(), "0123456789abcdef", 4242, 812, 3);
  const std::string refusal = shim::EncodeReply(
      2, shim::Error(shim::Code::kFailedPrecondition, "restore needs a released endpoint"),
      pair.q().Describe(), "0123456789abcdef", 4242, 5, 0);
  (void)pair.q().Resume();
  // The migrator's framing, through a socket.
  int fds[2];
  Check(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0, "socketpair");
  auto framed = [&](const std::vector<std::string>& payloads) {
    for (const std::string& p : payloads) Check(migrator::WriteFrame(fds[0], p).ok(), "WriteFrame");
    std::string out(1 << 16, '\0');
    const ssize_t n = recv(fds[1], out.data(), out.size(), MSG_DONTWAIT);
    out.resize(n > 0 ? static_cast<size_t>(n) : 0);
    return out;
  };
  const std::string stream = framed({hello, reply, refusal});
  Seed("migrator_frame", "hello_and_replies", stream);
  Seed("migrator_frame", "cut_inside_a_frame", stream.substr(0, stream.size() - 7));
  Seed("migrator_frame", "empty_frame", framed({""}));
  Seed("migrator_frame", "oversized_length", std::string("\x01\x00\x00\x01hello", 9));
  // The shim server target puts its own Hello first (option bit 0).
  Seed("migrator_shim_server", "replies", "\x01" + framed({reply, refusal}));
  Seed("migrator_shim_server", "released_then_reply", "\x03" + framed({reply}));
  Seed("migrator_shim_server", "answering_a_call", "\x05" + framed({reply}));
  Seed("migrator_shim_server", "hello_of_another_pid",
       std::string(1, '\0') + framed({hello_released}));
  Seed("migrator_shim_server", "second_hello", "\x01" + framed({hello}));
  close(fds[0]);
  close(fds[1]);
}

// ---- images ------------------------------------------------------------

// Records what SendImages streams, as a destination's Transfer service
// would receive it.
class RecordingTransfer final : public v1::Transfer::Service {
 public:
  grpc::Status PushImages(grpc::ServerContext*, grpc::ServerReader<v1::ImageChunk>* reader,
                          v1::PushImagesResponse*) override {
    v1::ImageChunk c;
    while (reader->Read(&c)) chunks.push_back(c.SerializeAsString());
    return grpc::Status::OK;
  }
  std::vector<std::string> chunks;
};

std::vector<std::string> Stream(const std::string& dir, const v1::Manifest& manifest, bool pre_dump,
                                uint32_t iteration) {
  RecordingTransfer service;
  grpc::ServerBuilder b;
  b.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  auto stub = v1::Transfer::NewStub(server->InProcessChannel(grpc::ChannelArguments()));
  absl::StatusOr<uint64_t> sent = migrator::SendImages(stub.get(), "m1", dir, manifest, pre_dump,
                                                       iteration, absl::Seconds(10), {});
  Check(sent.ok(), "SendImages");
  server->Shutdown();
  return service.chunks;
}

v1::Manifest ManifestOf(const std::string& dir) {
  absl::StatusOr<std::vector<v1::ImageFile>> files = migrator::ScanImages(dir);
  Check(files.ok(), "ScanImages");
  v1::Manifest m;
  m.set_format_version(migrator::kManifestFormatVersion);
  m.set_migration_id("m1");
  m.set_source_host("h1");
  m.set_created_at("2024-05-01T10:00:00.000Z");
  for (const v1::ImageFile& f : *files) *m.add_files() = f;
  return m;
}

void ImageSeeds() {
  ScratchDir scratch("corpus");
  const std::string dir = scratch.path() + "/images";
  WriteImageFixture(dir);
  const v1::Manifest m = ManifestOf(dir);
  // image_manifest: bit 0 clear, a manifest.pb; set, the body alone.
  Seed("image_manifest", "fixture", std::string(1, '\0') + migrator::SerializeManifestFile(m));
  Seed("image_manifest", "fixture_body", "\x01" + m.SerializeAsString());
  v1::Manifest traps = m;
  traps.clear_files();
  for (const v1::ImageFile& f : m.files()) {
    v1::ImageFile* t = traps.add_files();
    *t = f;
    if (f.name() == "inventory.img") t->set_name("link.img");
    if (f.name() == "sub/fdinfo-2.img") t->set_name("ldir/fdinfo-2.img");
    if (f.name() == "empty.img") t->set_name("fifo.img");
  }
  Seed("image_manifest", "symlinks_and_a_fifo", "\x01" + traps.SerializeAsString());
  v1::Manifest wrong = m;
  wrong.mutable_files(0)->set_size(wrong.files(0).size() + 1);
  Seed("image_manifest", "wrong_size",
       std::string(1, '\0') + migrator::SerializeManifestFile(wrong));
  const std::string file = migrator::SerializeManifestFile(m);
  Seed("image_manifest", "truncated", std::string(1, '\0') + file.substr(0, file.size() - 9));

  Seed("image_receiver", "final_dump", JoinMessages(Stream(dir, m, false, 0)));
  Seed("image_receiver", "pre_dump", JoinMessages(Stream(dir, m, true, 1)));
  // The same files sent in two pieces each.
  std::vector<std::string> pieces;
  for (const std::string& c : Stream(dir, m, false, 0)) {
    v1::ImageChunk chunk;
    chunk.ParseFromString(c);
    if (chunk.has_manifest() || chunk.data().size() < 2) {
      pieces.push_back(c);
      continue;
    }
    const std::string data = chunk.data();
    chunk.set_data(data.substr(0, data.size() / 2));
    pieces.push_back(chunk.SerializeAsString());
    chunk.set_offset(chunk.offset() + data.size() / 2);
    chunk.set_data(data.substr(data.size() / 2));
    pieces.push_back(chunk.SerializeAsString());
  }
  Seed("image_receiver", "in_pieces", JoinMessages(pieces));
}

// ---- the migrator: records, transfers ------------------------------------

// Appends to *out the records under STATE/SUBDIR/*/record.pb now.
void Records(const std::string& state, const std::string& subdir, std::vector<std::string>* out) {
  for (const auto& [dir, rec] : migrator::ListRecords(state + "/" + subdir))
    out->push_back(rec.SerializeAsString());
}

// A final dump of endpoint `pid` of a source host, and its chunks.
std::vector<std::string> FinalDumpChunks(const std::string& dir, v1::EndpointSummary* endpoint) {
  FakeHost source(1);
  source.Add(500, MigratorFixture::VirtualGid(5),
             {{51, 2, MigratorFixture::VirtualGid(2), 21,
               migrator::testing::Gid(MigratorFixture::kHost)}});
  v1::MigratorToShim q, r, d;
  q.mutable_quiesce();
  r.mutable_release();
  d.mutable_describe();
  *endpoint = source.Call(500, d, absl::Seconds(1))->summary();
  Check(source.Call(500, q, absl::Seconds(1)).ok() && source.Call(500, r, absl::Seconds(1)).ok(),
        "releasing the source endpoint");
  Check(source.Dump(500, dir, "", false, false).ok(), "the fake dump");
  v1::Manifest m = ManifestOf(dir);
  *m.mutable_endpoint() = *endpoint;
  return Stream(dir, m, false, 0);
}

std::string Call(uint8_t op, const google::protobuf::Message& request) {
  return std::string(1, static_cast<char>(op)) + request.SerializeAsString();
}

void MigratorSeeds() {
  ScratchDir scratch("corpus");
  // A checkpoint and a migration that fails (its destination does not
  // answer) on this host: the source's records at every phase.
  std::vector<std::string> source_records;
  {
    const std::string state = scratch.path() + "/source";
    MigratorFixture f(state);
    auto sink = [&](const v1::Progress& p) {
      const std::string rec =
          ReadFile(absl::StrCat(state, "/migrations/", p.migration_id(), "/record.pb"));
      if (!rec.empty()) source_records.push_back(rec);
    };
    v1::CheckpointRequest c;
    c.set_pid(MigratorFixture::kPid);
    c.set_dir(scratch.path() + "/checkpoint");
    c.set_leave_running(true);
    (void)f.migrator().Checkpoint(c, sink);
    v1::MigrateRequest mr;
    mr.set_pid(MigratorFixture::kRemotePeerPid);
    mr.set_destination("h3:7700");
    mr.add_addresses("10.0.0.2/24");
    (void)f.migrator().Migrate(mr, sink);
    v1::GuestEventRequest g;
    g.set_domain("guest1");
    g.set_event("started");
    g.set_mac("52:54:00:00:00:01");
    (void)f.migrator().GuestEvent(g);
    v1::AllocateGuestNicRequest a;
    a.set_domain("guest2");
    (void)f.migrator().AllocateGuestNic(a);
  }
  const std::string guests = ReadFile(scratch.path() + "/source/guests.pb");

  // An incoming move on this host, call by call, and its records.
  v1::EndpointSummary endpoint;
  const std::vector<std::string> chunks = FinalDumpChunks(scratch.path() + "/dump", &endpoint);
  std::vector<std::string> incoming_records;
  std::vector<std::string> calls;
  {
    const std::string state = scratch.path() + "/destination";
    MigratorFixture f(state);
    v1::PrepareRequest prepare;
    prepare.set_migration_id("m1");
    *prepare.mutable_endpoint() = endpoint;
    calls.push_back(Call(0, prepare));
    (void)f.migrator().Prepare(prepare);
    Records(state, "incoming", &incoming_records);
    size_t next = 0;
    (void)f.migrator().PushImages([&](v1::ImageChunk* c) {
      return next < chunks.size() && c->ParseFromString(chunks[next++]);
    });
    for (size_t i = 0; i < chunks.size(); ++i)
      calls.push_back(std::string(1, i == 0 ? '\1' : '\2') + chunks[i]);
    Records(state, "incoming", &incoming_records);
    v1::RestoreIncomingRequest restore;
    restore.set_migration_id("m1");
    v1::Mapping* peer = restore.add_peers();
    peer->set_virtual_gid(MigratorFixture::VirtualGid(9));
    peer->set_physical_gid(migrator::testing::Gid(4));
    calls.push_back(Call(3, restore));
    absl::StatusOr<v1::RestoreIncomingResponse> restored = f.migrator().RestoreIncoming(restore);
    Records(state, "incoming", &incoming_records);
    v1::ReconnectPeersRequest reconnect;
    reconnect.set_migration_id("m1");
    if (restored.ok()) *reconnect.mutable_mapping() = restored->endpoint().mapping();
    reconnect.set_resume_endpoint(true);
    calls.push_back(Call(6, reconnect));
  }
  Seed("migrator_transfer", "incoming_move", JoinMessages(calls));
  Seed("migrator_transfer", "prepare_then_abort", JoinMessages({calls[0], Call(4, [] {
                                                                  v1::AbortIncomingRequest a;
                                                                  a.set_migration_id("m1");
                                                                  return a;
                                                                }())}));
  // This host's endpoints are peers of a moving one: quiesced, re-pointed.
  v1::QuiescePeersRequest qp;
  qp.set_migration_id("m2");
  qp.set_virtual_gid(MigratorFixture::VirtualGid(1));
  qp.add_virtual_qpns(11);
  qp.set_drain_timeout_ms(5);
  v1::ReconnectPeersRequest rp;
  rp.set_migration_id("m2");
  rp.mutable_mapping()->set_virtual_gid(MigratorFixture::VirtualGid(1));
  rp.mutable_mapping()->set_physical_gid(migrator::testing::Gid(MigratorFixture::kOtherHost));
  v1::IdPair* q = rp.mutable_mapping()->add_qpns();
  q->set_virtual_id(11);
  q->set_physical_id(311);
  v1::ReconnectPeersRequest rollback = rp;
  rollback.set_resume_only(true);
  Seed("migrator_transfer", "peers_of_a_move", JoinMessages({Call(5, qp), Call(6, rp)}));
  Seed("migrator_transfer", "peers_rolled_back", JoinMessages({Call(5, qp), Call(6, rollback)}));
  Seed("migrator_transfer", "reads", JoinMessages({std::string(1, '\7')}));

  for (size_t i = 0; i < source_records.size(); ++i)
    Seed("migration_record", absl::StrCat("source_", i),
         JoinMessages(
             {source_records[i], i < incoming_records.size() ? incoming_records[i] : "", guests}));
  for (size_t i = 0; i < incoming_records.size(); ++i)
    Seed("migration_record", absl::StrCat("incoming_", i), JoinMessages({"", incoming_records[i]}));
}

// ---- certificates --------------------------------------------------------

void TlsSeeds() {
  ScratchDir scratch("corpus");
  for (const char* ca : {"a", "b"}) {
    const std::string cmd = absl::StrCat(RDMAVIRT_SOURCE_DIR, "/tools/rdmavirt-certs --dir ",
                                         scratch.path(), "/", ca, " lab 1 > /dev/null 2>&1");
    Check(system(cmd.c_str()) == 0, "tools/rdmavirt-certs");
  }
  const std::string a = scratch.path() + "/a/", b = scratch.path() + "/b/";
  auto files = [](const std::string& ca, const std::string& cert, const std::string& key) {
    return JoinMessages({ReadFile(ca), ReadFile(cert), ReadFile(key)});
  };
  Seed("tls_pem", "lab_host", files(a + "ca.pem", a + "host1.pem", a + "host1.key"));
  Seed("tls_pem", "lab_cli", files(a + "ca.pem", a + "cli.pem", a + "cli.key"));
  Seed("tls_pem", "other_ca", files(b + "ca.pem", a + "host1.pem", a + "host1.key"));
  Seed("tls_pem", "key_of_another", files(a + "ca.pem", a + "host1.pem", b + "host1.key"));
  Seed("tls_pem", "cert_as_key", files(a + "ca.pem", a + "host1.pem", a + "host1.pem"));
}

}  // namespace
}  // namespace rdmavirt::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  rdmavirt::fuzz::InitTarget();
  rdmavirt::fuzz::g_out = argv[1];
  rdmavirt::fuzz::ShimSeeds();
  rdmavirt::fuzz::ImageSeeds();
  rdmavirt::fuzz::MigratorSeeds();
  rdmavirt::fuzz::TlsSeeds();
  return 0;
}
