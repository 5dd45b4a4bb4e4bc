// Migrator: what rdmavirt-migratord does, without the transport. The gRPC
// services (grpc_service.h) call it for the operator (Operator) and for
// other hosts' migrators (Transfer); it reaches this host's shims through a
// ShimChannel, CRIU through a Checkpointer, the moved process through
// ProcessControl, and other migrators through Transfer stubs made by
// Options::connect. Tests put fakes behind all four.
//
// A move, as the source runs it (DESIGN.md, "A live migration"):
//   prepare   the destination says it can take the endpoint (nothing touched yet)
//   precopy   CRIU pre-dumps, streamed while the process runs
//   quiesce   the peers' endpoints, then the endpoint; release; its socket closes
//   dump      final dump (the process left running), then SIGSTOP
//   transfer  final images + manifest; the destination restores and confirms
//   reconnect peers re-pointed, then the endpoint resumed on the destination
//   cleanup   the stopped source process killed
// Any failure before the destination confirms rolls back on the source:
// the destination aborts, the process is continued, brought back (resume
// marker, restore on this host's HCA), its peers re-pointed at it, resumed.
// Each step is recorded in STATE/migrations/ID/record.pb before it starts,
// and Recover() finishes or rolls back what a previous run left in flight.
//
// Thread-safe: every public method may be called from any thread; moves of
// different processes run concurrently, a second move of a process that is
// moving is refused.
#ifndef RDMAVIRT_MIGRATOR_MOVE_MIGRATOR_H_
#define RDMAVIRT_MIGRATOR_MOVE_MIGRATOR_H_

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "migrator/criu/checkpointer.h"
#include "migrator/host/process_control.h"
#include "migrator/host/service_address.h"
#include "migrator/transport/shim_channel.h"
#include "rdmavirt/v1/migrator.grpc.pb.h"

namespace rdmavirt::migrator {

class ContainerRuntime;
class ImageReceiver;
class Inventory;

class Migrator {
 public:
  struct Options {
    std::string host_name;
    std::string state_dir = "/var/lib/rdmavirt";
    std::string version;
    // The TCP port of every migrator (without an inventory, peers are found
    // at their GID's IPv4 and this port).
    int port = 7700;
    uint32_t max_precopy_iterations = 3;
    // A pre-dump that writes less than this ends the pre-copy.
    uint64_t precopy_small_bytes = 4 << 20;
    uint32_t drain_timeout_ms = 10000;
    // A restored or rolled-back shim must say Hello within this.
    absl::Duration hello_timeout = absl::Seconds(60);
    // A released shim must close its socket within this.
    absl::Duration close_timeout = absl::Seconds(10);
    absl::Duration rpc_timeout = absl::Seconds(30);
    absl::Duration transfer_timeout = absl::Minutes(30);
    // Once the endpoint has moved, a host whose migrator stops answering
    // (UNAVAILABLE: killed, restarting) while its peers must be re-pointed
    // or the endpoint resumed there is asked again, every second, for this
    // long: a restarted migrator finds the shims again and can do it.
    absl::Duration restart_wait = absl::Minutes(2);
    // A move that meets another before its endpoint is quiesced (its
    // endpoint paused as that move's peer, a peer of it paused by that
    // move or being quiesced for its own) waits for it if it is the older
    // move, else lets go of the peers it paused and tries again after 0.5
    // to 2 s (bookkeeping.cc: AwaitHeld), for this long; then it is
    // refused (ABORTED) and rolled back. Moves of endpoints with UD QPs
    // all meet, and go one after the other: eight at once took the lab's
    // TCG hosts minutes.
    absl::Duration busy_wait = absl::Minutes(10);
    // A restarted migrator's shims come back within this (each retries
    // every second). Until then a re-point or a resume, and until
    // Recover() has put back the moves into this host a step of a move it
    // does not know yet, is answered UNAVAILABLE, and the source asks again.
    absl::Duration shims_return_within = absl::Seconds(5);
    // Where the cluster's migrators find each other (inventory.h); none:
    // one host, or peers found by their GIDs' IPv4 addresses.
    Inventory* inventory = nullptr;
    // A peer's physical GID (16 bytes) -> "host:port" of its migrator, ""
    // when it is on this host; NOT_FOUND when no migrator owns it.
    // Default: the owner in `inventory`, else the GID's IPv4 and `port`.
    std::function<absl::StatusOr<std::string>(const std::string& gid)> locate_peer;
    // Every other live host's migrator ("host:port"): any of them may send
    // datagrams to a moving endpoint's UD QPs, which name no peer. Default:
    // the hosts in `inventory`; without one, unset, and a UD endpoint's
    // senders on other hosts are told only if it points address handles
    // at them.
    std::function<absl::StatusOr<std::vector<std::string>>()> list_hosts;
    // "host:port" -> a Transfer stub to that migrator. Required.
    std::function<std::unique_ptr<v1::Transfer::StubInterface>(const std::string& target)> connect;
    // Post-copy: the address of this host that `host` (a destination
    // migrator's) reaches it at, for CRIU's page server. Default: the
    // source address of the route toward `host`.
    std::function<absl::StatusOr<std::string>(const std::string& host)> address_toward;
    // This host's RDMA devices. Default: libibverbs.
    std::function<std::vector<v1::RdmaDevice>()> list_devices;
    // This host's network addresses, for the service addresses that move
    // with a process. Default: the kernel's (NewNetlinkAddressControl).
    AddressControl* addresses = nullptr;
    // The RDMA NICs this host gives its guests (guests.cc): none when
    // guest_nic_bridge is empty. Addresses are handed out from
    // guest_nic_first (a.b.c.d/len) upward, at most guest_nic_capacity.
    std::string guest_nic_bridge;
    // This host's container runtime (containers.h), for moves of
    // containers; none: they are refused.
    ContainerRuntime* containers = nullptr;
    std::string guest_nic_first;
    uint32_t guest_nic_capacity = 0;
  };

  using ProgressSink = std::function<void(const v1::Progress&)>;

  // The pointers must outlive the Migrator.
  Migrator(Options options, ShimChannel* shims, Checkpointer* criu, ProcessControl* procs);
  ~Migrator();

  // ---- Operator
  // `wait_for_criu`: runs `criu check` if no call has yet (once; later
  // calls wait for it); else CRIU not checked yet counts as unusable
  // ("not checked yet").
  v1::HostInfo GetHostInfo(bool wait_for_criu = true) ABSL_LOCKS_EXCLUDED(criu_mu_);
  v1::ListEndpointsResponse ListEndpoints();
  // The long operations stream Progress to `sink` and end with one that
  // carries the report. A refusal before anything was touched returns its
  // error (NOT_FOUND, FAILED_PRECONDITION, INVALID_ARGUMENT, UNAVAILABLE);
  // a failure after returns its error too, and the report says whether the
  // endpoint was rolled back.
  absl::Status Migrate(const v1::MigrateRequest& request, const ProgressSink& sink);
  absl::Status Checkpoint(const v1::CheckpointRequest& request, const ProgressSink& sink);
  absl::Status Restore(const v1::RestoreRequest& request, const ProgressSink& sink);
  // `all`: with the moves in flight anywhere in the cluster (inventory).
  v1::StatusResponse Status(bool all = false) ABSL_LOCKS_EXCLUDED(mu_);
  // The inventory's live hosts; FAILED_PRECONDITION without an inventory.
  absl::StatusOr<v1::ListHostsResponse> ListHosts();
  // What this host publishes in the inventory (InventoryHost without its
  // address, certificate and libvirt URI, which main() knows).
  v1::InventoryHost DescribeForInventory();

  // ---- guests (guests.cc)
  // Guest side: every endpoint (or the listed ones) and its peers quiesced
  // and released, held until Resume brings them back on this host's
  // device. A failure puts back what it had suspended. INVALID_ARGUMENT
  // for bad pids, FAILED_PRECONDITION when endpoints of the set are
  // connected to each other or one is moving already.
  absl::StatusOr<v1::GuestReport> Suspend(const v1::SuspendRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_, suspend_mu_);
  // FAILED_PRECONDITION without a device; an endpoint that cannot come back
  // stays suspended (the report says which), the others resume.
  absl::StatusOr<v1::GuestReport> Resume(const v1::ResumeRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_, suspend_mu_);
  // Host side: the libvirt hook's starts and stops, and a NIC for a guest
  // that moves in (RESOURCE_EXHAUSTED when the host is full,
  // FAILED_PRECONDITION when it has no NICs for guests).
  absl::Status GuestEvent(const v1::GuestEventRequest& request) ABSL_LOCKS_EXCLUDED(guests_mu_);
  absl::StatusOr<v1::GuestNic> AllocateGuestNic(const v1::AllocateGuestNicRequest& request)
      ABSL_LOCKS_EXCLUDED(guests_mu_);

  // ---- Transfer
  absl::StatusOr<v1::PrepareResponse> Prepare(const v1::PrepareRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `next` yields the stream's messages until it returns false.
  absl::StatusOr<v1::PushImagesResponse> PushImages(
      const std::function<bool(v1::ImageChunk*)>& next);
  absl::StatusOr<v1::RestoreIncomingResponse> RestoreIncoming(
      const v1::RestoreIncomingRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status AbortIncoming(const v1::AbortIncomingRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::QuiescePeersResponse> QuiescePeers(const v1::QuiescePeersRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Asked by another host: not before Recover() has put back the moves
  // into this host and its shims had the time to come back (UNAVAILABLE
  // after half an RPC's deadline), nor do the steps above on a move this
  // host does not know yet. The same request asked again (its caller's
  // deadline passed while this host worked on it) gets the first one's
  // answer, waited for while it runs: done twice, a re-point would reset
  // QPs that carry traffic again. A failed request is done again.
  absl::StatusOr<v1::ReconnectPeersResponse> ReconnectPeers(
      const v1::ReconnectPeersRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

  // Rolls back (as a source) or aborts (as a destination) every move a
  // previous run of the migrator left unfinished in the state directory,
  // and records the outcome. Run once at start, after the shim socket
  // listens (shims reconnect to it within a second). The moves into this
  // host come first: other hosts' steps of them wait for that alone.
  void Recover() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Move;
  struct Incoming;

  // ---- shims
  // The reply of a command, its code turned into a status with context.
  absl::StatusOr<v1::Reply> Command(pid_t pid, const v1::MigratorToShim& request,
                                    absl::Duration timeout, const char* what);
  absl::StatusOr<v1::EndpointSummary> Describe(pid_t pid);
  // Describe of each of `shims`, all asked at once (in that order).
  std::vector<absl::StatusOr<v1::EndpointSummary>> DescribeAll(const std::vector<ShimInfo>& shims);
  // NOT_FOUND without such a process; FAILED_PRECONDITION when it is not
  // under the shim.
  absl::Status CheckShim(pid_t pid);
  // The pseudo-terminal that it or a descendant holds and whose master
  // side stays behind ("/dev/pts/3"; the tree gets a new one where it is
  // restored), "" for none. FAILED_PRECONDITION for a terminal CRIU
  // cannot give back (another kind, /dev/tty held open, or two
  // pseudo-terminals).
  absl::StatusOr<std::string> TreeTerminal(pid_t pid);
  // `root`, then its descendants, parents before children: what a dump takes.
  std::vector<pid_t> TreeOf(pid_t root);
  // OK when every RDMA device file that `root` and its descendants hold is
  // one the release closes: a verbs device of one of `endpoints` (the
  // processes under the shim). FAILED_PRECONDITION, naming the process
  // and the file, for any other (an RDMA CM channel, a MAD port, a verbs
  // device of another process of the tree): CRIU cannot dump it, and finding it
  // at the final dump would cost the pre-copy and a blackout.
  absl::Status CheckTreeDevices(pid_t root, const std::vector<pid_t>& endpoints);
  // The processes under the shim that a move of `root` (with its
  // descendants, as CRIU dumps it) takes: `root` first if it is one, then
  // its descendants that are, parents before children.
  // FAILED_PRECONDITION when none is.
  absl::StatusOr<std::vector<pid_t>> EndpointsOfTree(pid_t root);
  // The endpoint described and its peers quiesced; ABORTED when another
  // move holds it or a peer (quiesce.cc).
  absl::StatusOr<v1::EndpointSummary> QuiesceThePeers(Move* m, absl::Time give_up);
  // QuiesceThePeers, tried again while it meets another move, for up to
  // options_.busy_wait (quiesce.cc); LetGoOfPeers resumes the peers a
  // refused attempt paused.
  absl::StatusOr<v1::EndpointSummary> QuiesceWhenFree(Move* m);
  absl::Status LetGoOfPeers(Move* m);
  absl::Status MarkQuiescing(pid_t pid, const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // The move other than `id` whose peer set holds `pid`; "" if none.
  std::string HolderOf(pid_t pid, const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK once no move other than `id` holds `pid` paused; ABORTED, naming
  // the holder, if one does (bookkeeping.cc: who waits, who yields).
  absl::Status AwaitHeld(pid_t pid, const std::string& id, const std::string& what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `pid` taken for a move (or a checkpoint); FAILED_PRECONDITION when it
  // is moving already. DoneMoving gives it back.
  absl::Status MarkMoving(pid_t pid) ABSL_LOCKS_EXCLUDED(mu_);
  // The move of `pid` is over: it may move again, and be paused as a peer.
  void DoneMoving(pid_t pid) ABSL_LOCKS_EXCLUDED(mu_);
  // The shim of `pid` told to resume its endpoint; its failure, said.
  absl::Status ResumeEndpoint(pid_t pid);
  // The end of bringing an endpoint back on this host: resumed once its
  // peers were re-pointed (`reconnected`); the first failure of the two.
  absl::Status ResumeAfter(pid_t pid, const absl::Status& reconnected);
  // The reconnect's and the blackout's times (the reconnect began at
  // `c0`) in m's report, then the move finished with `status`.
  void FinishReconnected(Move* m, absl::Time c0, const absl::Status& status);
  // The images under m->dir (pre-dumps, final dump) deleted; the record
  // stays.
  void RemoveStepDirs(Move* m);
  // For RestoreFromDir's `restored`: the pid CRIU gave m's tree, and that
  // process's identity, recorded at once (crash recovery kills it).
  std::function<void(pid_t)> NoteRestored(Move* m);
  // AbortIncoming on a prepared move's destination; its failure, said.
  absl::Status AbortOnDestination(Move* m);
  // SIGKILL of a copy of a moved process that must not stay (`which`
  // names it in errors), tried three times; INTERNAL if it stays.
  absl::Status KillCopy(pid_t pid, const char* which);
  // `pid` still names the process whose ProcessControl::Identity was
  // `identity` (when `identity` is "", that a process has the pid).
  bool SameProcess(pid_t pid, const std::string& identity);
  // Kills what an incoming move restored, takes its service addresses
  // off, deletes its images and marks its record aborted with `why`;
  // returns (and records) what could not be undone.
  absl::Status DropIncoming(Incoming* in, const std::string& why);
  // Creates the resume marker, waits for the released shim's Hello,
  // removes the marker, sends restore; the endpoint stays paused.
  absl::StatusOr<v1::EndpointSummary> BringBack(pid_t pid, const std::string& device,
                                                const std::vector<v1::Mapping>& peers);
  // Local endpoints (not `exclude`, not the endpoint `vgid` itself) with a
  // QP toward `vgid`: connected to one of `qpns` (any QPN if empty), or UD
  // when `with_ud`.
  std::vector<std::pair<pid_t, bool>> LocalPeersOf(const std::string& vgid,
                                                   const std::set<uint32_t>& qpns, bool with_ud,
                                                   pid_t exclude);
  std::string FirstActiveDeviceName();
  // Each endpoint of `list` that runs in a container: its name, and the
  // service addresses of the container's TCP sockets.
  void NameContainers(v1::ListEndpointsResponse* list);

  // ---- containers (containers.cc)
  // The container `name`, running here, if it can move: its first
  // process's pid here in *root. FAILED_PRECONDITION naming what keeps it
  // (no runtime here, a runtime without CRIU, a terminal), NOT_FOUND.
  absl::StatusOr<v1::Container> MovableContainer(const std::string& name, pid_t* root);
  // On a destination: whether `c` can be restored here (its image, its
  // devices and mounted paths, its name free); FAILED_PRECONDITION (or
  // ALREADY_EXISTS) naming what is missing.
  absl::Status CheckContainerFits(const v1::Container& c);
  // `c` checkpointed by its runtime into dir/kContainerExport.
  absl::StatusOr<DumpStats> DumpContainer(const v1::Container& c, const std::string& dir,
                                          bool leave_running, bool tcp);
  // `c` restored from dir/kContainerExport: its first process's pid here,
  // and in *endpoint that of its process under the shim.
  absl::StatusOr<pid_t> RestoreContainer(const std::string& dir, const v1::Container& c, bool tcp,
                                         pid_t* endpoint);
  // `c` killed and removed here (`which` copy, for errors).
  absl::Status RemoveContainerCopy(const v1::Container& c, const char* which);

  // ---- source side (bookkeeping.cc, quiesce.cc, reconnect.cc, precopy_dump.cc,
  // migrate.cc, linked_tree.cc, rollback.cc, local_checkpoint.cc)
  std::unique_ptr<Move> NewMove(const std::string& kind, pid_t pid, const ProgressSink& sink);
  void SetPhase(Move* m, const std::string& phase, const std::string& detail = "");
  void Persist(Move* m) ABSL_LOCKS_EXCLUDED(mu_);
  void Finish(Move* m, const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  void SendBytes(Move* m, const std::string& phase, uint64_t done, uint64_t total);
  v1::Transfer::StubInterface* Stub(Move* m, const std::string& target);
  // ReconnectPeers on `target`, asked again while it is UNAVAILABLE or
  // past its deadline, for at most options_.restart_wait (a fresh channel
  // each time); the move's
  // progress says what it waits for.
  // The MPI job tree `pid` is in (EndpointSummary.job_root_pid), 0 if none.
  pid_t JobRoot(pid_t pid);
  // The secondary addresses of this host that the TCP sockets of `root`'s
  // tree are on, "a.b.c.d/len".
  std::vector<std::string> TreeServiceAddresses(pid_t root);
  absl::StatusOr<v1::ReconnectPeersResponse> ReconnectPeersOn(Move* m, const std::string& target,
                                                              const v1::ReconnectPeersRequest& req,
                                                              const std::string& what);
  absl::Status QuiescePeersOf(Move* m, const v1::EndpointSummary& summary, absl::Time give_up);
  // QuiescePeersOf's steps (quiesce.cc): `req` on each of `targets` at once
  // ("" for this host); then the peers they paused counted, and the hosts
  // that were asked only as possible UD senders (`listed`) and did not
  // answer left out of the move. Another failure is returned.
  std::vector<absl::StatusOr<v1::QuiescePeersResponse>> AskToQuiesce(
      Move* m, const v1::QuiescePeersRequest& req, const std::vector<std::string>& targets,
      absl::Time give_up);
  absl::Status CountQuiesced(Move* m, const std::vector<std::string>& targets,
                             const std::set<std::string>& listed,
                             const std::vector<absl::StatusOr<v1::QuiescePeersResponse>>& results);
  absl::Status QuiesceAndRelease(Move* m, v1::EndpointSummary* released);
  absl::Status QuiesceEndpoint(Move* m);
  absl::Status ReleaseEndpoint(Move* m, v1::EndpointSummary* released);
  // ReconnectPeers on every host whose peers were quiesced (this one too).
  // `held` (if given) counts the peers that are released themselves.
  absl::Status ReconnectAll(Move* m, const v1::Mapping& mapping, bool resume_only,
                            uint32_t* held = nullptr);
  // `req` on each of `targets` at once ("" for this host), through m's
  // channels; their errors joined.
  absl::Status ReconnectOn(Move* m, const std::vector<std::string>& targets,
                           const v1::ReconnectPeersRequest& req, uint32_t* held = nullptr);
  // `members`: the tree's further endpoints (tree_lead: m), each quiesced
  // and released after m's endpoint (all quiesced before any is released
  // when m->linked), brought back on the destination after m's restore
  // (BringBackMember).
  absl::Status RunSource(Move* m, const v1::MigrateRequest& request,
                         const std::vector<std::unique_ptr<Move>>& members);
  // RunSource's steps (precopy_dump.cc). PreCopy: the pre-dumps of the
  // tree, each sent to the destination while it runs, until they are
  // small, stop shrinking or reach the request's count; returns the last
  // one's directory ("" for none), the final dump's parent. SendPreDump:
  // pre-dump `k` in `dir` streamed. NotePreDumpPages: the registered pages
  // it holds, for each endpoint's release.
  absl::StatusOr<std::string> PreCopy(Move* m, const v1::MigrateRequest& request,
                                      const std::vector<Move*>& all);
  absl::Status SendPreDump(Move* m, uint32_t k, const std::string& dir);
  void NotePreDumpPages(const std::vector<Move*>& all, uint32_t k, const std::string& dir);
  // Every endpoint of the tree (`all`, m's first) quiesced and released;
  // `released` gets m's endpoint as it was released.
  absl::Status QuiesceAndReleaseTree(Move* m, const std::vector<Move*>& all,
                                     v1::EndpointSummary* released);
  // The tree stopped, its service addresses taken off; whether it had any
  // (its TCP connections then move, frozen, with the dump).
  absl::StatusOr<bool> StopForDump(Move* m, pid_t root);
  absl::Status BringBackMember(Move* member);
  // Migrate's steps (migrate.cc). DescribeMove: the endpoint described
  // and its peers found, the tree's further moves made, the move claimed
  // in the inventory; PrepareMigration: the destination's yes. Each
  // refusal finishes the moves (nothing was quiesced) and is returned.
  // RollBackTree and CompleteTree: the tree put back here after a failure,
  // or completed on the destination.
  absl::Status DescribeMove(Move* m, const std::vector<pid_t>& endpoints,
                            std::vector<std::unique_ptr<Move>>* members);
  absl::Status PrepareMigration(Move* m, const std::vector<std::unique_ptr<Move>>& members);
  void RollBackTree(Move* m, const std::vector<std::unique_ptr<Move>>& members,
                    const absl::Status& cause);
  void CompleteTree(Move* m, const std::vector<std::unique_ptr<Move>>& members);
  // The tree of `root` with several endpoints: the first is `lead`'s, one
  // move per further endpoint in `members`.
  absl::Status MakeMembers(Move* lead, const std::vector<pid_t>& endpoints,
                           std::vector<std::unique_ptr<Move>>* members);
  // The steps a move and a restore elsewhere share. Prepare: the
  // destination's yes before anything is touched (`untouched` says what a
  // refusal left as it was). TransferFinal: `dir`'s images sent (`hashed`:
  // the manifest with the digests the stream computed).
  // RestoreOnDestination: restored there (paused), the record says so.
  // CompleteForward: peers re-pointed, the endpoint resumed there, the
  // source's stopped copy (a move's) killed; the move finished, the first
  // failure returned (and in the report).
  absl::Status PrepareDestination(Move* m, const v1::PrepareRequest& prep, const char* untouched);
  absl::Status TransferFinal(Move* m, const std::string& dir, const v1::Manifest& manifest,
                             v1::Manifest* hashed = nullptr);
  absl::Status RestoreOnDestination(Move* m);
  // Post-copy: the final dump of `root` into `dir`, on a thread of its own
  // (Move::lazy_dump), serving its pages on an address of this host that
  // the destination reaches; returns once its images are written, or with
  // its error.
  absl::Status StartLazyDump(Move* m, pid_t root, const std::string& dir, const std::string& parent,
                             bool tcp);
  // Waits for a post-copy's final dump to end (after `cancel`ling its page
  // server when its destination will not come) and returns what it
  // returned; OK without one.
  absl::Status EndLazyDump(Move* m, bool cancel);
  absl::Status CompleteForward(Move* m);
  // The end of CompleteForward, once the peers (`peers`) and the endpoint
  // (`resumed`) were dealt with from `c0` on: report, cleanup, finish.
  absl::Status Conclude(Move* m, absl::Time c0, const absl::Status& peers,
                        const absl::Status& resumed);
  // CompleteForward of a linked tree (lead->linked): its endpoints' peers
  // re-pointed at all of them in one step per host, then the endpoints at
  // each other on the destination, then all resumed.
  void CompleteLinked(Move* lead, const std::vector<std::unique_ptr<Move>>& members);
  // A tree's moves, its first one first.
  static std::vector<Move*> TreeMoves(Move* lead,
                                      const std::vector<std::unique_ptr<Move>>& members);
  // The request that re-points a linked tree's peers at where its
  // endpoints are now (`mappings`, the lead's first).
  v1::ReconnectPeersRequest TreeRequest(Move* lead,
                                        const std::vector<std::unique_ptr<Move>>& members,
                                        const std::vector<v1::Mapping>& mappings);
  // Every host with a peer of one of the moves ("" for this one), but
  // `skip`.
  std::vector<std::string> TreePeerHosts(const std::vector<Move*>& moves, const std::string& skip);
  // Puts the endpoint back on this host after a failure; `cause` is why.
  // With `paused` (a linked tree's endpoint), it is brought back but stays
  // paused, its peers are left to RollBackLinked and the move is not
  // finished: *paused gets the mapping it has now, unset if it is not back.
  void RollBack(Move* m, const absl::Status& cause, std::optional<v1::Mapping>* paused = nullptr);
  // RollBack's steps (rollback.cc). ContinueHere: the service addresses
  // back, the stopped tree continued. BringBackHere: the endpoint back on
  // this host (restored if it was released, resumed unless `paused`);
  // false when it could not be, its peers then left paused; `peers_done`
  // when its peers need no resume as they were.
  void ContinueHere(Move* m, std::vector<std::string>* problems);
  bool BringBackHere(Move* m, std::optional<v1::Mapping>* paused,
                     std::vector<std::string>* problems, bool* peers_done);
  // RollBack of a linked tree: every endpoint brought back paused, then
  // re-pointed at each other and at their peers in one step, then resumed.
  void RollBackLinked(Move* lead, const std::vector<std::unique_ptr<Move>>& members,
                      const absl::Status& cause);
  absl::Status ValidateCheckpointDir(const std::string& dir);
  // Checkpoint's and Restore's steps (local_checkpoint.cc). DumpCheckpoint:
  // the released endpoint's tree dumped into request.dir() with its
  // manifest. ResumeInPlace: a checkpoint that left its process running
  // brings its endpoint back here and resumes it; the move finished.
  absl::Status DumpCheckpoint(Move* m, const v1::CheckpointRequest& request,
                              const v1::EndpointSummary& released);
  absl::Status ResumeInPlace(Move* m);
  // The hosts of a checkpointed endpoint's peers in m's record.
  absl::Status RecordPeerHosts(Move* m, const v1::EndpointSummary& endpoint);
  // The checkpoint in `dir` restored on `target` (as a move's second
  // half), or here; the move finished either way.
  absl::Status RestoreElsewhere(Move* m, const std::string& dir, const v1::Manifest& manifest,
                                const std::string& target);
  absl::Status RestoreHere(Move* m, const std::string& dir, const v1::Manifest& manifest);

  // ---- destination side (incoming.cc)
  std::string IncomingDir(const std::string& id) const;
  // OK once Recover() has put back the incoming moves and, with
  // `shims_too`, Options::shims_return_within has passed since the
  // Migrator was made (waited for, half an RPC's deadline at most); else
  // UNAVAILABLE, which the source of move `id` asks again.
  absl::Status AwaitRecovery(const std::string& id, bool shims_too = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The incoming move `id` (taken out of `incoming_` if `take`), or
  // NOT_FOUND; an unknown one once Recover() has put back the incoming
  // moves (AwaitRecovery): it may be one of them.
  absl::StatusOr<std::shared_ptr<Incoming>> FindIncoming(const std::string& id, bool take = false)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Writes its record; the first failure also stays in in->record_error.
  void PersistIncoming(Incoming* in);
  absl::Status CheckCanHost();
  // CRIU-restores `dir`, then brings the endpoint of process
  // `endpoint_pid` back (paused) on this host's HCA: the process CRIU
  // restores (the tree's root, returned), or one of its descendants (CRIU
  // gives every process its pid back). `restored` learns the root's pid as
  // soon as CRIU gives it; out->pid is the endpoint's. A failure kills
  // whatever was restored. `new_terminal`: the tree held a pseudo-terminal
  // that stayed behind; it gets a new one; `lazy_from`: its last pages
  // come from there (Checkpointer::Restore), taken by `*postcopy`
  // (filled in before `restored` is called). `container`: the images are
  // its runtime's export, restored by it; `endpoint_pid` is then mapped by
  // the endpoint's pid inside the container.
  absl::StatusOr<pid_t> RestoreFromDir(const std::string& dir, bool tcp_established,
                                       bool new_terminal, const LazyPages* lazy_from,
                                       v1::PostCopyHelper* postcopy, pid_t endpoint_pid,
                                       const std::function<void(pid_t)>& restored,
                                       const std::vector<v1::Mapping>& peers,
                                       v1::RestoreIncomingResponse* out,
                                       const v1::Container* container = nullptr);
  // The pids of the tree dumped into `dir`, each with the identity of
  // what runs under it now ("" for none).
  std::map<pid_t, std::string> IdentitiesOf(const std::string& dir);
  // After a failed restore: every pid of `before` that names a process it
  // did not name then, killed (what a CRIU that died part way left).
  void KillHalfRestored(const std::map<pid_t, std::string>& before);
  // RestoreIncoming's steps. StartRestoring: the received move checked
  // (receiving, no stream running, its final dump's manifest there, its
  // record writable) and marked restoring; its record returned.
  // EndRestoring: the outcome recorded (restored, or back to receiving
  // with the addresses taken off), or, if the source aborted meanwhile,
  // what the restore made undone (ABORTED).
  absl::StatusOr<v1::MigrationRecord> StartRestoring(Incoming* in, const std::string& id,
                                                     const std::string& final_dir);
  absl::Status EndRestoring(Incoming* in, const std::string& id, const v1::MigrationRecord& rec,
                            bool addresses_added, const absl::StatusOr<pid_t>& pid,
                            const v1::RestoreIncomingResponse& out) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ResumeMoved(const v1::ReconnectPeersRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  // RestoreIncoming with endpoint_pid: a further endpoint of the tree the
  // migration restored here, brought back.
  absl::StatusOr<v1::RestoreIncomingResponse> RestoreMember(
      const v1::RestoreIncomingRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

  // ---- recovery (recovery.cc)
  // `tree_forward`: for a tree's further endpoint, whether the tree's
  // first move finishes (or finished) on its destination.
  void RecoverSource(const std::string& dir, v1::MigrationRecord record, bool tree_forward = false)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A move whose process is gone but whose final dump is whole: restored
  // here, resumed, the move finished (as rolled back if it resumed).
  void RestoreFinalDumpHere(Move* m, const absl::Status& cause);
  // Whether the process of a recovered move is still the one it moved (not
  // a pid reused since); if not, its record forgets what was done to it.
  bool SourceProcessAlive(Move* m);
  void RecoverDestination(const std::string& dir, v1::MigrationRecord record)
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- post-copy's CRIU helpers across a restart (postcopy.cc)
  // The record's entry for `helper` (its identity taken now).
  v1::PostCopyHelper RecordHelper(const PostCopyHelper& helper);
  // Until the helper a previous run started has ended: OK if every page
  // went, else what ended it; DEADLINE_EXCEEDED after `limit`, CANCELLED
  // once the migrator stops. Polls its status file (SpawnFds::
  // exit_status_file) and whether it still runs.
  absl::Status AwaitPostCopy(const v1::PostCopyHelper& helper, absl::Duration limit);
  // A helper of a move that goes back (not confirmed): killed, so that
  // CRIU lets go of the process.
  void StopPostCopyHelper(const v1::PostCopyHelper& helper);
  // A destination's post-copy a previous run left running: watched on a
  // thread of its own; if its pages cannot all come, the restored process
  // (rec.restored_pid, while it is the same process) is killed rather than
  // left to fault on the missing ones.
  void WatchPostCopy(const v1::MigrationRecord& rec) ABSL_LOCKS_EXCLUDED(watchers_mu_);
  // ReconnectPeers as this host's own step (a move or a recovery from
  // here), not waiting for the recovery.
  absl::StatusOr<v1::ReconnectPeersResponse> ReconnectHere(
      const v1::ReconnectPeersRequest& request);
  // ReconnectHere's steps (reconnect.cc). The pids this host paused for
  // the moves `ids`, and their sets forgotten once `out` says who was
  // re-pointed.
  std::set<pid_t> PausedPeersOf(const std::vector<std::string>& ids) ABSL_LOCKS_EXCLUDED(mu_);
  void ForgetPeerSets(const std::vector<std::string>& ids, const v1::ReconnectPeersResponse& out)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A peer's QPs toward `virtual_gid` drained and paused (`what` names the
  // step in errors).
  absl::Status PeerQuiesce(pid_t pid, const std::string& virtual_gid, const char* what);
  // A linked tree's endpoints re-pointed at each other, staying paused;
  // each failure logged, the first returned.
  absl::Status RepointTree(const v1::ReconnectPeersRequest& request, const std::set<pid_t>& tree);
  absl::Status RepointTreeEndpoint(pid_t pid, const v1::ReconnectPeersRequest& request);
  // The local peers to re-point (pid -> paused already): those paused for
  // the move, and whoever has a QP toward one of its endpoints' QPs.
  std::map<pid_t, bool> PeersToRepoint(const v1::ReconnectPeersRequest& request,
                                       const std::set<pid_t>& quiesced,
                                       const std::set<pid_t>& tree);
  // Each of `targets` re-pointed (or resumed) at once; `out` lists those
  // done and those held (released themselves); the first failure returned.
  absl::Status RepointPeers(const v1::ReconnectPeersRequest& request,
                            const std::map<pid_t, bool>& targets, v1::ReconnectPeersResponse* out);
  // `*held`: the peer is released itself and learns the mapping when it
  // comes back.
  absl::Status RepointPeer(pid_t pid, bool suspended, const v1::ReconnectPeersRequest& request,
                           bool* held) ABSL_LOCKS_EXCLUDED(mu_);
  // The moved endpoint (ResumeMoved) and a linked tree's further ones
  // resumed; the first failure.
  absl::Status ResumeTree(const v1::ReconnectPeersRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

  // Service addresses: checked where they are, then moved ("a.b.c.d/len@if"
  // entries of MigrationRecord.addresses). Add undoes itself on failure;
  // Remove goes on past a failure and reports them all.
  absl::Status LocateAddresses(const v1::MigrateRequest& request, v1::MigrationRecord* rec);
  absl::Status HomeAddresses(const v1::PrepareRequest& request, v1::MigrationRecord* rec);
  absl::Status AddAddresses(const v1::MigrationRecord& rec);
  absl::Status RemoveAddresses(const v1::MigrationRecord& rec);

  // ---- guests (guests.cc)
  void LoadGuestNics() ABSL_LOCKS_EXCLUDED(guests_mu_);
  void FillGuestNics(v1::HostInfo* info) ABSL_LOCKS_EXCLUDED(guests_mu_);
  // The guests' NICs written to the state directory; the failure, said.
  absl::Status SaveGuestNics() ABSL_EXCLUSIVE_LOCKS_REQUIRED(guests_mu_);
  // AllocateGuestNic's steps. The first address from `first` up (within
  // its subnet and the capacity) not `taken`, "" if none; the move of guest
  // `domain` claimed in the inventory (OK without one).
  std::string FreeGuestAddress(const ServiceAddress& first,
                               const std::set<std::string>& taken) const;
  absl::Status ClaimGuestMove(const std::string& domain, const v1::GuestNic& nic);
  // Suspend's steps (guests.cc). SuspendSet: the request's pids (each
  // under the shim), or every running endpoint, less those suspended
  // already. RefuseConnectedPair: FAILED_PRECONDITION for two of them
  // connected to each other. SuspendEach: each quiesced and released, held
  // in suspended_; all or nothing (a failure puts back those before it).
  absl::StatusOr<std::vector<pid_t>> SuspendSet(const v1::SuspendRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(suspend_mu_);
  absl::Status RefuseConnectedPair(const std::vector<pid_t>& pids);
  absl::Status SuspendEach(const std::vector<pid_t>& pids, v1::GuestReport* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(suspend_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  void ResumeOne(Move* m, const std::string& device, v1::MigrationReport* out)
      ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<std::string> PeerTarget(const std::string& gid);
  // The hosts of an endpoint's peers, each once ("" for this one).
  struct PeerHostSet {
    // Those of its connected QPs, each of which must be found, and those
    // its address handles point at (UD peers: one no migrator owns is
    // left out, as it has no shim to tell).
    std::set<std::string> named;
    // For an endpoint with a UD QP, every other host list_hosts knows
    // (not in `named`): any may send to it. One that does not answer is
    // left out of the move.
    std::set<std::string> listed;
  };
  absl::StatusOr<PeerHostSet> PeerHosts(const v1::EndpointSummary& e);
  // Every connected peer's host found (NOT_FOUND naming a GID no migrator
  // owns), before anything is quiesced.
  absl::Status CheckPeersLocatable(const v1::EndpointSummary& e);
  // The move recorded in the inventory for the cluster to see (and to
  // refuse a second move of the same endpoint); OK without an inventory.
  absl::Status ClaimMove(Move* m);
  void UnclaimMove(Move* m);
  std::string NewId();

  const Options options_;
  ShimChannel* const shims_;
  Checkpointer* const criu_;
  ProcessControl* const procs_;
  std::unique_ptr<AddressControl> own_addresses_;
  AddressControl* const addresses_;

  absl::Mutex mu_;
  std::set<pid_t> moving_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::MigrationReport> in_flight_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::MigrationReport> recent_ ABSL_GUARDED_BY(mu_);
  // Shared: an abort takes a move out while its restore may still run.
  std::map<std::string, std::shared_ptr<Incoming>> incoming_ ABSL_GUARDED_BY(mu_);
  // Set once Recover() has put back the incoming moves a previous run left.
  bool incoming_known_ ABSL_GUARDED_BY(mu_) = false;
  // The moves this run began, as source or destination: Recover() runs
  // while this run already serves, and leaves their records alone (they
  // are not a previous run's).
  std::set<std::string> begun_here_ ABSL_GUARDED_BY(mu_);
  bool BegunHere(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  const absl::Time started_ = absl::Now();
  // ReconnectPeers' answers by request (its bytes): running, or done and
  // ok (the last kAnswersKept of those).
  struct Answer {
    bool done = false;
    absl::StatusOr<v1::ReconnectPeersResponse> result;
  };
  static constexpr size_t kAnswersKept = 64;
  std::map<std::string, std::shared_ptr<Answer>> answers_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> answered_in_order_ ABSL_GUARDED_BY(mu_);
  absl::CondVar answered_;
  // Pids this host peer-quiesced for each migration id.
  std::map<std::string, std::set<pid_t>> peer_sets_ ABSL_GUARDED_BY(mu_);
  // Endpoints whose own move has begun to quiesce them (quiesce.cc).
  std::map<pid_t, std::string> quiescing_ ABSL_GUARDED_BY(mu_);  // pid -> its move's id
  // Endpoints restored here whose source has not resumed them yet.
  std::set<pid_t> arriving_ ABSL_GUARDED_BY(mu_);
  // Endpoints this host suspended (Suspend), by pid, until Resume. Their
  // pids stay in moving_ meanwhile. Suspend and Resume run one at a time.
  absl::Mutex suspend_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::map<pid_t, std::unique_ptr<Move>> suspended_ ABSL_GUARDED_BY(suspend_mu_);
  // The same endpoints, released: where each of their peers is now (by
  // virtual GID), noted when a peer came back while they were released
  // (both ends suspended, as for a snapshot of two VMs). Their restore
  // connects there.
  std::map<pid_t, std::map<std::string, v1::Mapping>> held_peers_ ABSL_GUARDED_BY(mu_);
  absl::Mutex guests_mu_;
  v1::GuestNicTable guest_nics_ ABSL_GUARDED_BY(guests_mu_);
  // `criu check`, once, under a lock of its own: other calls need not
  // wait for it.
  absl::Mutex criu_mu_;
  bool criu_checked_ ABSL_GUARDED_BY(criu_mu_) = false;
  absl::Status criu_status_ ABSL_GUARDED_BY(criu_mu_);
  // WatchPostCopy's threads, told to end and joined by ~Migrator.
  absl::Notification stopping_;
  absl::Mutex watchers_mu_;
  std::vector<std::thread> watchers_ ABSL_GUARDED_BY(watchers_mu_);
};

// A guest's RDMA NIC in its domain XML: the <interface> with this alias
// (a libvirt user alias), and the <interface> that hot-plugs one.
inline constexpr char kGuestNicAlias[] = "ua-rdmavirt-nic";
std::string GuestInterfaceXml(const std::string& bridge, const std::string& mac);

// "migrate" phases in order, for reports and tests.
inline constexpr const char* kPhases[] = {"prepare", "precopy",  "quiesce", "release",
                                          "dump",    "transfer", "restore", "reconnect",
                                          "cleanup", "rollback", "done"};

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_MOVE_MIGRATOR_H_
