// Shim: the verbs the application calls, over shadow objects.
//
// Every method mirrors the libibverbs function of the same name, with the
// same return values and errno. It accepts shadow objects (the ones it
// handed out) and also real ones: libibverbs and providers call exported
// verbs on their own objects (rxe's create_ah calls ibv_query_gid), and
// with the shim preloaded those calls land here; they pass straight to the
// backend.
//
// Thread-safety: control-path methods may be called from any thread; they
// serialize on mu_ (the annotations below say what it guards; clang's
// -Wthread-safety checks them). The data path (datapath/data_path.cc)
// takes no lock.
//
// One class, defined by concept: the verbs here in core/shim.cc; the
// migration steps in migration/ (release.cc: quiesce, drain, release;
// restore.cc: re-create, resume, peer reconnect; control_gate.cc: the
// control verbs' gate and the steps run on application threads;
// dirty_pages.cc: the registered memory a release marks;
// endpoint_view.cc: Describe). Each of those headers says what it owns.
#ifndef RDMAVIRT_SHIM_CORE_SHIM_H_
#define RDMAVIRT_SHIM_CORE_SHIM_H_

#include <infiniband/verbs.h>
#include <sys/time.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "shim/core/backend.h"
#include "shim/core/identity.h"
#include "shim/core/mutex.h"
#include "shim/core/objects.h"
#include "shim/core/remote_map.h"
#include "shim/core/status.h"
#include "shim/core/tables.h"
#include "shim/datapath/pause.h"
#include "shim/migration/dirty_pages.h"
#include "shim/migration/endpoint_view.h"
#include "shim/migration/epoll_regs.h"

namespace rdmavirt::shim {

class HeldFdNumbers;  // restore.cc
struct DrainMarkers;  // release.cc

class Shim {
 public:
  // Entries a migratable process's real CQs get beyond the application's:
  // room for the drain's markers (kMarkerSlack - 1 send markers at a time
  // per CQ) and a flush marker.
  static constexpr int kMarkerSlack = 128;

  // The process-wide shim over the real libibverbs, configured from the
  // environment (RDMAVIRT_ID_MODE=offset). nullptr if libibverbs is missing.
  static Shim* Process();

  // migratable: every queue and CQ goes through the pause gate (the
  // translating path), so the migration steps below may run. Without it
  // posts and polls may take the fast path, and Quiesce refuses.
  // probed (migratable only): posts and polls on the marked path jump
  // into the provider with no mark raised, and the pause asks each thread
  // where it is instead (thread_probe.h; the caller installed the probe).
  Shim(VerbsBackend* backend, IdentityMode mode, bool migratable = false, bool probed = false);
  Shim(const Shim&) = delete;
  Shim& operator=(const Shim&) = delete;

  const IdentityMode& mode() const { return mode_; }
  VerbsBackend* backend() const { return backend_; }

  ibv_device** GetDeviceList(int* num);
  void FreeDeviceList(ibv_device** list);
  ibv_context* OpenDevice(ibv_device* device);
  int CloseDevice(ibv_context* ctx);
  int GetAsyncEvent(ibv_context* ctx, ibv_async_event* event);
  void AckAsyncEvent(ibv_async_event* event);

  int QueryDevice(ibv_context* ctx, ibv_device_attr* attr);
  int QueryDeviceEx(ibv_context* ctx, const ibv_query_device_ex_input* input,
                    ibv_device_attr_ex* attr, size_t size);
  int QueryPort(ibv_context* ctx, uint8_t port, ibv_port_attr* attr, size_t size);
  int QueryGid(ibv_context* ctx, uint8_t port, int index, ibv_gid* gid);
  int QueryGidEx(ibv_context* ctx, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                 uint32_t flags, size_t size);
  ssize_t QueryGidTable(ibv_context* ctx, ibv_gid_entry* entries, size_t max, uint32_t flags,
                        size_t size);
  int QueryPkey(ibv_context* ctx, uint8_t port, int index, __be16* pkey);
  int QueryGidType(ibv_context* ctx, uint8_t port, unsigned int index, int* type);
  int ResolveEthL2FromGid(ibv_context* ctx, ibv_ah_attr* attr, uint8_t mac[6], uint16_t* vid);
  int GetPkeyIndex(ibv_context* ctx, uint8_t port, __be16 pkey);

  ibv_pd* AllocPd(ibv_context* ctx);
  int DeallocPd(ibv_pd* pd);
  ibv_mr* RegMr(ibv_pd* pd, void* addr, size_t length, uint64_t iova, unsigned int access);
  int ReregMr(ibv_mr* mr, int flags, ibv_pd* pd, void* addr, size_t length, int access);
  int DeregMr(ibv_mr* mr);

  ibv_comp_channel* CreateCompChannel(ibv_context* ctx);
  int DestroyCompChannel(ibv_comp_channel* channel);
  ibv_cq* CreateCq(ibv_context* ctx, int cqe, void* cq_context, ibv_comp_channel* channel,
                   int comp_vector);
  ibv_cq_ex* CreateCqEx(ibv_context* ctx, ibv_cq_init_attr_ex* attr);
  int ResizeCq(ibv_cq* cq, int cqe);
  int DestroyCq(ibv_cq* cq);
  int GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context);
  void AckCqEvents(ibv_cq* cq, unsigned int nevents);

  ibv_srq* CreateSrq(ibv_pd* pd, ibv_srq_init_attr* attr);
  int ModifySrq(ibv_srq* srq, ibv_srq_attr* attr, int mask);
  int QuerySrq(ibv_srq* srq, ibv_srq_attr* attr);
  int DestroySrq(ibv_srq* srq);

  ibv_qp* CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr);
  ibv_qp* CreateQpEx(ibv_context* ctx, ibv_qp_init_attr_ex* attr);
  ibv_qp_ex* QpToQpEx(ibv_qp* qp);
  int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask);
  int QueryQp(ibv_qp* qp, ibv_qp_attr* attr, int mask, ibv_qp_init_attr* init);
  int DestroyQp(ibv_qp* qp);
  int QueryEce(ibv_qp* qp, ibv_ece* ece);
  int SetEce(ibv_qp* qp, ibv_ece* ece);
  int QueryQpDataInOrder(ibv_qp* qp, ibv_wr_opcode op, uint32_t flags);

  ibv_ah* CreateAh(ibv_pd* pd, ibv_ah_attr* attr);
  int InitAhFromWc(ibv_context* ctx, uint8_t port, ibv_wc* wc, ibv_grh* grh, ibv_ah_attr* attr);
  ibv_ah* CreateAhFromWc(ibv_pd* pd, ibv_wc* wc, ibv_grh* grh, uint8_t port);
  int DestroyAh(ibv_ah* ah);
  int AttachMcast(ibv_qp* qp, const ibv_gid* gid, uint16_t lid);
  int DetachMcast(ibv_qp* qp, const ibv_gid* gid, uint16_t lid);

  // Caches what a moved peer endpoint published (remote_map.h). QPs
  // already connected to its virtual GID translate through it from now on;
  // QPs and AHs created toward it later do so from the start. Re-pointing
  // a connected QP's hardware state at the new location is the reconnect
  // step of a migration. 0, or ENOMEM.
  int PublishRemote(const RemoteMapping& mapping);
  // The cached endpoint behind a virtual GID, or nullptr: the newest one
  // published; with `virtual_qpn`, the newest that owns that QPN (another
  // endpoint of the same GID may not have moved).
  const RemoteEndpoint* FindRemote(const ibv_gid& virtual_gid) const;
  const RemoteEndpoint* FindRemote(const ibv_gid& virtual_gid, uint32_t virtual_qpn) const;

  // ---- Migration (migration/: release.cc, restore.cc, control_gate.cc). Called by one thread at a
  // time (the control thread); the application's threads keep posting and polling.
  bool migratable() const { return migratable_; }
  // Pauses every queue and CQ (posts are queued and reported as posted,
  // polls find nothing), then waits up to drain_timeout_ms for every send
  // posted to complete, moving completions into the shadow CQs; with
  // `toward`, only the sends of QPs connected to that virtual GID (a
  // peer's quiesce: its other QPs are paused, not re-made).
  // `drained_sends`: successful send completions found meanwhile.
  // DEADLINE_EXCEEDED leaves the endpoint paused: Resume() to roll back.
  Status Quiesce(uint32_t drain_timeout_ms, uint32_t* drained_sends,
                 const ibv_gid* toward = nullptr);
  // After Quiesce: records the receives not yet completed, destroys every
  // physical resource and closes the devices (nothing of the HCA's stays
  // mapped or open, so CRIU can dump the process). Registered pages are
  // marked for the dump (DirtyPages) but those in `known` whose content
  // has not changed; `count`, when given, says how many of each.
  // `lock_registered` (post-copy): the registered memory is then locked
  // (mlock) where the application had not locked it, so that CRIU dumps it
  // whole instead of leaving it to its lazy pages; the restore unlocks it
  // once re-registered.
  Status Release(const KnownPages& known = KnownPages(), DirtyCount* count = nullptr,
                 bool lock_registered = false);
  // The registered memory the HCA may write ([begin, end) of each MR with
  // local or remote write or atomic access): what a release marks.
  std::vector<std::pair<uintptr_t, uintptr_t>> WritableRegistered();
  // After Release: opens `device` ("" = the first), re-creates everything
  // with the same virtual identities, re-posts the outstanding receives and
  // replays each QP's transitions toward its peers (those in `peers` where
  // they moved). Stays paused. A failure destroys what it re-created.
  Status Restore(const std::string& device, const std::vector<RemoteMapping>& peers);
  // Replays the posts queued during the pause, in order, and lifts it.
  Status Resume();
  // Peers moved (or were restored in place): QPs connected to any of them
  // are reset and re-connected to where they are now, with their
  // outstanding receives re-posted; AHs toward them re-created; then
  // Resume(), unless `keep_paused`.
  Status PeerReconnect(const std::vector<RemoteMapping>& mappings, bool keep_paused = false);
  Status PeerReconnect(const RemoteMapping& mapping) {
    return PeerReconnect(std::vector<RemoteMapping>{mapping});
  }
  EndpointView Describe() const;
  // Data path, while paused: an application thread runs the step the
  // control thread left for it, if any (see OnAppThread in control_gate.cc).
  void RunPendingStep();
  bool step_pending() const { return task_.load(std::memory_order_relaxed) != nullptr; }
  // How long a step waits for an application thread (tests shorten it).
  void set_app_thread_wait_ms(int ms) { app_thread_wait_ms_ = ms; }
  // How long the control thread then waits for a step an application
  // thread took up, beyond the step's own deadline (tests shorten it).
  void set_step_timeout_ms(int ms) { step_timeout_ms_ = ms; }
  // Steps run by application threads so far.
  int steps_on_app_threads() const { return steps_on_app_threads_.load(); }
  // How long a release waits for the application's control verbs already
  // running to return (tests shorten it).
  void set_control_wait_ms(int ms) { control_wait_ms_ = ms; }
  // Application threads waiting in a control verb for the endpoint to be
  // back (tests wait for them).
  int control_waiters() const { return control_waiters_.load(); }

  // Data path (UD receives): the moved peer now behind a physical GID that
  // sent from `physical_qpn`, newest first, or nullptr. Lock-free.
  const RemoteEndpoint* RemoteAt(const ibv_gid& physical_gid, uint32_t physical_qpn) const;
  // A GID of a UD receive's GRH as the application should see it.
  // Lock-free, so not analysed: it reads the endpoint's GIDs (written under
  // mu_) only once gid_moved_, stored after them with release order, says
  // they are set.
  ibv_gid VirtualizeGid(const ibv_gid& g,
                        const RemoteEndpoint* from) const ABSL_NO_THREAD_SAFETY_ANALYSIS;

  // Read-only views for the migration side and tests.
  std::vector<const Qp*> Qps() const;
  std::vector<const Mr*> Mrs() const;

  // The data path's tables (data_path.cc).
  const MrTable& mr_table() const { return mrs_; }
  const QpIndex& qp_index() const { return qp_index_; }

 private:
  enum class Kind { kContext, kPd, kMr, kChannel, kCq, kSrq, kQp, kAh };

  // The registry of shadows: written with mu_ and registry_mu_ held (so a
  // step holding mu_ may iterate it), read by lookups with registry_mu_.
  void Register(const void* p, Kind kind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unregister(const void* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The registry, read by a holder of mu_: every write holds mu_ as well
  // as registry_mu_ (the one lock shadows_ is annotated with), a rule the
  // analysis cannot state, so this one accessor is not analysed.
  const std::unordered_map<const void*, Kind>& Shadows() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return shadows_;
  }
  template <typename T>
  T* Find(const void* p, Kind kind) const;
  Context* FindContext(ibv_context* c) const;
  Pd* FindPd(ibv_pd* p) const;
  Cq* FindCq(ibv_cq* c) const;
  Srq* FindSrq(ibv_srq* s) const;
  Qp* FindQp(ibv_qp* q) const;
  Channel* FindChannel(ibv_comp_channel* c) const;

  ibv_qp* AdoptQp(Context* ctx, Pd* pd, ibv_qp* real, const ibv_qp_init_attr_ex& init);
  // Calls create(n) with n = cqe + CqSlack(), and with less slack if the
  // device refuses that depth (EINVAL, ENOMEM): an application that asks
  // for the deepest CQ still gets it. *slack: what the real CQ got.
  template <typename Create>
  static auto WithSlack(int cqe, int want, Create create, int* slack) -> decltype(create(0));
  ibv_cq* AdoptCq(Context* ctx, ibv_cq* real, ibv_cq_ex* real_ex, Channel* ch, void* user_context,
                  int comp_vector, uint64_t wc_flags, int cqe, int slack);
  void VirtualizeQpAttr(ibv_qp_attr* attr, int mask) const;
  // Whether a QP/SRQ may post untranslated (data_path.cc's fast path).
  // The data path a QP's posts take (objects.h), and a CQ's polls.
  Path QpPath(const Qp& qp) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CqTranslates(Cq* cq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // for good
  // Some lkey now differs from the hardware's: every queue translates.
  void KeysDiverged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // To what the hardware takes; `remote`: the moved peer addressed, if any.
  void PhysicalizeQpAttr(ibv_qp_attr* attr, int mask, const RemoteEndpoint* remote) const;
  const RemoteEndpoint* FindRemoteLocked(const ibv_gid& virtual_gid) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const RemoteEndpoint* FindRemoteLocked(const ibv_gid& virtual_gid, uint32_t virtual_qpn) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `ah` reaches `r` (a moved endpoint behind its GID) through an AH of its
  // own from now on; one of an earlier move of the same endpoint is
  // replaced. ENOMEM, or EAGAIN when the AH has routes to kMaxAhRoutes
  // endpoints already.
  int RouteAhLocked(Ah* ah, const RemoteEndpoint* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The AH's own hardware AH, to its GID's place; when that cannot be
  // resolved and an endpoint of the GID moved, to where it is now. nullptr
  // with errno set.
  ibv_ah* CreateHomeAhLocked(Pd* pd, const ibv_ah_attr& attr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every route `ah` needs now: one per moved endpoint behind its GID.
  int RouteAhToAllLocked(Ah* ah) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const RemoteEndpoint* PublishRemoteLocked(std::unique_ptr<RemoteEndpoint> e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The port GID this endpoint's QPs use becomes its virtual GID.
  void NoteEndpointGid(Context* ctx, uint8_t port, int sgid_index)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void GuessEndpointGid() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The device, GID index and physical GID GuessEndpointGid takes; false
  // without a device.
  bool GuessGid(Context** ctx, int* index, ibv_gid* gid) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  template <typename T>
  std::vector<T*> All(Kind kind) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DestroyReal() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The process's interval timers (setitimer(2), alarm(2)) across a
  // release: stopped, what was left of each kept, and armed again at the
  // resume (release.cc says why).
  void StopItimers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RestartItimers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status ReleaseNow(const KnownPages& known, DirtyCount* count, bool lock_registered);
  std::vector<std::pair<uintptr_t, uintptr_t>> WritableRegisteredLocked()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status RestoreNow(const std::string& device, const std::vector<RemoteMapping>& peers);
  Status ResumeNow();
  Status ReplayQueuedPosts() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, pause_.queue_mu());
  Status PeerReconnectNow(const std::vector<RemoteMapping>& mappings, bool keep_paused);
  // Runs `step` (named `name` in errors) on an application thread once the
  // process was restored, else here. Waits at most app_thread_wait_ms_
  // for a thread to take it up, then `budget_ms` (the step's own
  // deadline) plus step_timeout_ms_ for it to finish: DEADLINE_EXCEEDED
  // past that, and UNAVAILABLE for any step asked while one still runs.
  Status OnAppThread(const char* name, std::function<Status()> step, int budget_ms = 0);

  // The control verbs' gate. Every verb other than the data path and the
  // event waits (which pause on their own) runs inside a ControlScope
  // once it knows the object is the endpoint's. From a release until the
  // resume the scope waits for the endpoint to be back, so that no verb
  // meets an object whose hardware half is gone, and meanwhile runs a step
  // left for an application thread (the restore may need it). A release
  // first closes the gate and waits for the verbs inside to return. A
  // thread already inside, or running a step, passes (a provider may call
  // exported verbs back). A verb that ends an object (destroys,
  // deregistration, closing, acknowledging CQ events: `when_released`)
  // also passes while the gate is closed, between steps: with the endpoint
  // released it frees the shadow alone; restored and not yet resumed, the
  // hardware half too. A step waits for it, as a release does for the rest.
  class ControlScope {
   public:
    // `applies`: the verb's object is the endpoint's (else the scope is
    // nothing).
    explicit ControlScope(Shim* shim, bool applies = true, bool when_released = false);
    ~ControlScope();
    ControlScope(const ControlScope&) = delete;
    ControlScope& operator=(const ControlScope&) = delete;

   private:
    Shim* const shim_;
    bool entered_ = false;
    bool counted_ = false;
  };
  // DEADLINE_EXCEEDED (the gate open again) when a verb stays inside
  // longer than control_wait_ms_.
  Status CloseControl();
  void OpenControl();
  // Runs a migration step on this thread (marked as one: it passes the
  // gate). While the gate is closed, a step first waits (bounded) for the
  // destroys inside to return and keeps new ones out; between steps they
  // pass.
  Status RunStep(const std::function<Status()>& step);
  Status ControlBusy();
  void ControlIdle();
  // The restore's sequence (restore.cc), one step per kind of object.
  Status RecreateReal(const std::string& device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The device named `device` ("" = the first) and the list it is in (the
  // caller frees it), or NOT_FOUND / UNAVAILABLE with the list freed.
  Status FindDevice(const std::string& device, ibv_device*** list, ibv_device** dev);
  Status OpenContexts(ibv_device* dev, HeldFdNumbers* held) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status RecreatePds() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status ReregisterMrs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnlockRegistered() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status RecreateChannels(HeldFdNumbers* held) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RegisterEventFdsAgain() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status RecreateCqs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status RecreateSrqs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status RecreateQps() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status RecreateAhs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status RepostOutstanding() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefreshEndpointGid() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status Reconnect(Qp* qp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Quiesce's second half: the drain, on an application thread if need be.
  Status DrainNow(uint32_t drain_timeout_ms, uint32_t* drained_sends, const ibv_gid* toward);
  // A round of the drain's markers: each send CQ gets as many as its slack
  // allows. The QPs still waiting for one; `why` says what failed.
  uint64_t PostMarkers(std::vector<DrainMarkers>* markers, std::string* why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends not yet known complete: outstanding markers and UD QPs' signaled
  // sends. `*unsignaled_tail`: a UD QP's last sends were unsignaled.
  // When `late`, `which` names each QP still waited for.
  uint64_t SendsInFlight(const std::vector<Qp*>& qps, bool late, bool* unsignaled_tail,
                         std::string* which) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CQ entries a migratable process's real CQs have beyond the depth the
  // application asked for: room for the drain's markers, one send marker
  // and one receive marker outstanding per CQ at a time (release.cc), so
  // that they never overflow a CQ the application sized exactly.
  int CqSlack() const { return migratable_ ? kMarkerSlack : 0; }
  // Sets or clears every queue's and CQ's `paused` flag (pause.h).
  void SetPaused(bool paused) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The providers' post and poll entries the probed path jumps to: where
  // the pause looks for threads still inside (thread_probe.h).
  std::vector<const void*> ProviderEntries() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Posts a QP's drain marker; false if its send queue is full (or the
  // post failed: `why` says so).
  bool PostSendMarker(Qp* qp, std::string* why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // and paused
  // Moves QPs to the error state and takes their receives still posted
  // into Qp::outstanding, counted from their flushes.
  // Datagrams a peer sent (its UD or UC send completed) may still be
  // queued in the kernel for this host's receiver: rxe completes such a
  // send when it hands the packet on, and for a peer on the same host the
  // receiver's responder runs a moment later. The error state that counts
  // the receives drops what is still queued, so the receive CQs of UD and
  // UC QPs are polled first until they stay quiet for 50 ms (1 s at most).
  void SettleUnacknowledgedReceives(const std::vector<Qp*>& qps) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailAndCountRecvs(const std::vector<Qp*>& qps)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);    // and paused
  static uint32_t FlushBound(const Qp* qp);  // completions a QP's move to ERR may bring
  // Their flushes fit their CQs.
  void FailAndCountRecvsOf(const std::vector<Qp*>& qps) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Each QP to the error state, a marker receive behind its receives.
  void StartRecvFlushes(const std::vector<Qp*>& qps) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RDMAVIRT_LOG=moves: each QP's receives at the resume.
  void LogResume() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int ReplayTransitions(Qp* qp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int RealQpState(const Qp* qp);  // the HCA's, or -1
  // Completion events (shim.cc): what a release must acknowledge.
  void NoteEventDelivered(Cq* cq, ibv_cq* real);
  // Release: acknowledges what the application has not, and marks the
  // channels released, with their waiters out of poll(2); then restore
  // and resume undo it (release.cc, restore.cc).
  void CloseEvents(Cq* cq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseChannel(Channel* ch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReopenChannel(Channel* ch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A re-opened device's write relay (write_relay.h), made on the thread
  // that opened it; dropped before the device closes.
  void RelayWrites(Context* ctx);
  void DropRelay(Context* ctx);
  // The device's async fds and the channels' fds, as the application knows
  // them (epoll_regs.h).
  std::vector<int> EventFds() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // At resume, while still paused: drains and arms the real CQs the
  // application armed, and returns those that hold completions; once the
  // data path is open, OweEvents wakes their waiters with an event each.
  std::vector<Cq*> ArmForResume() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OweEvents(const std::vector<Cq*>& cqs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Threads waiting in GetCqEvent look again (a step waits for them).
  void WakeEventWaiters();

  VerbsBackend* const backend_;
  const IdentityMode mode_;
  mutable Mutex mu_;
  mutable Mutex registry_mu_ ABSL_ACQUIRED_AFTER(mu_);  // never held across a verb
  // Written under mu_ and registry_mu_ (Shadows()).
  std::unordered_map<const void*, Kind> shadows_ ABSL_GUARDED_BY(registry_mu_);
  // Writes under mu_; the data path reads them with no lock (tables.h),
  // which an annotation would refuse.
  MrTable mrs_;
  QpIndex qp_index_;
  std::vector<std::unique_ptr<RemoteEndpoint>> remotes_ ABSL_GUARDED_BY(mu_);  // newest last
  // Every live lkey equals the hardware's (default mode, until a key
  // collides or changes), so posts need no key translated.
  bool keys_identity_ ABSL_GUARDED_BY(mu_);

  const bool migratable_;
  const bool probed_;
  // The data path's pause; its objects point at it when migratable_.
  PauseGate pause_;
  int app_thread_wait_ms_ = 2000;
  // Under the migrator's 30 s wait for an answer, so that the answer says
  // what the shim waited for.
  int step_timeout_ms_ = 20000;
  std::atomic<int> steps_on_app_threads_{0};
  Mutex control_mu_ ABSL_ACQUIRED_AFTER(mu_);  // never held across a verb or a step
  CondVar control_cv_;
  int control_inside_ ABSL_GUARDED_BY(control_mu_) = 0;
  bool control_closed_ ABSL_GUARDED_BY(control_mu_) = false;
  // Closed, and no step runs.
  bool control_idle_ ABSL_GUARDED_BY(control_mu_) = false;
  std::atomic<int> control_waiters_{0};
  int control_wait_ms_ = 10000;
  // The step in flight. A member, not the control thread's: an application
  // thread may still run it after the control thread stopped waiting, so
  // it owns what it uses, and no other step starts before it is done.
  struct PendingStep {
    std::function<Status()> run;
    const char* name = "";
    Status result;
    std::atomic<bool> done{true};
  };
  PendingStep step_;
  std::atomic<PendingStep*> task_{nullptr};
  // Every mapping published, for lock-free lookups by physical GID (the
  // RemoteEndpoints live as long as the process, in remotes_).
  static constexpr uint32_t kMaxPublished = 256;
  std::atomic<const RemoteEndpoint*> published_[kMaxPublished] = {};
  std::atomic<uint32_t> npublished_{0};
  // Set, after the GIDs below, once the endpoint sits behind another GID.
  std::atomic<bool> gid_moved_{false};
  std::atomic<bool> app_thread_steps_{false};
  // Migration state, written by the control thread under mu_.
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  // Where the application had registered EventFds() in its epoll sets, from
  // the release to the restore (epoll_regs.h).
  std::vector<EpollRegistration> epoll_regs_ ABSL_GUARDED_BY(mu_);
  // What a post-copy's release locked, unlocked by the restore ([begin, end)).
  std::vector<std::pair<uintptr_t, uintptr_t>> locked_registered_ ABSL_GUARDED_BY(mu_);
  // What StopItimers found of ITIMER_REAL, _VIRTUAL and _PROF (zero: not
  // armed, or armed again by RestartItimers).
  itimerval stopped_itimers_[3] ABSL_GUARDED_BY(mu_) = {};
  bool moved_ ABSL_GUARDED_BY(mu_) =
      false;  // re-created at least once: GIDs differ from the port's
  bool endpoint_gid_known_ ABSL_GUARDED_BY(mu_) = false;
  uint8_t endpoint_port_ ABSL_GUARDED_BY(mu_) = 0;
  int endpoint_sgid_index_ ABSL_GUARDED_BY(mu_) = 0;
  ibv_gid endpoint_virtual_gid_ ABSL_GUARDED_BY(mu_){};
  ibv_gid endpoint_physical_gid_ ABSL_GUARDED_BY(mu_){};
};

template <typename Create>
auto Shim::WithSlack(int cqe, int want, Create create, int* slack) -> decltype(create(0)) {
  const int tries[] = {want, std::min(want, 2), 0};
  for (size_t i = 0; i < 3; ++i) {
    if (i > 0 && tries[i] == tries[i - 1]) continue;
    *slack = tries[i];
    if (auto* real = create(cqe + tries[i])) return real;
    if ((errno != EINVAL && errno != ENOMEM) || tries[i] == 0) break;
  }
  return nullptr;
}

template <typename T>
std::vector<T*> Shim::All(Kind kind) const {
  std::vector<T*> out;
  for (const auto& [p, k] : Shadows())
    if (k == kind) out.push_back(static_cast<T*>(const_cast<void*>(p)));
  return out;
}

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CORE_SHIM_H_
