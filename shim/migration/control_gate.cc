// The control-step gate: how migration steps and the application's
// control verbs keep out of each other's way, and how a step runs on an
// application thread. See control_gate.h.
#include "shim/migration/control_gate.h"

#include <unistd.h>

#include <chrono>
#include <string>

#include "shim/core/log.h"

namespace rdmavirt::shim {

namespace {

// This thread's control verbs in progress (a provider may call exported
// verbs from inside one), and whether it runs a migration step: either
// passes the control gate.
thread_local int t_control_depth = 0;
thread_local bool t_in_step = false;

}  // namespace

void Shim::WakeEventWaiters() {
  {
    MutexLock lock(&control_mu_);
    control_cv_.NotifyAll();
  }
  std::vector<Channel*> channels;
  {
    MutexLock registry(&registry_mu_);
    for (const auto& [p, k] : shadows_)
      if (k == Kind::kChannel) channels.push_back(static_cast<Channel*>(const_cast<void*>(p)));
  }
  for (Channel* ch : channels) {
    std::lock_guard<std::mutex> lock(ch->mu);
    const uint64_t one = 1;
    if (ch->wake_fd >= 0 && write(ch->wake_fd, &one, sizeof one) < 0)
      LogOnce("waking a completion-event waiter failed");
    ch->cv.notify_all();
  }
}

// ib_uverbs refuses write() commands from a thread whose credentials are
// not the very ones the device file was opened with (ib_safe_file_access:
// "changed security contexts after opening file descriptor"). Threads
// share one credential object until CRIU restores them, each with its own.
// So once a process has been restored, the device is reopened, and every
// later step run, on an application thread: the next one to post or poll
// while paused picks the step up (data_path.cc), and its own posts then
// pass (providers such as rxe ring the doorbell with write()). If no
// application thread comes within app_thread_wait_ms_ (one blocked in
// ibv_get_cq_event, say) the control thread runs the step itself. A step
// taken up and never finished (a verb blocked in the kernel) is waited for
// within a bound, then said; no step starts while it runs.
Status Shim::OnAppThread(const char* name, std::function<Status()> step, int budget_ms) {
  if (!app_thread_steps_.load()) return RunStep(step);
  if (!step_.done.load(std::memory_order_acquire))
    return Error(Code::kUnavailable,
                 std::string("the shim's ") + step_.name +
                     " step is still running on an application thread; no other step starts "
                     "before it ends");
  step_.run = std::move(step);
  step_.name = name;
  step_.done.store(false);
  task_.store(&step_);
  WakeEventWaiters();
  for (int waited = 0; waited < app_thread_wait_ms_; ++waited) {
    if (step_.done.load(std::memory_order_acquire)) return step_.result;
    usleep(1000);
  }
  PendingStep* expected = &step_;
  if (task_.compare_exchange_strong(expected, nullptr)) {
    Status st = RunStep(step_.run);
    step_.done.store(true, std::memory_order_release);
    return st;
  }
  // An application thread is running it.
  const int limit = budget_ms + step_timeout_ms_;
  for (int waited = 0; waited < limit; ++waited) {
    if (step_.done.load(std::memory_order_acquire)) return step_.result;
    usleep(1000);
  }
  return Error(Code::kDeadlineExceeded,
               std::string("the ") + name + " step has run on an application thread for " +
                   std::to_string(limit) +
                   " ms without finishing (a verb blocked in the kernel?); the endpoint stays "
                   "as that step leaves it, and no other step starts before it ends");
}

void Shim::RunPendingStep() {
  PendingStep* p = task_.exchange(nullptr);
  if (p == nullptr) return;
  p->result = RunStep(p->run);
  steps_on_app_threads_.fetch_add(1);
  p->done.store(true, std::memory_order_release);
}

Shim::ControlScope::ControlScope(Shim* shim, bool applies, bool when_released) : shim_(shim) {
  if (!applies) return;
  entered_ = true;
  if (t_control_depth++ > 0 || t_in_step) return;
  shim_->control_mu_.Lock();
  while (shim_->control_closed_ && !(when_released && shim_->control_idle_)) {
    if (shim_->step_pending()) {
      shim_->control_mu_.Unlock();
      shim_->RunPendingStep();
      shim_->control_mu_.Lock();
      continue;
    }
    shim_->control_waiters_.fetch_add(1);
    shim_->control_cv_.Wait(&shim_->control_mu_, [this, when_released] {
      shim_->control_mu_.AssertHeld();  // the wait asks with it held
      return !shim_->control_closed_ || (when_released && shim_->control_idle_) ||
             shim_->step_pending();
    });
    shim_->control_waiters_.fetch_sub(1);
  }
  ++shim_->control_inside_;
  counted_ = true;
  shim_->control_mu_.Unlock();
}

Shim::ControlScope::~ControlScope() {
  if (!entered_) return;
  --t_control_depth;
  if (!counted_) return;
  MutexLock lock(&shim_->control_mu_);
  if (--shim_->control_inside_ == 0) shim_->control_cv_.NotifyAll();
}

Status Shim::CloseControl() {
  MutexLock lock(&control_mu_);
  control_closed_ = true;
  if (control_cv_.WaitFor(&control_mu_, std::chrono::milliseconds(control_wait_ms_), [this] {
        control_mu_.AssertHeld();  // the wait asks with it held
        return control_inside_ == 0;
      }))
    return {};
  control_closed_ = false;
  control_cv_.NotifyAll();
  return Error(Code::kDeadlineExceeded,
               "an application thread's verbs call (other than a post or a poll) did not return "
               "within " +
                   std::to_string(control_wait_ms_) +
                   " ms; the endpoint was not released (it stays paused until resumed)");
}

void Shim::OpenControl() {
  MutexLock lock(&control_mu_);
  control_closed_ = false;
  control_idle_ = false;
  control_cv_.NotifyAll();
}

Status Shim::RunStep(const std::function<Status()>& step) {
  const bool outer = t_in_step;
  t_in_step = true;
  Status st = ControlBusy();
  if (st.ok()) st = step();
  ControlIdle();
  t_in_step = outer;
  return st;
}

Status Shim::ControlBusy() {
  MutexLock lock(&control_mu_);
  if (!control_closed_) return {};
  control_idle_ = false;
  if (control_cv_.WaitFor(&control_mu_, std::chrono::milliseconds(control_wait_ms_), [this] {
        control_mu_.AssertHeld();  // the wait asks with it held
        return control_inside_ == 0;
      }))
    return {};
  control_idle_ = true;
  control_cv_.NotifyAll();
  return Error(Code::kDeadlineExceeded,
               "an application thread's destroy, deregistration or close did not return within " +
                   std::to_string(control_wait_ms_) + " ms; the step did not run");
}

void Shim::ControlIdle() {
  MutexLock lock(&control_mu_);
  control_idle_ = control_closed_;
  control_cv_.NotifyAll();
}

}  // namespace rdmavirt::shim
