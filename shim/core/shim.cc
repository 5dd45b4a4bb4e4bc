#include "shim/core/shim.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <new>

#include "shim/core/async_event.h"
#include "shim/core/grh.h"
#include "shim/core/log.h"
#include "shim/datapath/context_ops.h"
#include "shim/datapath/data_path.h"
#include "shim/datapath/thread_probe.h"
#include "shim/migration/control.h"

namespace rdmavirt::shim {
namespace {

template <typename T>
T* NewZeroed() {
  T* p = new (std::nothrow) T();
  if (p == nullptr) errno = ENOMEM;
  return p;
}

void InitMutexCond(pthread_mutex_t* m, pthread_cond_t* c) {
  pthread_mutex_init(m, nullptr);
  if (c != nullptr) pthread_cond_init(c, nullptr);
}

}  // namespace

Shim* Shim::Process() {
  // Leaked on purpose: the application may call verbs from its own
  // destructors, after ours would have run.
  static Shim* shim = []() -> Shim* {
    VerbsBackend* backend = RealBackend();
    if (backend == nullptr) return nullptr;
    IdentityMode mode;
    const char* m = getenv("RDMAVIRT_ID_MODE");
    mode.offset = m != nullptr && strcmp(m, "offset") == 0;
    // Decided once, before any object exists: a migratable process's
    // posts and polls jump into the provider and its pause asks the
    // threads where they are (thread_probe.h), or, with RDMAVIRT_PAUSE=marks
    // or no probe, they run inside the threads' marks (pause.h).
    const bool migratable = MigrationEnabled();
    bool probed = false;
    if (migratable) {
      const char* p = getenv("RDMAVIRT_PAUSE");
      std::string why;
      // Installed when the library was loaded (signal_interpose.cc); again
      // is a no-op, and installs it where that did not run (tests).
      if (p == nullptr || strcmp(p, "marks") != 0) probed = InstallThreadProbe(&why);
      if (!why.empty()) Log(("the pause marks every post and poll: " + why).c_str());
    }
    return new (std::nothrow) Shim(backend, mode, migratable, probed);
  }();
  return shim;
}

Shim::Shim(VerbsBackend* backend, IdentityMode mode, bool migratable, bool probed)
    : backend_(backend),
      mode_(mode),
      keys_identity_(!mode.offset),
      migratable_(migratable),
      probed_(migratable && probed) {}

Path Shim::QpPath(const Qp& qp) const {
  // keys_identity_ is never true in offset mode. A UD QP's posts swap
  // their AH, and a moved peer's rkeys translate.
  if (!keys_identity_ || qp.shadow.qp_base.qp_type == IBV_QPT_UD ||
      qp.remote.load(std::memory_order_relaxed) != nullptr)
    return Path::kTranslated;
  return migratable_ ? Path::kMarked : Path::kDirect;
}

void Shim::CqTranslates(Cq* cq) {
  // marked_base first: a poller handing out held completions reads it
  // after it moves `path` back (data_path.cc, BackToMarked).
  cq->marked_base.store(false);
  cq->path.Set(Path::kTranslated);
}

void Shim::KeysDiverged() {
  if (!keys_identity_) return;
  keys_identity_ = false;
  for (const auto& [p, kind] : Shadows()) {
    if (kind == Kind::kQp) SetQpPath(static_cast<Qp*>(const_cast<void*>(p)), Path::kTranslated);
    if (kind == Kind::kSrq) static_cast<Srq*>(const_cast<void*>(p))->path.Set(Path::kTranslated);
  }
}

void Shim::Register(const void* p, Kind kind) {
  MutexLock lock(&registry_mu_);
  shadows_[p] = kind;
}

void Shim::Unregister(const void* p) {
  MutexLock lock(&registry_mu_);
  shadows_.erase(p);
}

// Lookups take only the registry's lock, never mu_: a control step holds
// mu_ across verbs that may wait for an application thread (a CQ's destroy
// waits for its events to be acknowledged), and that thread may be here.
template <typename T>
T* Shim::Find(const void* p, Kind kind) const {
  if (p == nullptr) return nullptr;
  MutexLock lock(&registry_mu_);
  auto it = shadows_.find(p);
  return it != shadows_.end() && it->second == kind ? reinterpret_cast<T*>(const_cast<void*>(p))
                                                    : nullptr;
}

Context* Shim::FindContext(ibv_context* c) const {
  if (c == nullptr) return nullptr;
  MutexLock lock(&registry_mu_);
  auto it = shadows_.find(c);
  return it != shadows_.end() && it->second == Kind::kContext ? AsContext(c) : nullptr;
}
// Each shadow struct starts with its ibv_* struct, so the pointer the
// application holds is the shadow's address.
Pd* Shim::FindPd(ibv_pd* p) const { return Find<Pd>(p, Kind::kPd); }
Cq* Shim::FindCq(ibv_cq* c) const { return Find<Cq>(c, Kind::kCq); }
Srq* Shim::FindSrq(ibv_srq* s) const { return Find<Srq>(s, Kind::kSrq); }
Qp* Shim::FindQp(ibv_qp* q) const { return Find<Qp>(q, Kind::kQp); }
Channel* Shim::FindChannel(ibv_comp_channel* c) const { return Find<Channel>(c, Kind::kChannel); }

// ---------------------------------------------------------------- devices

ibv_device** Shim::GetDeviceList(int* num) {
  // Devices are not shadowed: librdmacm matches them by pointer and GUID
  // across calls, and they carry no identity the shim virtualizes.
  return backend_->GetDeviceList(num);
}

void Shim::FreeDeviceList(ibv_device** list) { backend_->FreeDeviceList(list); }

ibv_context* Shim::OpenDevice(ibv_device* device) {
  // A device opened while the endpoint is away would stay open in the dump.
  ControlScope scope(this);
  ibv_context* real = backend_->OpenDevice(device);
  if (real == nullptr) return nullptr;
  Context* ctx = NewZeroed<Context>();
  if (ctx == nullptr) {
    backend_->CloseDevice(real);
    errno = ENOMEM;
    return nullptr;
  }
  ctx->real = real;
  ctx->shim = this;
  ctx->mode = mode_;
  ibv_context* s = Shadow(ctx);
  s->device = real->device;
  s->cmd_fd = real->cmd_fd;
  s->async_fd = real->async_fd;
  s->num_comp_vectors = real->num_comp_vectors;
  InitMutexCond(&s->mutex, nullptr);
  InstallContextOps(ctx, migratable_, probed_);
  MutexLock lock(&mu_);
  // Its queues translate from the start (moved_: a device opened after
  // the process moved has new identities too).
  if (mode_.offset || moved_) InstallTranslatingOps(ctx);
  // In a restored process every thread has credentials of its own, and
  // the kernel takes a device's writes only from the opener's: a device
  // first opened there (librdmacm opens one when a listener's first
  // client comes, on the thread that takes the event) needs the relay a
  // re-opened one has. Before, the other threads' posts failed with EACCES.
  if (moved_) RelayWrites(ctx);
  Register(s, Kind::kContext);
  return s;
}

int Shim::CloseDevice(ibv_context* c) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr, /*when_released=*/true);
  if (ctx == nullptr) return backend_->CloseDevice(c);
  if (ctx->real != nullptr) DropRelay(ctx);
  const int rc = ctx->real != nullptr ? backend_->CloseDevice(ctx->real) : 0;
  if (rc != 0) return rc;
  {
    MutexLock lock(&mu_);
    Unregister(c);
  }
  pthread_mutex_destroy(&c->mutex);
  delete ctx;
  return 0;
}

int Shim::GetAsyncEvent(ibv_context* c, ibv_async_event* event) {
  Context* ctx = FindContext(c);
  const int rc = backend_->GetAsyncEvent(ctx ? ctx->real : c, event);
  if (rc != 0 || ctx == nullptr) return rc;
  // The kernel returns the real objects; their user context is the shadow.
  switch (ElementOf(event->event_type)) {
    case EventElement::kQp:
      event->element.qp = &static_cast<Qp*>(event->element.qp->qp_context)->shadow.qp_base;
      break;
    case EventElement::kCq:
      event->element.cq =
          reinterpret_cast<ibv_cq*>(&static_cast<Cq*>(event->element.cq->cq_context)->shadow);
      break;
    case EventElement::kSrq:
      event->element.srq = &static_cast<Srq*>(event->element.srq->srq_context)->shadow;
      break;
    case EventElement::kOther:
      break;
  }
  return 0;
}

void Shim::AckAsyncEvent(ibv_async_event* event) {
  Qp* qp = nullptr;
  Cq* cq = nullptr;
  Srq* srq = nullptr;
  switch (ElementOf(event->event_type)) {
    case EventElement::kQp:
      qp = FindQp(event->element.qp);
      break;
    case EventElement::kCq:
      cq = FindCq(event->element.cq);
      break;
    case EventElement::kSrq:
      srq = FindSrq(event->element.srq);
      break;
    case EventElement::kOther:
      break;
  }
  ControlScope scope(this, qp != nullptr || cq != nullptr || srq != nullptr);
  ibv_async_event real = *event;
  if (qp != nullptr) real.element.qp = qp->real;
  if (cq != nullptr) real.element.cq = cq->real;
  if (srq != nullptr) real.element.srq = srq->real;
  backend_->AckAsyncEvent(&real);
}

// ---------------------------------------------------------------- queries

int Shim::QueryDevice(ibv_context* c, ibv_device_attr* attr) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  return backend_->QueryDevice(ctx ? ctx->real : c, attr);
}

int Shim::QueryDeviceEx(ibv_context* c, const ibv_query_device_ex_input* input,
                        ibv_device_attr_ex* attr, size_t size) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  ibv_context* real = ctx ? ctx->real : c;
  auto* vctx = verbs_get_ctx_op(real, query_device_ex);
  if (vctx == nullptr) return EOPNOTSUPP;
  return vctx->query_device_ex(real, input, attr, size);
}

int Shim::QueryPort(ibv_context* c, uint8_t port, ibv_port_attr* attr, size_t size) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  ibv_port_attr full{};
  const int rc = backend_->QueryPort(ctx ? ctx->real : c, port, &full);
  if (rc == 0) memcpy(attr, &full, size < sizeof(full) ? size : sizeof(full));
  return rc;
}

int Shim::QueryGid(ibv_context* c, uint8_t port, int index, ibv_gid* gid) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  const int rc = backend_->QueryGid(ctx ? ctx->real : c, port, index, gid);
  if (rc == 0 && ctx != nullptr) *gid = mode_.VirtualGid(*gid);
  if (rc == 0 && ctx != nullptr) {
    MutexLock lock(&mu_);
    // After a move the endpoint keeps the GID its peers know it by.
    if (moved_ && port == endpoint_port_ && index == endpoint_sgid_index_)
      *gid = endpoint_virtual_gid_;
  }
  return rc;
}

int Shim::QueryGidEx(ibv_context* c, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                     uint32_t flags, size_t size) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  const int rc = backend_->QueryGidEx(ctx ? ctx->real : c, port, index, entry, flags, size);
  if (rc == 0 && ctx != nullptr) entry->gid = mode_.VirtualGid(entry->gid);
  return rc;
}

ssize_t Shim::QueryGidTable(ibv_context* c, ibv_gid_entry* entries, size_t max, uint32_t flags,
                            size_t size) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  const ssize_t n = backend_->QueryGidTable(ctx ? ctx->real : c, entries, max, flags, size);
  if (ctx != nullptr) {
    for (ssize_t i = 0; i < n; ++i) {
      auto* e = reinterpret_cast<ibv_gid_entry*>(reinterpret_cast<char*>(entries) + i * size);
      e->gid = mode_.VirtualGid(e->gid);
    }
  }
  return n;
}

int Shim::QueryPkey(ibv_context* c, uint8_t port, int index, __be16* pkey) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  return backend_->QueryPkey(ctx ? ctx->real : c, port, index, pkey);
}

int Shim::QueryGidType(ibv_context* c, uint8_t port, unsigned int index, int* type) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  return backend_->QueryGidType(ctx ? ctx->real : c, port, index, type);
}

int Shim::ResolveEthL2FromGid(ibv_context* c, ibv_ah_attr* attr, uint8_t mac[6], uint16_t* vid) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  if (ctx == nullptr) return backend_->ResolveEthL2FromGid(c, attr, mac, vid);
  // The destination is resolved where it is now (its physical GID).
  ibv_ah_attr real_attr = *attr;
  if (real_attr.is_global) {
    const RemoteEndpoint* remote = FindRemote(attr->grh.dgid);
    real_attr.grh.dgid = remote ? remote->physical_gid() : mode_.PhysicalGid(attr->grh.dgid);
  }
  return backend_->ResolveEthL2FromGid(ctx->real, &real_attr, mac, vid);
}

int Shim::GetPkeyIndex(ibv_context* c, uint8_t port, __be16 pkey) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  return backend_->GetPkeyIndex(ctx ? ctx->real : c, port, pkey);
}

// ---------------------------------------------------------------- PD, MR

ibv_pd* Shim::AllocPd(ibv_context* c) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  if (ctx == nullptr) return backend_->AllocPd(c);
  ibv_pd* real = backend_->AllocPd(ctx->real);
  if (real == nullptr) return nullptr;
  Pd* pd = NewZeroed<Pd>();
  if (pd == nullptr) {
    backend_->DeallocPd(real);
    errno = ENOMEM;
    return nullptr;
  }
  pd->real = real;
  pd->ctx = ctx;
  pd->shadow.context = c;
  pd->shadow.handle = real->handle;
  MutexLock lock(&mu_);
  Register(pd, Kind::kPd);
  return &pd->shadow;
}

int Shim::DeallocPd(ibv_pd* p) {
  Pd* pd = FindPd(p);
  ControlScope scope(this, pd != nullptr, /*when_released=*/true);
  if (pd == nullptr) return backend_->DeallocPd(p);
  const int rc = pd->real != nullptr ? backend_->DeallocPd(pd->real) : 0;
  if (rc != 0) return rc;
  MutexLock lock(&mu_);
  Unregister(pd);
  delete pd;
  return 0;
}

ibv_mr* Shim::RegMr(ibv_pd* p, void* addr, size_t length, uint64_t iova, unsigned int access) {
  Pd* pd = FindPd(p);
  ControlScope scope(this, pd != nullptr);
  if (pd == nullptr) return backend_->RegMr(p, addr, length, iova, access);
  ibv_mr* real = backend_->RegMr(pd->real, addr, length, iova, access);
  if (real == nullptr) return nullptr;
  Mr* mr = NewZeroed<Mr>();
  uint32_t slot = 0;
  bool same_lkey = false;
  if (mr != nullptr) {
    MutexLock lock(&mu_);
    // Default mode keeps the hardware's lkey when its slot is free: then
    // nothing is translated until the MR moves. Otherwise (offset mode, a
    // collision) the shim picks a slot of its own.
    same_lkey = !mode_.offset && mrs_.Claim(LkeySlot(real->lkey));
    if (same_lkey) {
      slot = LkeySlot(real->lkey);
    } else if (mrs_.Allocate(&slot)) {
      mrs_.Set(slot, 0xffffffffu, 0);  // held until published
    } else {
      delete mr;
      mr = nullptr;
    }
  }
  if (mr == nullptr) {
    backend_->DeregMr(real);
    errno = ENOMEM;
    return nullptr;
  }
  mr->real = real;
  mr->pd = pd;
  mr->slot = slot;
  mr->iova = iova;
  mr->access = access;
  mr->shadow.context = p->context;
  mr->shadow.pd = p;
  mr->shadow.addr = real->addr;
  mr->shadow.length = real->length;
  mr->shadow.handle = real->handle;
  mr->shadow.lkey = same_lkey ? real->lkey : MakeVirtualLkey(slot, real->lkey, mode_.offset);
  mr->shadow.rkey = mode_.VirtualRkey(real->rkey);
  MutexLock lock(&mu_);
  mrs_.Set(slot, mr->shadow.lkey, real->lkey);
  if (mr->shadow.lkey != real->lkey) KeysDiverged();
  Register(mr, Kind::kMr);
  return &mr->shadow;
}

int Shim::ReregMr(ibv_mr* m, int flags, ibv_pd* p, void* addr, size_t length, int access) {
  Mr* mr = Find<Mr>(m, Kind::kMr);
  ControlScope scope(this, mr != nullptr);
  if (mr == nullptr) return backend_->ReregMr(m, flags, p, addr, length, access);
  Pd* pd = nullptr;
  if (flags & IBV_REREG_MR_CHANGE_PD) {
    pd = FindPd(p);
    if (pd == nullptr) {
      errno = EINVAL;  // as libibverbs for bad input
      return IBV_REREG_MR_ERR_INPUT;
    }
  }
  const int rc = backend_->ReregMr(mr->real, flags, pd ? pd->real : nullptr, addr, length, access);
  if (rc != 0) return rc;
  MutexLock lock(&mu_);
  if (pd != nullptr) {
    mr->pd = pd;
    mr->shadow.pd = p;
  }
  if (flags & IBV_REREG_MR_CHANGE_ACCESS) mr->access = access;
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    mr->shadow.addr = mr->real->addr;
    mr->shadow.length = mr->real->length;
    mr->iova = reinterpret_cast<uintptr_t>(addr);
  }
  // The virtual lkey stays; the rkey follows the hardware, as it would.
  mrs_.Set(mr->slot, mr->shadow.lkey, mr->real->lkey);
  if (mr->shadow.lkey != mr->real->lkey) KeysDiverged();
  mr->shadow.rkey = mode_.VirtualRkey(mr->real->rkey);
  return 0;
}

int Shim::DeregMr(ibv_mr* m) {
  Mr* mr = Find<Mr>(m, Kind::kMr);
  ControlScope scope(this, mr != nullptr, /*when_released=*/true);
  if (mr == nullptr) return backend_->DeregMr(m);
  const int rc = mr->real != nullptr ? backend_->DeregMr(mr->real) : 0;
  if (rc != 0) return rc;
  MutexLock lock(&mu_);
  mrs_.Clear(mr->slot);
  Unregister(mr);
  delete mr;
  return 0;
}

// ---------------------------------------------------------------- CQ

ibv_comp_channel* Shim::CreateCompChannel(ibv_context* c) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  if (ctx == nullptr) return backend_->CreateCompChannel(c);
  ibv_comp_channel* real = backend_->CreateCompChannel(ctx->real);
  if (real == nullptr) return nullptr;
  Channel* ch = NewZeroed<Channel>();
  if (ch == nullptr) {
    backend_->DestroyCompChannel(real);
    errno = ENOMEM;
    return nullptr;
  }
  ch->real = real;
  ch->ctx = ctx;
  ch->shadow.context = c;
  ch->shadow.fd = real->fd;  // the application polls it
  ch->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  MutexLock lock(&mu_);
  Register(ch, Kind::kChannel);
  return &ch->shadow;
}

int Shim::DestroyCompChannel(ibv_comp_channel* c) {
  Channel* ch = FindChannel(c);
  ControlScope scope(this, ch != nullptr, /*when_released=*/true);
  if (ch == nullptr) return backend_->DestroyCompChannel(c);
  const int rc = ch->real != nullptr ? backend_->DestroyCompChannel(ch->real) : 0;
  if (rc != 0) return rc;
  MutexLock lock(&mu_);
  Unregister(ch);
  if (ch->wake_fd >= 0) close(ch->wake_fd);
  delete ch;
  return 0;
}

ibv_cq* Shim::AdoptCq(Context* ctx, ibv_cq* real, ibv_cq_ex* real_ex, Channel* ch,
                      void* user_context, int comp_vector, uint64_t wc_flags, int cqe, int slack) {
  Cq* cq = NewZeroed<Cq>();
  if (cq == nullptr) return nullptr;
  cq->real = real;
  cq->real_poll_cq = real->context->ops.poll_cq;
  // Completions carry QPNs (and UD GRHs) that equal the virtual ones
  // unless the mode marks them.
  cq->path.Set(mode_.offset ? Path::kTranslated : migratable_ ? Path::kMarked : Path::kDirect);
  cq->marked_base.store(cq->path.get() == Path::kMarked);
  cq->cqe = cqe;
  cq->slack = slack;
  cq->real_ex = real_ex;
  cq->extended = real_ex != nullptr;
  cq->pause = migratable_ ? &pause_ : nullptr;
  cq->ctx = ctx;
  cq->qps = &qp_index_;
  cq->qp_home = qp_index_.home_slots();
  cq->channel = ch;
  cq->comp_vector = comp_vector;
  cq->wc_flags = wc_flags;
  ibv_cq_ex& s = cq->shadow;
  s.context = Shadow(ctx);
  s.channel = ch ? &ch->shadow : nullptr;
  s.cq_context = user_context;
  s.handle = real->handle;
  // The application sees the depth it would have had: the slots kept for
  // the drain's markers (CqSlack) are the shim's.
  s.cqe = real->cqe - slack;
  InitMutexCond(&s.mutex, &s.cond);
  // Completion events carry the real CQ; its user context leads back here.
  real->cq_context = cq;
  if (real_ex != nullptr) InstallCqExOps(cq);
  MutexLock lock(&mu_);
  cq->path.SetPaused(paused_);
  Register(cq, Kind::kCq);
  return reinterpret_cast<ibv_cq*>(&cq->shadow);
}

ibv_cq* Shim::CreateCq(ibv_context* c, int cqe, void* cq_context, ibv_comp_channel* channel,
                       int comp_vector) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  if (ctx == nullptr) return backend_->CreateCq(c, cqe, cq_context, channel, comp_vector);
  Channel* ch = FindChannel(channel);
  if (channel != nullptr && ch == nullptr) {
    errno = EINVAL;
    return nullptr;
  }
  int slack = 0;
  ibv_cq* real = WithSlack(
      cqe, CqSlack(),
      [&](int n) {
        return backend_->CreateCq(ctx->real, n, nullptr, ch ? ch->real : nullptr, comp_vector);
      },
      &slack);
  if (real == nullptr) return nullptr;
  ibv_cq* s = AdoptCq(ctx, real, nullptr, ch, cq_context, comp_vector, 0, cqe, slack);
  if (s == nullptr) {
    backend_->DestroyCq(real);
    errno = ENOMEM;
  }
  return s;
}

ibv_cq_ex* Shim::CreateCqEx(ibv_context* c, ibv_cq_init_attr_ex* attr) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  if (ctx == nullptr) return backend_->CreateCqEx(c, attr);
  if (attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_PD) {
    LogOnce("ibv_create_cq_ex with a parent domain is not supported");
    errno = EOPNOTSUPP;
    return nullptr;
  }
  Channel* ch = FindChannel(attr->channel);
  if (attr->channel != nullptr && ch == nullptr) {
    errno = EINVAL;
    return nullptr;
  }
  ibv_cq_init_attr_ex real_attr = *attr;
  real_attr.channel = ch ? ch->real : nullptr;
  real_attr.cq_context = nullptr;
  int slack = 0;
  ibv_cq_ex* real = WithSlack(
      static_cast<int>(attr->cqe), CqSlack(),
      [&](int n) {
        real_attr.cqe = static_cast<uint32_t>(n);
        return backend_->CreateCqEx(ctx->real, &real_attr);
      },
      &slack);
  if (real == nullptr) return nullptr;
  ibv_cq* s = AdoptCq(ctx, ibv_cq_ex_to_cq(real), real, ch, attr->cq_context, attr->comp_vector,
                      attr->wc_flags, static_cast<int>(attr->cqe), slack);
  if (s == nullptr) {
    backend_->DestroyCq(ibv_cq_ex_to_cq(real));
    errno = ENOMEM;
    return nullptr;
  }
  return reinterpret_cast<ibv_cq_ex*>(s);
}

int Shim::ResizeCq(ibv_cq* c, int cqe) {
  Cq* cq = FindCq(c);
  ControlScope scope(this, cq != nullptr);
  if (cq == nullptr) return backend_->ResizeCq(c, cqe);
  // The provider refuses a size below the completions the CQ holds
  // (EINVAL); the slack would make room for them. So a shrink is asked
  // first at the size the application gave, less what the shadow holds.
  bool shrunk = false;
  if (cq->slack > 0 && cqe < cq->shadow.cqe) {
    const int64_t held = int64_t{cq->pending_count} - cq->pending_head.load();
    if (cqe < 1 || cqe < held) return EINVAL;
    const int rc = backend_->ResizeCq(cq->real, std::max<int>(1, cqe - static_cast<int>(held)));
    if (rc != 0) return rc;
    shrunk = true;
  }
  int slack = 0, rc = 0;
  bool ok = WithSlack(
      cqe, CqSlack(),
      [&](int n) -> const Cq* {
        rc = backend_->ResizeCq(cq->real, n);
        errno = rc;
        return rc == 0 ? cq : nullptr;
      },
      &slack);
  if (!ok && shrunk) {
    // At the size asked, with what slack its rounding gave.
    ok = true;
    rc = 0;
    slack = std::max(0, cq->real->cqe - cqe);
  }
  if (ok) {
    cq->slack = slack;
    cq->shadow.cqe = cq->real->cqe - slack;
    cq->cqe = cqe;  // what a restore re-creates
  }
  return rc;
}

int Shim::DestroyCq(ibv_cq* c) {
  Cq* cq = FindCq(c);
  ControlScope scope(this, cq != nullptr, /*when_released=*/true);
  if (cq == nullptr) return backend_->DestroyCq(c);
  const int rc = cq->real != nullptr ? backend_->DestroyCq(cq->real) : 0;
  if (rc != 0) return rc;
  MutexLock lock(&mu_);
  Unregister(cq);
  delete cq;
  return 0;
}

// Whether a signal handled by this thread since `probes` (its count of
// the thread probe's signals then) would have ended libibverbs' read(2)
// of the channel, which the kernel restarts after a handler installed
// with SA_RESTART, where poll(2) is never restarted. Which signal ended
// the poll is not known. The probe's own (SA_RESTART) is counted; else
// the read would have ended if any signal the thread takes and that can
// come while it waits (not a fault's) has a handler without SA_RESTART:
// a program that installs one expects EINTR from its waits.
bool EndsTheRead(uint32_t probes) {
  if (ThreadProbeTakenHere() != probes) return false;
  sigset_t blocked;
  if (pthread_sigmask(SIG_BLOCK, nullptr, &blocked) != 0) sigemptyset(&blocked);
  const int probe = ThreadProbeSignal();
  for (int sig = 1; sig <= SIGRTMAX; ++sig) {
    switch (sig) {
      case SIGKILL:
      case SIGSTOP:
      case SIGSEGV:
      case SIGBUS:
      case SIGFPE:
      case SIGILL:
      case SIGTRAP:
      case SIGSYS:
        continue;
      default:
        break;
    }
    if (sig == probe || sigismember(&blocked, sig) == 1) continue;
    struct sigaction sa;
    if (sigaction(sig, nullptr, &sa) != 0) continue;  // libc's own
    const bool handled = (sa.sa_flags & SA_SIGINFO)
                             ? sa.sa_sigaction != nullptr
                             : sa.sa_handler != SIG_DFL && sa.sa_handler != SIG_IGN;
    if (handled && !(sa.sa_flags & SA_RESTART)) return true;
  }
  return false;
}

namespace {

enum class Wait { kReady, kAgain, kInterrupted };

// Waits for the real channel to have an event, or for a release to wake
// the waiter through the channel's eventfd (kAgain: look again), or for a
// signal that would have ended the application's own wait (EndsTheRead).
// A channel the application made nonblocking is not waited on: it polls
// the fd itself, and ibv_get_cq_event then returns at once, as without
// the shim.
Wait WaitForEvent(Channel* ch, int real_fd) {
  const int flags = fcntl(real_fd, F_GETFL);
  if (flags >= 0 && (flags & O_NONBLOCK)) return Wait::kReady;
  pollfd fds[2] = {{real_fd, POLLIN, 0}, {ch->wake_fd, POLLIN, 0}};
  const uint32_t probes = ThreadProbeTakenHere();
  const int n = poll(fds, ch->wake_fd >= 0 ? 2 : 1, -1);
  if (n < 0) return errno == EINTR && EndsTheRead(probes) ? Wait::kInterrupted : Wait::kAgain;
  const bool ready = !(fds[1].revents & POLLIN) && (fds[0].revents & (POLLIN | POLLERR | POLLHUP));
  return ready ? Wait::kReady : Wait::kAgain;
}

// What a thread in GetCqEvent does next, decided under the channel's
// mutex: look again (a step is pending, or the release ended), return
// EAGAIN (released, and the caller does not block), hand out an event
// the shim owes (*owed), or read the real channel (*real, marked in use).
enum class Turn { kAgain, kWouldBlock, kOwed, kRead };
Turn NextTurn(const Shim* shim, Channel* ch, Cq** owed, ibv_comp_channel** real) {
  std::unique_lock<std::mutex> lock(ch->mu);
  if (ch->released && ch->owed.empty() && !shim->step_pending()) {
    // Released (the device is closed for a move): wait for the
    // restore, or return at once to a nonblocking caller.
    const int flags = fcntl(ch->shadow.fd, F_GETFL);
    if (flags >= 0 && (flags & O_NONBLOCK)) return Turn::kWouldBlock;
    ch->cv.wait(lock,
                [shim, ch] { return !ch->released || !ch->owed.empty() || shim->step_pending(); });
    if (shim->step_pending()) return Turn::kAgain;
  }
  if (!ch->owed.empty()) {
    *owed = ch->owed.front();
    ch->owed.erase(ch->owed.begin());
    return Turn::kOwed;
  }
  if (ch->released || shim->step_pending()) return Turn::kAgain;
  // Nothing owed or pending, not released: whatever woke us is seen.
  uint64_t count;
  while (ch->wake_fd >= 0 && read(ch->wake_fd, &count, sizeof count) == sizeof count) {
  }
  *real = ch->real;
  ++ch->in_use;
  return Turn::kRead;
}

// An event the shim owes the waiter (the resume found completions the
// pause had moved into the shadow CQ): no real CQ delivered it.
void DeliverOwed(Cq* owed, ibv_cq** cq, void** cq_context) {
  owed->armed.store(false, std::memory_order_relaxed);
  {
    MutexLock events(&owed->events_mu);
    ++owed->events_absorbed;  // no real CQ delivered it
  }
  *cq = reinterpret_cast<ibv_cq*>(&owed->shadow);
  *cq_context = owed->shadow.cq_context;
}

// Waits on the real channel a NextTurn marked in use and reads its event
// (*real_cq), then marks it no longer in use. kAgain: woken, or released
// meanwhile (a release that closed the device under the read, EIO, waits
// for the restore rather than fail the application); kInterrupted: a
// signal ended the wait; kFailed: the read's error (*rc).
enum class Read { kAgain, kInterrupted, kFailed, kEvent };
Read ReadEvent(VerbsBackend* backend, Channel* ch, ibv_comp_channel* real, ibv_cq** real_cq,
               int* rc) {
  const Wait wait = WaitForEvent(ch, real->fd);
  {
    std::lock_guard<std::mutex> lock(ch->mu);
    if (wait != Wait::kReady || ch->released || ch->real != real) {
      --ch->in_use;
      ch->cv.notify_all();
      return wait != Wait::kInterrupted ? Read::kAgain : Read::kInterrupted;
    }
  }
  void* real_context = nullptr;
  *rc = backend->GetCqEvent(real, real_cq, &real_context);
  bool stale;
  {
    std::lock_guard<std::mutex> lock(ch->mu);
    --ch->in_use;
    ch->cv.notify_all();
    stale = ch->released || ch->real != real;
  }
  if (*rc != 0) return stale ? Read::kAgain : Read::kFailed;
  return Read::kEvent;
}

}  // namespace

void Shim::NoteEventDelivered(Cq* cq, ibv_cq* real) {
  cq->armed.store(false, std::memory_order_relaxed);
  MutexLock lock(&cq->events_mu);
  if (!cq->events_closed) {
    ++cq->events_unacked;
    return;
  }
  // Read just before a release destroys the real CQ, whose destroy now
  // waits for this event: acknowledged to it here, owed by the
  // application to the shim.
  backend_->AckCqEvents(real, 1);
  ++cq->events_absorbed;
}

int Shim::GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
  Channel* ch = FindChannel(channel);
  if (ch == nullptr) return backend_->GetCqEvent(channel, cq, cq_context);
  for (;;) {
    // A waiting thread is an application thread: it runs a migration step
    // left for one (OnAppThread), so that a program whose only thread
    // waits here reopens the device with its own credentials.
    RunPendingStep();
    Cq* owed = nullptr;
    ibv_comp_channel* real = nullptr;
    switch (NextTurn(this, ch, &owed, &real)) {
      case Turn::kAgain:
        continue;
      case Turn::kWouldBlock:
        errno = EAGAIN;
        return -1;
      case Turn::kOwed:
        DeliverOwed(owed, cq, cq_context);
        return 0;
      case Turn::kRead:
        break;
    }
    ibv_cq* real_cq = nullptr;
    int rc = 0;
    switch (ReadEvent(backend_, ch, real, &real_cq, &rc)) {
      case Read::kAgain:
        continue;
      case Read::kInterrupted:
        errno = EINTR;
        return -1;
      case Read::kFailed:
        return rc;
      case Read::kEvent:
        break;
    }
    Cq* shadow = static_cast<Cq*>(real_cq->cq_context);
    NoteEventDelivered(shadow, real_cq);
    *cq = reinterpret_cast<ibv_cq*>(&shadow->shadow);
    *cq_context = shadow->shadow.cq_context;
    return 0;
  }
}

void Shim::AckCqEvents(ibv_cq* c, unsigned int nevents) {
  Cq* cq = FindCq(c);
  ControlScope scope(this, cq != nullptr, /*when_released=*/true);
  if (cq == nullptr) return backend_->AckCqEvents(c, nevents);
  MutexLock lock(&cq->events_mu);
  const uint32_t absorbed = std::min<uint32_t>(nevents, cq->events_absorbed);
  cq->events_absorbed -= absorbed;
  const uint32_t rest = std::min<uint32_t>(nevents - absorbed, cq->events_unacked);
  cq->events_unacked -= rest;
  if (rest > 0 && cq->real != nullptr) backend_->AckCqEvents(cq->real, rest);
}

// ---------------------------------------------------------------- SRQ

ibv_srq* Shim::CreateSrq(ibv_pd* p, ibv_srq_init_attr* attr) {
  Pd* pd = FindPd(p);
  ControlScope scope(this, pd != nullptr);
  if (pd == nullptr) return backend_->CreateSrq(p, attr);
  Srq* srq = NewZeroed<Srq>();
  if (srq == nullptr) return nullptr;
  ibv_srq_init_attr real_attr = *attr;
  real_attr.srq_context = srq;  // async events lead back to the shadow
  ibv_srq* real = backend_->CreateSrq(pd->real, &real_attr);
  if (real == nullptr) {
    delete srq;
    return nullptr;
  }
  attr->attr = real_attr.attr;  // the provider reports the actual sizes
  if (!srq->recvs.Init(attr->attr.max_wr, attr->attr.max_sge, /*consumed=*/true)) {
    backend_->DestroySrq(real);
    delete srq;
    errno = ENOMEM;
    return nullptr;
  }
  srq->real = real;
  srq->real_post_srq_recv = real->context->ops.post_srq_recv;
  srq->mrs = mrs_.lookup();
  srq->pd = pd;
  srq->init = *attr;
  srq->shadow.context = p->context;
  srq->shadow.srq_context = attr->srq_context;
  srq->shadow.pd = p;
  srq->shadow.handle = real->handle;
  InitMutexCond(&srq->shadow.mutex, &srq->shadow.cond);
  MutexLock lock(&mu_);
  srq->path.Set(!keys_identity_ ? Path::kTranslated : migratable_ ? Path::kMarked : Path::kDirect);
  srq->pause = migratable_ ? &pause_ : nullptr;
  srq->path.SetPaused(paused_);
  Register(srq, Kind::kSrq);
  return &srq->shadow;
}

int Shim::ModifySrq(ibv_srq* s, ibv_srq_attr* attr, int mask) {
  Srq* srq = FindSrq(s);
  ControlScope scope(this, srq != nullptr);
  if (srq == nullptr) return backend_->ModifySrq(s, attr, mask);
  const int rc = backend_->ModifySrq(srq->real, attr, mask);
  if (rc == 0 && (mask & IBV_SRQ_LIMIT)) srq->init.attr.srq_limit = attr->srq_limit;
  return rc;
}

int Shim::QuerySrq(ibv_srq* s, ibv_srq_attr* attr) {
  Srq* srq = FindSrq(s);
  ControlScope scope(this, srq != nullptr);
  return backend_->QuerySrq(srq ? srq->real : s, attr);
}

int Shim::DestroySrq(ibv_srq* s) {
  Srq* srq = FindSrq(s);
  ControlScope scope(this, srq != nullptr, /*when_released=*/true);
  if (srq == nullptr) return backend_->DestroySrq(s);
  const int rc = srq->real != nullptr ? backend_->DestroySrq(srq->real) : 0;
  if (rc != 0) return rc;
  MutexLock lock(&mu_);
  Unregister(srq);
  delete srq;
  return 0;
}

// ---------------------------------------------------------------- QP

namespace {

// The ibv_qp the application holds: the real one's as the application
// should see it.
void FillShadowQp(ibv_qp* s, Context* ctx, Pd* pd, const ibv_qp* real,
                  const ibv_qp_init_attr_ex& init, const IdentityMode& mode) {
  s->context = Shadow(ctx);
  s->qp_context = init.qp_context;
  s->pd = &pd->shadow;
  s->send_cq = init.send_cq;
  s->recv_cq = init.recv_cq;
  s->srq = init.srq;
  s->handle = real->handle;
  s->qp_num = mode.VirtualQpn(real->qp_num);
  s->state = real->state;
  s->qp_type = real->qp_type;
  InitMutexCond(&s->mutex, &s->cond);
}

}  // namespace

ibv_qp* Shim::AdoptQp(Context* ctx, Pd* pd, ibv_qp* real, const ibv_qp_init_attr_ex& init) {
  Qp* qp = NewZeroed<Qp>();
  if (qp == nullptr) return nullptr;
  qp->real = real;
  qp->real_post_send = real->context->ops.post_send;
  qp->real_post_recv = real->context->ops.post_recv;
  qp->mrs = mrs_.lookup();
  qp->mode = mode_;
  qp->physical_rkey_mask = mode_.PhysicalRkeyMask();
  qp->ctx = ctx;
  qp->pd = pd;
  qp->send_cq = FindCq(init.send_cq);
  qp->recv_cq = FindCq(init.recv_cq);
  qp->srq = FindSrq(init.srq);
  qp->plain_completions = qp->srq == nullptr && init.qp_type != IBV_QPT_UD;
  qp->SetPhysicalQpn(real->qp_num);
  qp->init = init;
  if (qp->srq != nullptr) {
    qp->recvs = &qp->srq->recvs;
  } else if (qp->own_recvs.Init(init.cap.max_recv_wr, init.cap.max_recv_sge,
                                init.qp_type == IBV_QPT_UD)) {
    qp->recvs = &qp->own_recvs;
  } else {
    delete qp;
    errno = ENOMEM;
    return nullptr;
  }
  if (init.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) qp->real_ex = backend_->QpToQpEx(real);
  FillShadowQp(&qp->shadow.qp_base, ctx, pd, real, init, mode_);
  // Async events carry the real QP; its user context leads back here.
  real->qp_context = qp;
  InstallSendPath(qp, probed_);
  if (qp->real_ex != nullptr) InstallQpExOps(qp);
  MutexLock lock(&mu_);
  if (!qp_index_.Insert(real->qp_num, qp)) {
    delete qp;
    errno = ENOMEM;
    return nullptr;
  }
  SetQpPath(qp, QpPath(*qp));
  SetQpPaused(qp, paused_);  // created between two steps of a pause
  // A migratable process counts a UD QP's sends and an SRQ's receives
  // where they complete.
  if (migratable_ && qp->shadow.qp_base.qp_type == IBV_QPT_UD) {
    if (qp->send_cq != nullptr) CqTranslates(qp->send_cq);
    if (qp->recv_cq != nullptr) CqTranslates(qp->recv_cq);
  }
  if (migratable_ && qp->srq != nullptr && qp->recv_cq != nullptr) CqTranslates(qp->recv_cq);
  qp->pause = migratable_ ? &pause_ : nullptr;
  Register(qp, Kind::kQp);
  return &qp->shadow.qp_base;
}

ibv_qp* Shim::CreateQp(ibv_pd* p, ibv_qp_init_attr* attr) {
  Pd* pd = FindPd(p);
  ControlScope scope(this, pd != nullptr);
  if (pd == nullptr) return backend_->CreateQp(p, attr);
  ibv_qp_init_attr_ex ex = ToInitAttrEx(p, *attr);
  ibv_qp* qp = CreateQpEx(p->context, &ex);
  if (qp != nullptr) attr->cap = ex.cap;
  return qp;
}

ibv_qp* Shim::CreateQpEx(ibv_context* c, ibv_qp_init_attr_ex* attr) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  if (ctx == nullptr) return backend_->CreateQpEx(c, attr);
  constexpr uint32_t kSupported =
      IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS | IBV_QP_INIT_ATTR_CREATE_FLAGS;
  if (attr->comp_mask & ~kSupported) {
    LogOnce("ibv_create_qp_ex: XRC, RSS, TSO and parent domains are not supported");
    errno = EOPNOTSUPP;
    return nullptr;
  }
  if (attr->qp_type != IBV_QPT_RC && attr->qp_type != IBV_QPT_UC && attr->qp_type != IBV_QPT_UD) {
    LogOnce("only RC, UC and UD QPs are supported");
    errno = EOPNOTSUPP;
    return nullptr;
  }
  Pd* pd = FindPd(attr->pd);
  Cq* send_cq = FindCq(attr->send_cq);
  Cq* recv_cq = FindCq(attr->recv_cq);
  Srq* srq = FindSrq(attr->srq);
  if (pd == nullptr || (attr->send_cq && !send_cq) || (attr->recv_cq && !recv_cq) ||
      (attr->srq && !srq)) {
    errno = EINVAL;
    return nullptr;
  }
  ibv_qp_init_attr_ex real_attr = *attr;
  real_attr.pd = pd->real;
  real_attr.send_cq = send_cq ? send_cq->real : nullptr;
  real_attr.recv_cq = recv_cq ? recv_cq->real : nullptr;
  real_attr.srq = srq ? srq->real : nullptr;
  real_attr.qp_context = nullptr;
  ibv_qp* real = backend_->CreateQpEx(ctx->real, &real_attr);
  if (real == nullptr) return nullptr;
  attr->cap = real_attr.cap;  // the provider reports the actual sizes
  ibv_qp* s = AdoptQp(ctx, pd, real, *attr);
  if (s == nullptr) {
    const int err = errno;
    backend_->DestroyQp(real);
    errno = err;
  }
  return s;
}

ibv_qp_ex* Shim::QpToQpEx(ibv_qp* q) {
  Qp* qp = FindQp(q);
  if (qp == nullptr) return backend_->QpToQpEx(q);
  return qp->real_ex != nullptr ? &qp->shadow : nullptr;
}

void Shim::PhysicalizeQpAttr(ibv_qp_attr* attr, int mask, const RemoteEndpoint* remote) const {
  if (mask & IBV_QP_DEST_QPN)
    attr->dest_qp_num =
        remote ? remote->Qpn(attr->dest_qp_num) : mode_.PhysicalQpn(attr->dest_qp_num);
  if ((mask & IBV_QP_AV) && attr->ah_attr.is_global)
    attr->ah_attr.grh.dgid =
        remote ? remote->physical_gid() : mode_.PhysicalGid(attr->ah_attr.grh.dgid);
  if ((mask & IBV_QP_ALT_PATH) && attr->alt_ah_attr.is_global)
    attr->alt_ah_attr.grh.dgid = mode_.PhysicalGid(attr->alt_ah_attr.grh.dgid);
  // A peer's drain marker is a zero-length RDMA WRITE (migration/release.cc): the
  // QP accepts it whatever the application allowed (a query shows what
  // the application set; an MR still refuses writes it does not allow).
  if (mask & IBV_QP_ACCESS_FLAGS) attr->qp_access_flags |= IBV_ACCESS_REMOTE_WRITE;
}

void Shim::VirtualizeQpAttr(ibv_qp_attr* attr, int mask) const {
  // 0 is "not connected" (UD, or before RTR), not a QP number.
  if ((mask & IBV_QP_DEST_QPN) && attr->dest_qp_num != 0)
    attr->dest_qp_num = mode_.VirtualQpn(attr->dest_qp_num);
  if ((mask & IBV_QP_AV) && attr->ah_attr.is_global)
    attr->ah_attr.grh.dgid = mode_.VirtualGid(attr->ah_attr.grh.dgid);
  if ((mask & IBV_QP_ALT_PATH) && attr->alt_ah_attr.is_global)
    attr->alt_ah_attr.grh.dgid = mode_.VirtualGid(attr->alt_ah_attr.grh.dgid);
}

int Shim::ModifyQp(ibv_qp* q, ibv_qp_attr* attr, int mask) {
  Qp* qp = FindQp(q);
  ControlScope scope(this, qp != nullptr);
  if (qp == nullptr) return backend_->ModifyQp(q, attr, mask);
  // The peer this QP is (being) connected to: a moved one translates
  // through what it published.
  const RemoteEndpoint* remote = qp->remote.load(std::memory_order_acquire);
  ibv_gid remote_gid = qp->remote_gid;
  uint32_t remote_qpn = qp->remote_qpn;
  if (mask & IBV_QP_DEST_QPN) remote_qpn = attr->dest_qp_num;
  if ((mask & IBV_QP_AV) && attr->ah_attr.is_global) remote_gid = attr->ah_attr.grh.dgid;
  if ((mask & (IBV_QP_AV | IBV_QP_DEST_QPN)) && !IdentityMode::IsZero(remote_gid))
    remote = FindRemote(remote_gid, remote_qpn);
  ibv_qp_attr real_attr = *attr;
  PhysicalizeQpAttr(&real_attr, mask, remote);
  const int rc = backend_->ModifyQp(qp->real, &real_attr, mask);
  if (rc != 0) return rc;
  MutexLock lock(&mu_);
  if ((mask & IBV_QP_AV) && attr->ah_attr.is_global)
    NoteEndpointGid(qp->ctx, attr->ah_attr.port_num, attr->ah_attr.grh.sgid_index);
  qp->remote_gid = remote_gid;
  qp->remote_qpn = remote_qpn;
  SetPeer(qp, remote, probed_);
  if (remote != nullptr) SetQpPath(qp, Path::kTranslated);
  qp->transitions.push_back({*attr, mask});
  qp->repointed_at = nullptr;
  q->state = qp->real->state;
  return 0;
}

int Shim::QueryQp(ibv_qp* q, ibv_qp_attr* attr, int mask, ibv_qp_init_attr* init) {
  Qp* qp = FindQp(q);
  ControlScope scope(this, qp != nullptr);
  if (qp == nullptr) return backend_->QueryQp(q, attr, mask, init);
  const int rc = backend_->QueryQp(qp->real, attr, mask, init);
  if (rc != 0) return rc;
  // What the provider fills regardless of the mask is translated too.
  VirtualizeQpAttr(attr, mask | IBV_QP_DEST_QPN | IBV_QP_AV | IBV_QP_ALT_PATH);
  {
    MutexLock lock(&mu_);
    for (const QpTransition& t : qp->transitions)
      if (t.mask & IBV_QP_ACCESS_FLAGS) attr->qp_access_flags = t.attr.qp_access_flags;
  }
  if (qp->remote.load(std::memory_order_acquire) != nullptr) {
    // A moved peer's identities are not a function of where it is now:
    // show what the application set.
    MutexLock lock(&mu_);
    for (const QpTransition& t : qp->transitions) {
      if (t.mask & IBV_QP_DEST_QPN) attr->dest_qp_num = t.attr.dest_qp_num;
      if (t.mask & IBV_QP_AV) attr->ah_attr.grh.dgid = t.attr.ah_attr.grh.dgid;
    }
  }
  init->qp_context = q->qp_context;
  init->send_cq = q->send_cq;
  init->recv_cq = q->recv_cq;
  init->srq = q->srq;
  return 0;
}

int Shim::DestroyQp(ibv_qp* q) {
  Qp* qp = FindQp(q);
  ControlScope scope(this, qp != nullptr, /*when_released=*/true);
  if (qp == nullptr) return backend_->DestroyQp(q);
  {
    MutexLock lock(&mu_);
    qp_index_.Remove(qp->physical_qpn, qp);
  }
  const int rc = qp->real != nullptr ? backend_->DestroyQp(qp->real) : 0;
  MutexLock lock(&mu_);
  if (rc != 0) {
    qp_index_.Insert(qp->physical_qpn, qp);
    return rc;
  }
  Unregister(qp);
  delete qp;
  return 0;
}

// ECE options carry no identity: the real QP's answer is the answer.
int Shim::QueryEce(ibv_qp* q, ibv_ece* ece) {
  Qp* qp = FindQp(q);
  ControlScope scope(this, qp != nullptr);
  return backend_->QueryEce(qp ? qp->real : q, ece);
}

int Shim::SetEce(ibv_qp* q, ibv_ece* ece) {
  Qp* qp = FindQp(q);
  ControlScope scope(this, qp != nullptr);
  return backend_->SetEce(qp ? qp->real : q, ece);
}

int Shim::QueryQpDataInOrder(ibv_qp* q, ibv_wr_opcode op, uint32_t flags) {
  Qp* qp = FindQp(q);
  ControlScope scope(this, qp != nullptr);
  return backend_->QueryQpDataInOrder(qp ? qp->real : q, op, flags);
}

// ---------------------------------------------------------------- AH

ibv_ah* Shim::CreateAh(ibv_pd* p, ibv_ah_attr* attr) {
  Pd* pd = FindPd(p);
  ControlScope scope(this, pd != nullptr);
  if (pd == nullptr) return backend_->CreateAh(p, attr);
  // To the GID's own place; endpoints that moved away get routes.
  ibv_ah* real = nullptr;
  {
    MutexLock lock(&mu_);
    real = CreateHomeAhLocked(pd, *attr);
  }
  if (real == nullptr) return nullptr;
  Ah* ah = NewZeroed<Ah>();
  if (ah == nullptr) {
    backend_->DestroyAh(real);
    errno = ENOMEM;
    return nullptr;
  }
  ah->real = real;
  ah->pd = pd;
  ah->attr = *attr;
  ah->shadow.context = p->context;
  ah->shadow.pd = p;
  ah->shadow.handle = real->handle;
  MutexLock lock(&mu_);
  if (const int rc = RouteAhToAllLocked(ah); rc != 0) {
    for (int i = 0; i < ah->nroutes.load(); ++i) backend_->DestroyAh(ah->routes[i].real);
    backend_->DestroyAh(real);
    delete ah;
    errno = rc;
    return nullptr;
  }
  if (attr->is_global) NoteEndpointGid(pd->ctx, attr->port_num, attr->grh.sgid_index);
  Register(ah, Kind::kAh);
  return &ah->shadow;
}

int Shim::InitAhFromWc(ibv_context* c, uint8_t port, ibv_wc* wc, ibv_grh* grh, ibv_ah_attr* attr) {
  Context* ctx = FindContext(c);
  ControlScope scope(this, ctx != nullptr);
  if (ctx == nullptr) return backend_->InitAhFromWc(c, port, wc, grh, attr);
  // The application's GRH shows virtual addresses; the provider matches
  // them against the port's physical GID table.
  ibv_grh physical_grh;
  ibv_grh* g = grh;
  if (grh != nullptr && (wc->wc_flags & IBV_WC_GRH)) {
    memcpy(&physical_grh, grh, sizeof(physical_grh));
    const IdentityMode mode = mode_;
    RewriteGrh(reinterpret_cast<uint8_t*>(&physical_grh),
               [mode](const ibv_gid& gid) { return mode.PhysicalGid(gid); });
    g = &physical_grh;
  }
  const int rc = backend_->InitAhFromWc(ctx->real, port, wc, g, attr);
  if (rc == 0 && attr->is_global) attr->grh.dgid = mode_.VirtualGid(attr->grh.dgid);
  return rc;
}

ibv_ah* Shim::CreateAhFromWc(ibv_pd* pd, ibv_wc* wc, ibv_grh* grh, uint8_t port) {
  ibv_ah_attr attr{};
  const int rc = InitAhFromWc(pd->context, port, wc, grh, &attr);
  if (rc != 0) {
    errno = rc;  // as libibverbs: the error of ibv_init_ah_from_wc
    return nullptr;
  }
  return CreateAh(pd, &attr);
}

int Shim::DestroyAh(ibv_ah* a) {
  Ah* ah = Find<Ah>(a, Kind::kAh);
  ControlScope scope(this, ah != nullptr, /*when_released=*/true);
  if (ah == nullptr) return backend_->DestroyAh(a);
  const int rc = ah->real != nullptr ? backend_->DestroyAh(ah->real) : 0;
  if (rc != 0) return rc;
  for (int i = 0; i < ah->nroutes.load(); ++i)
    if (ah->routes[i].real != nullptr) backend_->DestroyAh(ah->routes[i].real);
  MutexLock lock(&mu_);
  Unregister(ah);
  delete ah;
  return 0;
}

namespace {

bool SameGroup(const Qp::Group& g, const ibv_gid& gid, uint16_t lid) {
  return g.lid == lid && memcmp(g.gid.raw, gid.raw, sizeof(gid.raw)) == 0;
}

}  // namespace

int Shim::AttachMcast(ibv_qp* q, const ibv_gid* gid, uint16_t lid) {
  Qp* qp = FindQp(q);
  ControlScope scope(this, qp != nullptr);
  const int rc = backend_->AttachMcast(qp ? qp->real : q, gid, lid);
  if (rc != 0 || qp == nullptr) return rc;
  MutexLock lock(&mu_);
  for (const Qp::Group& g : qp->groups)
    if (SameGroup(g, *gid, lid)) return 0;
  qp->groups.push_back({*gid, lid});
  return 0;
}

int Shim::DetachMcast(ibv_qp* q, const ibv_gid* gid, uint16_t lid) {
  Qp* qp = FindQp(q);
  ControlScope scope(this, qp != nullptr);
  const int rc = backend_->DetachMcast(qp ? qp->real : q, gid, lid);
  if (rc != 0 || qp == nullptr) return rc;
  MutexLock lock(&mu_);
  std::erase_if(qp->groups, [&](const Qp::Group& g) { return SameGroup(g, *gid, lid); });
  return 0;
}

const RemoteEndpoint* Shim::FindRemoteLocked(const ibv_gid& gid) const {
  for (auto it = remotes_.rbegin(); it != remotes_.rend(); ++it) {
    if (memcmp((*it)->virtual_gid().raw, gid.raw, sizeof(gid.raw)) == 0) return it->get();
  }
  return nullptr;
}

const RemoteEndpoint* Shim::FindRemoteLocked(const ibv_gid& gid, uint32_t virtual_qpn) const {
  for (auto it = remotes_.rbegin(); it != remotes_.rend(); ++it) {
    if (memcmp((*it)->virtual_gid().raw, gid.raw, sizeof(gid.raw)) == 0 && (*it)->Owns(virtual_qpn))
      return it->get();
  }
  return nullptr;
}

const RemoteEndpoint* Shim::FindRemote(const ibv_gid& gid) const {
  MutexLock lock(&mu_);
  return FindRemoteLocked(gid);
}

const RemoteEndpoint* Shim::FindRemote(const ibv_gid& gid, uint32_t virtual_qpn) const {
  MutexLock lock(&mu_);
  return FindRemoteLocked(gid, virtual_qpn);
}

ibv_ah* Shim::CreateHomeAhLocked(Pd* pd, const ibv_ah_attr& attr) {
  ibv_ah_attr real_attr = attr;
  if (!attr.is_global) return backend_->CreateAh(pd->real, &real_attr);
  real_attr.grh.dgid = mode_.PhysicalGid(attr.grh.dgid);
  ibv_ah* real = backend_->CreateAh(pd->real, &real_attr);
  if (real != nullptr) return real;
  // Nobody answers at the GID's place any more (a guest whose NIC was
  // swapped: its old address is gone, and RoCE cannot resolve it). If an
  // endpoint of that GID moved, its datagrams go where it is now, as its
  // route's do.
  const int err = errno;
  const RemoteEndpoint* r = FindRemoteLocked(attr.grh.dgid);
  if (r == nullptr) {
    errno = err;
    return nullptr;
  }
  real_attr.grh.dgid = r->physical_gid();
  return backend_->CreateAh(pd->real, &real_attr);
}

int Shim::RouteAhLocked(Ah* ah, const RemoteEndpoint* r) {
  if (!ah->attr.is_global || memcmp(ah->attr.grh.dgid.raw, r->virtual_gid().raw, 16) != 0) return 0;
  ibv_ah_attr attr = ah->attr;
  attr.grh.dgid = r->physical_gid();
  ibv_ah* fresh = backend_->CreateAh(ah->pd->real, &attr);
  if (fresh == nullptr) return errno != 0 ? errno : ENOMEM;
  const int n = ah->nroutes.load(std::memory_order_relaxed);
  for (int i = 0; i < n; ++i) {
    AhRoute& route = ah->routes[i];
    if (route.remote != r && !route.remote->SameEndpointAs(*r)) continue;
    ibv_ah* old = route.real;
    route.real = fresh;
    route.remote = r;
    backend_->DestroyAh(old);
    return 0;
  }
  if (n == kMaxAhRoutes) {
    backend_->DestroyAh(fresh);
    return EAGAIN;
  }
  ah->routes[n] = {r, fresh};
  ah->nroutes.store(n + 1, std::memory_order_release);
  return 0;
}

int Shim::RouteAhToAllLocked(Ah* ah) {
  if (!ah->attr.is_global) return 0;
  // Oldest first: a later move of an endpoint replaces its earlier route.
  for (const auto& r : remotes_)
    if (const int rc = RouteAhLocked(ah, r.get()); rc != 0) return rc;
  return 0;
}

int Shim::PublishRemote(const RemoteMapping& mapping) {
  std::unique_ptr<RemoteEndpoint> e = RemoteEndpoint::Build(mapping);
  if (e == nullptr) return ENOMEM;
  MutexLock lock(&mu_);
  const RemoteEndpoint* r = PublishRemoteLocked(std::move(e));
  for (Ah* ah : All<Ah>(Kind::kAh))
    if (const int rc = RouteAhLocked(ah, r); rc != 0) return rc;
  return 0;
}

const RemoteEndpoint* Shim::PublishRemoteLocked(std::unique_ptr<RemoteEndpoint> e) {
  const RemoteEndpoint* r = e.get();
  remotes_.push_back(std::move(e));
  const uint32_t n = npublished_.load(std::memory_order_relaxed);
  if (n < kMaxPublished) {
    published_[n].store(r, std::memory_order_release);
    npublished_.store(n + 1, std::memory_order_release);
  } else {
    LogOnce("more than 256 peer moves published: UD sources of later ones show physical QPNs");
  }
  // Its QPs (of the GID, connected to a QPN it owns) translate through it;
  // AHs get their routes to it when the endpoint is re-pointed
  // (RouteAhLocked: creating an AH is a verb, not done here).
  const ibv_gid& gid = r->virtual_gid();
  for (const auto& [p, kind] : Shadows()) {
    if (kind != Kind::kQp) continue;
    Qp* qp = static_cast<Qp*>(const_cast<void*>(p));
    if (memcmp(qp->remote_gid.raw, gid.raw, 16) != 0 || !r->Owns(qp->remote_qpn)) continue;
    SetQpPath(qp, Path::kTranslated);
    SetPeer(qp, r, probed_);
  }
  return r;
}

const RemoteEndpoint* Shim::RemoteAt(const ibv_gid& gid, uint32_t physical_qpn) const {
  for (uint32_t i = npublished_.load(std::memory_order_acquire); i-- > 0;) {
    const RemoteEndpoint* r = published_[i].load(std::memory_order_acquire);
    if (memcmp(r->physical_gid().raw, gid.raw, 16) == 0 && r->SentFrom(physical_qpn)) return r;
  }
  return nullptr;
}

ibv_gid Shim::VirtualizeGid(const ibv_gid& g, const RemoteEndpoint* from) const {
  if (from != nullptr && memcmp(g.raw, from->physical_gid().raw, 16) == 0)
    return from->virtual_gid();
  if (gid_moved_.load(std::memory_order_acquire) &&
      memcmp(g.raw, endpoint_physical_gid_.raw, 16) == 0)
    return endpoint_virtual_gid_;
  return mode_.VirtualGid(g);
}

std::vector<const Qp*> Shim::Qps() const {
  MutexLock lock(&mu_);
  std::vector<const Qp*> out;
  for (const auto& [p, kind] : Shadows())
    if (kind == Kind::kQp) out.push_back(static_cast<const Qp*>(p));
  return out;
}

std::vector<const Mr*> Shim::Mrs() const {
  MutexLock lock(&mu_);
  std::vector<const Mr*> out;
  for (const auto& [p, kind] : Shadows())
    if (kind == Kind::kMr) out.push_back(static_cast<const Mr*>(p));
  return out;
}

}  // namespace rdmavirt::shim
