// The engine's device path (device_path.h).
#include "device_path.h"

#include <chrono>
#include <thread>
#include <utility>

namespace smddp {

namespace {

std::string num(std::uint64_t v) { return std::to_string(v); }


}  // namespace

void destroy_event(cuda::Driver& d, int device, cuda::Event ev) {
  cuda::Bound bound(d, device);
  if (bound.result() == cuda::kSuccess) (void)d.api().event_destroy(ev);
}

cuda::Result record_new_event(const cuda::Api& api, cuda::Stream stream, cuda::Event* ev, const char** call) {
  *call = "cuEventCreate";
  cuda::Result r = api.event_create(ev, cuda::kEventDisableTiming);
  if (r != cuda::kSuccess) return r;
  *call = "cuEventRecord";
  r = api.event_record(*ev, stream);
  if (r != cuda::kSuccess) (void)api.event_destroy(*ev);
  return r;
}

cuda::Result poll_event(cuda::Driver& d, cuda::Event ev, std::int64_t timeout_ns, std::int64_t spin_ns) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto deadline = t0 + std::chrono::nanoseconds(timeout_ns);
  cuda::Result r;
  while ((r = d.api().event_query(ev)) == cuda::kNotReady) {
    if (std::chrono::steady_clock::now() >= deadline) break;
    stream_pause(t0, spin_ns);
  }
  return r;
}

// ----------------------------------------------------------------------------------- DeviceMark

DeviceMark::DeviceMark(std::shared_ptr<cuda::Driver> driver, int device, cuda::Event event)
    : driver_(std::move(driver)), device_(device), event_(event) {}

DeviceMark::~DeviceMark() { destroy_event(*driver_, device_, event_); }

// ------------------------------------------------------------------------------------ DeviceOut

DeviceOut::DeviceOut(DevicePath* path, int device, std::uintptr_t stream, std::shared_ptr<DeviceMark> before,
                     std::vector<Part> parts, std::uint64_t token, Then then)
    : path_(path),
      driver_(path->shared_driver()),
      device_(device),
      stream_(stream),
      before_(std::move(before)),
      parts_(std::move(parts)),
      token_(token),
      then_(then) {}

DeviceOut::~DeviceOut() {
  cuda::Event done = done_.load(std::memory_order_acquire);
  if (done != nullptr) destroy_event(*driver_, device_, done);
}

void DeviceOut::arrived(const Header& submit, const std::uint8_t* result, const Located& at,
                        const std::shared_ptr<Segment>& seg, std::string* why) {
  if (dropped_.load(std::memory_order_acquire)) {
    // Nothing goes to the caller's memory: the result slot goes back at once.
    path_->release(submit);
    path_->landed(token_);
    return;
  }
  const std::string what = "the copy of collective #" + num(submit.seq) + "'s result to cuda:" +
                           std::to_string(device_) + " could not be enqueued: ";
  for (const Part& p : parts_) {
    if (p.offset > at.nbytes || p.nbytes > at.nbytes - p.offset) {
      *why = what + "a destination outside its result";
      return;
    }
  }
  path_->pin(seg, device_, false);
  cuda::Driver& d = path_->driver();
  const cuda::Api& api = d.api();
  cuda::Bound bound(d, device_);
  if (bound.result() != cuda::kSuccess) {
    *why = what + d.describe(bound.result(), "cuCtxSetCurrent");
    return;
  }
  const cuda::Stream stream = cuda::stream_of(stream_);
  cuda::Result r = cuda::kSuccess;
  const char* call = "cuStreamWaitEvent";
  if (before_ != nullptr) r = api.stream_wait_event(stream, before_->event(), 0);
  for (std::size_t i = 0; r == cuda::kSuccess && i < parts_.size(); i++) {
    call = "cuMemcpyHtoDAsync";
    if (parts_[i].nbytes > 0) r = api.memcpy_h2d(parts_[i].dst, result + parts_[i].offset, parts_[i].nbytes, stream);
  }
  if (r == cuda::kSuccess && then_.addr != 0) {
    call = "cuStreamWriteValue32";
    r = d.step().write_value32 == nullptr
            ? cuda::kInvalidValue
            : d.step().write_value32(stream, then_.addr, then_.value, cuda::kWriteValueDefault);
  }
  cuda::Event done = nullptr;
  if (r == cuda::kSuccess) r = record_new_event(api, stream, &done, &call);
  if (r != cuda::kSuccess) {
    *why = what + d.describe(r, call);
    return;
  }
  done_.store(done, std::memory_order_release);
  std::uint64_t copied = 0;
  for (const Part& p : parts_) copied += p.nbytes;
  if (copied > 0) path_->channel_->count_device(false, copied);
  std::shared_ptr<DeviceOut> self = shared_from_this();
  DeviceWatch* w = path_->watch_for(device_);
  const Header h = submit;
  if (w == nullptr || !w->watch(done, [self, h](cuda::Result got) { self->path_->copied(self, h, got); })) {
    // Stopped (the client is shutting down): nothing is RELEASEd after its BYE.
    return;
  }
}

cuda::Result DeviceOut::order(std::uintptr_t stream) {
  cuda::Event done = done_.load(std::memory_order_acquire);
  if (done == nullptr || stream == stream_) return cuda::kSuccess;
  cuda::Bound bound(*driver_, device_);
  if (bound.result() != cuda::kSuccess) return bound.result();
  return driver_->api().stream_wait_event(cuda::stream_of(stream), done, 0);
}

cuda::Result DeviceOut::query() {
  cuda::Event done = done_.load(std::memory_order_acquire);
  if (done == nullptr) return cuda::kSuccess;
  return driver_->api().event_query(done);
}

cuda::Result DeviceOut::synchronize() {
  cuda::Event done = done_.load(std::memory_order_acquire);
  if (done == nullptr) return cuda::kSuccess;
  cuda::Bound bound(*driver_, device_);
  if (bound.result() != cuda::kSuccess) return bound.result();
  return driver_->api().event_synchronize(done);
}

// ------------------------------------------------------------------------------------- DeviceIn

DeviceIn::DeviceIn(std::shared_ptr<cuda::Driver> driver, int device, cuda::Event copied, std::shared_ptr<Segment> seg)
    : driver_(std::move(driver)), device_(device), copied_(copied), seg_(std::move(seg)) {}

DeviceIn::~DeviceIn() { destroy_event(*driver_, device_, copied_); }

cuda::Result DeviceIn::query() { return driver_->api().event_query(copied_); }

cuda::Result DeviceIn::wait(std::int64_t timeout_ns, std::int64_t spin_ns) {
  return poll_event(*driver_, copied_, timeout_ns, spin_ns);
}

// ----------------------------------------------------------------------------------- DevicePath

std::unique_ptr<DevicePath> DevicePath::load(const std::string& library, WorkerChannel* channel,
                                             std::uint64_t batch_bytes, std::int64_t timeout_ns,
                                             std::int64_t spin_ns, std::int64_t watch_spin_ns, std::string* why) {
  std::unique_ptr<cuda::Driver> d = cuda::Driver::load(library, why);
  if (!d) return nullptr;
  std::unique_ptr<DevicePath> p(new DevicePath());
  p->driver_ = std::move(d);
  p->channel_ = channel;
  p->batch_bytes_ = batch_bytes;
  p->timeout_ns_ = timeout_ns;
  p->spin_ns_ = spin_ns;
  p->watch_spin_ns_ = watch_spin_ns;
  return p;
}

DevicePath::~DevicePath() {
  stop(false);
  for (auto& kv : lanes_) {
    cuda::Bound bound(*driver_, kv.first);
    if (bound.result() != cuda::kSuccess) continue;
    (void)driver_->api().stream_destroy(kv.second.first);
    (void)driver_->api().stream_destroy(kv.second.second);
  }
}

bool DevicePath::lanes(int device, std::uintptr_t* in, std::uintptr_t* back, std::string* why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_) {
    *why = "smddp's device path has stopped (smddp is shutting down)";
    return false;
  }
  auto it = lanes_.find(device);
  if (it == lanes_.end()) {
    cuda::Driver& d = *driver_;
    cuda::Bound bound(d, device);
    if (bound.result() != cuda::kSuccess) {
      *why = "cuda:" + std::to_string(device) + ": " + d.describe(bound.result(), "cuCtxSetCurrent");
      return false;
    }
    cuda::Stream s[2] = {nullptr, nullptr};
    for (cuda::Stream& one : s) {
      const cuda::Result r = d.api().stream_create(&one, cuda::kStreamNonBlocking);
      if (r != cuda::kSuccess) {
        if (s[0] != nullptr) (void)d.api().stream_destroy(s[0]);
        *why = "the engine's streams on cuda:" + std::to_string(device) + ": " + d.describe(r, "cuStreamCreate");
        return false;
      }
    }
    it = lanes_.emplace(device, std::make_pair(s[0], s[1])).first;
  }
  *in = reinterpret_cast<std::uintptr_t>(it->second.first);
  *back = reinterpret_cast<std::uintptr_t>(it->second.second);
  return true;
}

DeviceWatch* DevicePath::watch_for(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_) return nullptr;
  auto& w = watches_[device];
  if (!w) w = std::make_unique<DeviceWatch>(driver_.get(), device, watch_spin_ns_);
  return w.get();
}

std::shared_ptr<DeviceMark> DevicePath::mark(int device, std::uintptr_t stream, std::string* why) {
  cuda::Driver& d = *driver_;
  const cuda::Api& api = d.api();
  cuda::Bound bound(d, device);
  if (bound.result() != cuda::kSuccess) {
    *why = "cuda:" + std::to_string(device) + ": " + d.describe(bound.result(), "cuCtxSetCurrent");
    return nullptr;
  }
  cuda::Event ev = nullptr;
  const char* call = nullptr;
  const cuda::Result r = record_new_event(api, cuda::stream_of(stream), &ev, &call);
  if (r != cuda::kSuccess) {
    *why = "an event on the caller's stream of cuda:" + std::to_string(device) + ": " + d.describe(r, call);
    return nullptr;
  }
  return std::make_shared<DeviceMark>(driver_, device, ev);
}

cuda::Result DevicePath::capturing(int device, std::uintptr_t stream, bool* yes) {
  *yes = false;
  if (stream == 0 || stream == 1) return cuda::kSuccess;  // (the default and the legacy stream)
  cuda::Bound bound(*driver_, device);
  if (bound.result() != cuda::kSuccess) return bound.result();
  int status = cuda::kCaptureNone;
  const cuda::Result r = driver_->api().stream_is_capturing(cuda::stream_of(stream), &status);
  if (r == cuda::kSuccess) *yes = status != cuda::kCaptureNone;
  return r;
}

std::shared_ptr<DeviceIn> DevicePath::copy_in(int device, std::uintptr_t stream, const DeviceMark* before,
                                              const std::shared_ptr<Segment>& seg, std::uint64_t offset,
                                              cuda::DevicePtr src, std::uint64_t nbytes, std::string* why) {
  const std::string what = "the copy of " + num(nbytes) + " bytes from cuda:" + std::to_string(device) +
                           " into the input slot could not be enqueued: ";
  if (seg == nullptr ? nbytes != 0 : offset > seg->size() || nbytes > seg->size() - offset) {
    *why = what + "the slot is outside its segment";
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) {
      *why = what + "the device path is stopped (shutting down)";
      return nullptr;
    }
  }
  if (seg != nullptr) pin(seg, device, true);
  cuda::Driver& d = *driver_;
  const cuda::Api& api = d.api();
  cuda::Bound bound(d, device);
  if (bound.result() != cuda::kSuccess) {
    *why = what + d.describe(bound.result(), "cuCtxSetCurrent");
    return nullptr;
  }
  const cuda::Stream s = cuda::stream_of(stream);
  // The event first: once the copy is enqueued, nothing may fail that leaves it untracked (the
  // caller frees the slot on an error, and a copy still landing would write another's data).
  cuda::Event copied = nullptr;
  const char* call = "cuEventCreate";
  cuda::Result r = api.event_create(&copied, cuda::kEventDisableTiming);
  if (r == cuda::kSuccess && before != nullptr) {
    call = "cuStreamWaitEvent";
    r = api.stream_wait_event(s, before->event(), 0);
  }
  bool enqueued = false;
  if (r == cuda::kSuccess && nbytes > 0) {
    call = "cuMemcpyDtoHAsync";
    r = api.memcpy_d2h(seg->base() + offset, src, nbytes, s);
    enqueued = r == cuda::kSuccess;
  }
  if (r == cuda::kSuccess) {
    call = "cuEventRecord";
    r = api.event_record(copied, s);
    // Its end is not known to any event: wait for the stream itself before the slot is let go of.
    if (r != cuda::kSuccess && enqueued) (void)api.stream_synchronize(s);
  }
  if (r != cuda::kSuccess) {
    if (copied != nullptr) (void)api.event_destroy(copied);
    *why = what + d.describe(r, call);
    return nullptr;
  }
  if (enqueued) channel_->count_device(true, nbytes);
  auto in = std::make_shared<DeviceIn>(driver_, device, copied, seg);
  std::vector<std::shared_ptr<DeviceIn>> gone;  // (let go of outside the lock: their events are destroyed)
  {
    std::lock_guard<std::mutex> lock(mu_);
    drop_landed_locked(&gone);  // (so the list stays short)
    ins_.push_back(in);
  }
  return in;
}

bool DevicePath::give_when(const Header& submit, std::shared_ptr<DeviceIn> in, std::int64_t timeout_ns,
                           std::int64_t spin_ns) {
  DeviceWatch* w = watch_for(in->device());
  if (w == nullptr) return false;
  WorkerChannel* ch = channel_;
  const Header h = submit;
  const cuda::Event ready = in->event();
  in->watched_.store(true, std::memory_order_release);
  // (the watch holds `in`, and so its event, until it has ended)
  const bool watched = w->watch(ready, [this, ch, h, timeout_ns, spin_ns, in](cuda::Result r) {
    if (r == DeviceWatch::kStopped) return;
    if (r != cuda::kSuccess) {
      fail(1, "the copy-in of collective #" + num(h.seq) + " failed: " + driver_->describe(r, "cuEventQuery"));
      return;
    }
    bool backlog = false;
    const RingWait got = ch->give(h, timeout_ns, spin_ns, &backlog);
    if (backlog)
      fail(2, ch->backlog_why());
    else if (got != RingWait::kReady)
      fail(2, "the SUBMIT of collective #" + num(h.seq) +
                  " could not go: the daemon did not read this worker's ring (frozen or gone)");
  });
  if (!watched) in->watched_.store(false, std::memory_order_release);
  return watched;
}

void DevicePath::fail(int kind, std::string why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_kind_ == 0) {
    failure_kind_ = kind;
    failure_ = std::move(why);
  }
}

std::pair<int, std::string> DevicePath::failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return {failure_kind_, failure_};
}

std::vector<std::uint64_t> DevicePath::take_landed() {
  std::vector<std::uint64_t> out;
  std::lock_guard<std::mutex> lock(mu_);
  out.swap(landed_);
  return out;
}

std::vector<std::string> DevicePath::take_notes() {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lock(mu_);
  out.swap(notes_);
  return out;
}

void DevicePath::drop_landed_locked(std::vector<std::shared_ptr<DeviceIn>>* gone) {
  std::vector<std::shared_ptr<DeviceIn>> left;
  for (auto& in : ins_) (in->query() == cuda::kNotReady ? left : *gone).push_back(std::move(in));
  ins_.swap(left);
}

std::size_t DevicePath::pending() {
  std::vector<std::shared_ptr<DeviceIn>> gone;  // (let go of outside the lock)
  std::lock_guard<std::mutex> lock(mu_);
  std::size_t n = 0;
  for (auto& kv : watches_) n += kv.second->pending();
  drop_landed_locked(&gone);
  for (const auto& in : ins_)
    if (!in->watched_.load(std::memory_order_acquire)) n++;  // (a watched one is its watch's)
  return n;
}

bool DevicePath::settle(std::int64_t timeout_ns) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
  for (;;) {
    if (pending() == 0) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void DevicePath::stop(bool unpin) {
  std::map<int, std::unique_ptr<DeviceWatch>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    all.swap(watches_);
  }
  for (auto& kv : all) kv.second->stop();  // (outside the lock: a watch's work takes it)
  all.clear();
  if (!unpin) return;
  std::map<std::pair<bool, std::uint32_t>, Pinned> pins;
  std::vector<std::shared_ptr<DeviceIn>> ins;
  {
    std::lock_guard<std::mutex> pin_lock(pin_mu_);
    std::lock_guard<std::mutex> lock(mu_);
    pins.swap(pinned_);
    ins.swap(ins_);
  }
  ins.clear();
  for (auto& kv : pins) {
    if (!kv.second.registered) continue;
    cuda::Bound bound(*driver_, kv.second.device);
    if (bound.result() == cuda::kSuccess) (void)driver_->api().host_unregister(kv.second.seg->base());
  }
}

void DevicePath::pin(const std::shared_ptr<Segment>& seg, int device, bool input) {
  const std::pair<bool, std::uint32_t> key{input, seg->id()};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_ || pinned_.count(key) != 0) return;
  }
  // Outside mu_: registering touches every page of the segment, and copies to and from segments
  // pinned already (other takers, the watches' RELEASEs) go on meanwhile.
  std::lock_guard<std::mutex> pin_lock(pin_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_ || pinned_.count(key) != 0) return;
  }
  Pinned p{seg, device, false};
  std::string note;
  if (seg->size() > 0) {
    cuda::Bound bound(*driver_, device);
    cuda::Result r = bound.result();
    if (r == cuda::kSuccess)
      r = driver_->api().host_register(seg->base(), seg->size(),
                                       cuda::kHostRegisterPortable | (input ? 0u : cuda::kHostRegisterReadOnly));
    p.registered = r == cuda::kSuccess;
    if (!p.registered)
      note = std::string("could not page-lock ") + (input ? "input" : "result") + " segment " + num(seg->id()) +
             " (" + num(seg->size()) + " bytes): " + driver_->describe(r, "cuMemHostRegister") +
             "; copies " + (input ? "to" : "from") +
             " it are staged by the driver and block the thread that enqueues them";
  }
  std::lock_guard<std::mutex> lock(mu_);
  pinned_[key] = std::move(p);
  if (!note.empty()) notes_.push_back(std::move(note));
}

void DevicePath::copied(const std::shared_ptr<DeviceOut>& out, const Header& submit, cuda::Result r) {
  if (r == DeviceWatch::kStopped) return;
  if (r != cuda::kSuccess) {
    fail(1, "the copy of collective #" + num(submit.seq) + "'s result to cuda:" + std::to_string(out->device()) +
                " failed: " + driver_->describe(r, "cuEventQuery"));
  } else {
    release(submit);
  }
  landed(out->token_);
}

void DevicePath::release(const Header& submit) {
  if (channel_->aborted()) return;  // the job failed, or the client is closing: no RELEASE matters now
  const RingWait r = channel_->release(submit.sender, submit.seq, -1, batch_bytes_, timeout_ns_, spin_ns_);
  if (r == RingWait::kReady) return;
  fail(2, r == RingWait::kTimeout
              ? "the RELEASE of collective #" + num(submit.seq) +
                    " could not go: the daemon did not read this worker's ring (frozen or gone)"
              : channel_->why());
}

void DevicePath::landed(std::uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  landed_.push_back(token);
}

}  // namespace smddp
