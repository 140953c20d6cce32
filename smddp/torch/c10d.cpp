// smddp's torch.distributed backend in C++: collectives through the engine's C table, no Python a call.
//
// torch reaches this c10d::Backend as it reaches gloo or NCCL: through its dispatcher, with no GIL. The
// calls smddp runs on host memory in the ordinary case (contiguous CPU tensors of a dtype and op smddp
// carries, in a group of every rank) go straight to the engine's C table (smddp/engine/capi.h), and so
// do all-reduces, broadcasts, all-gathers and reduce-scatters into a tensor of contiguous CUDA tensors
// once the job's device collectives are known to take the engine's device path (start_device;
// DeviceSide says how torch's streams are reached). Every other
// call, and every refusal, goes to the Python group (smddp.torch.backend.ProcessGroupSmddp) as the
// same call: its checks, messages, device path and side-group routing are the one definition of what
// the backend does, and this file only ever takes a shorter way to the same result.
//
// Memory: a Backend holds a reference to the client's table capsule and to the Python group (both let
// go with the GIL in its destructor; the capsule is kept for good while a Work still uses the table).
// A Work holds its engine works (released in its destructor) and its result tensors; while its engine
// works are armed (on_done), each callback holds a reference to the Work. A Work dropped before it
// completed hands its tensors to a callback that keeps them until the engine has written them. A
// device Work also holds its DeviceUse (the addresses its side mapped); one dropped before the device
// is done with its tensors hands them, its engine works and its DeviceUse to the Reaper, which lets go
// of them once the copies landed. A side is shared by its Backend, Works and the Reaper; the stand-in's
// is kept for good by its marker thread once it has one.
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
// (pybind11 with torch's casters alone: torch/extension.h adds the whole C++ frontend, a third of the
// compile time of a module that uses none of it)
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "capi.h"

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A collective's failure as smddp says it: `cls` the smddp.errors class, what() its text. Raised to
// Python as that class (the translator below); a future's error is a RuntimeError naming the class.
struct Failure : std::runtime_error {
  Failure(std::string c, const std::string& why) : std::runtime_error(why), cls(std::move(c)) {}
  std::string cls;
};

std::exception_ptr as_future_error(const std::string& cls, const std::string& why) {
  return std::make_exception_ptr(std::runtime_error(cls + ": " + why));
}

// The engine's table and how many Works use it: a Backend lets the capsule go only when none does.
struct Table {
  const smddp_capi* t = nullptr;
  std::atomic<long> works{0};
  std::string timeout_prefix;  // smddp.errors.CollectiveTimeoutError.PREFIX
};

std::uint8_t dtype_code(at::ScalarType s) {
  switch (s) {
    case at::kByte: return SMDDP_UINT8;
    case at::kInt: return SMDDP_INT32;
    case at::kLong: return SMDDP_INT64;
    case at::kHalf: return SMDDP_FLOAT16;
    case at::kBFloat16: return SMDDP_BFLOAT16;
    case at::kFloat: return SMDDP_FLOAT32;
    case at::kDouble: return SMDDP_FLOAT64;
    default: return 0;
  }
}

std::uint8_t op_code(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return SMDDP_SUM;
    case c10d::ReduceOp::AVG: return SMDDP_AVG;
    case c10d::ReduceOp::MIN: return SMDDP_MIN;
    case c10d::ReduceOp::MAX: return SMDDP_MAX;
    default: return 0;
  }
}

// A tensor the engine takes by its address: host memory, dense, in order, of a dtype smddp carries.
bool plain(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() &&
         dtype_code(t.scalar_type()) != 0 && t.numel() > 0;
}

class Work;

// Whether Python objects may still be let go here: not once the interpreter is gone or going (a group
// destroyed at exit), where taking the GIL from another thread would hang; what is held is then kept.
bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// How many device collectives of each kind (its wire code less one) took the engine's device route in
// this process (device_calls()).
std::atomic<long long> g_device_calls[4] = {};

// Where a device collective's tensors live and how torch's streams are reached for them: CUDA through
// c10's device guard (CudaSide), or the doubles of a runtime whose device memory is host memory
// (StandinSide: smddp's stand-in, under which CPU tensors take this route). One a Backend, shared
// with its Works and the Reaper.
class DeviceSide {
 public:
  virtual ~DeviceSide() = default;
  // Whether `t` is device memory here (CUDA: a CUDA tensor; the stand-in: a CPU tensor).
  virtual bool takes(const at::Tensor& t) const = 0;
  virtual int index(const at::Tensor& t) const = 0;
  // `t`'s device address (*addr); *mapped says the address must be given back (unmap) once the device
  // is done with it. False, with why, where it cannot be had.
  virtual bool address(const at::Tensor& t, std::uint64_t* addr, bool* mapped, std::string* why) = 0;
  virtual void unmap(std::uint64_t addr) = 0;
  // The calling thread's current stream on `device` (torch's current CUDA stream).
  virtual std::uintptr_t current(int device) = 0;
  // After `stream` was made to wait for a result: what the host must do before the caller's next torch
  // operation (CUDA: nothing, the operation is queued on `stream`; the stand-in: wait, as the host
  // runs a CPU tensor's operations at once).
  virtual void follow(std::uintptr_t stream, int device) = 0;
  // A future for a Work of `device`, which records its readers' events where it is completed.
  virtual c10::intrusive_ptr<c10::ivalue::Future> future(int device) = 0;
  // Completes a future once its readers are ordered after the result: `order(stream)` makes `stream`
  // wait for the copies back, `mark()` completes the future (called with `stream` current, so that
  // torch records the readers' event there). On the thread that completes the Work.
  virtual void settle(int device, std::function<bool(std::uintptr_t)> order, std::function<void()> mark) = 0;
};

class CudaSide final : public DeviceSide {
 public:
  bool takes(const at::Tensor& t) const override { return t.is_cuda(); }
  int index(const at::Tensor& t) const override { return t.get_device(); }
  bool address(const at::Tensor& t, std::uint64_t* addr, bool* mapped, std::string*) override {
    *addr = reinterpret_cast<std::uintptr_t>(t.data_ptr());
    *mapped = false;
    return true;
  }
  void unmap(std::uint64_t) override {}
  std::uintptr_t current(int device) override {
    return reinterpret_cast<std::uintptr_t>(guard().getStream(cuda(device)).native_handle());
  }
  void follow(std::uintptr_t, int) override {}
  c10::intrusive_ptr<c10::ivalue::Future> future(int device) override {
    return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                    std::vector<c10::Device>{cuda(device)});
  }
  // On the engine's thread, at once (nothing here waits): a stream of torch's pool, made current while
  // the future is marked, waits for the copies back; torch records the future's event on it.
  void settle(int device, std::function<bool(std::uintptr_t)> order, std::function<void()> mark) override {
    const c10::Stream pool = guard().getStreamFromGlobalPool(cuda(device), false);
    c10::StreamGuard on(pool);
    if (order(reinterpret_cast<std::uintptr_t>(pool.native_handle()))) mark();
  }

 private:
  static c10::Device cuda(int device) { return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)); }
  static const c10::impl::DeviceGuardImplInterface& guard() {
    return *c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  }
};

// The stand-in's doubles (smddp_rigs.standin.StandinRuntime.torch_native: its driver library's
// functions). Whatever would wait on a stream in CUDA is work the host is about to do, so the host
// waits: after a Work's wait, and before its future is marked (on a thread of its own, in order,
// as markCompleted on a GPU lets the completing thread go on at once). Never earlier: a stream the
// copies were not ordered before leaves the host racing them, as CUDA would leave the kernels.
class StandinSide final : public DeviceSide, public std::enable_shared_from_this<StandinSide> {
 public:
  using current_fn = void* (*)();
  using alias_fn = int (*)(void*, std::size_t, int, std::uint64_t*);
  using unmap_fn = int (*)(std::uint64_t);
  using sync_fn = int (*)(void*, int);
  using stream_fn = int (*)(int, void**);

  explicit StandinSide(const std::map<std::string, std::uintptr_t>& fns)
      : current_(reinterpret_cast<current_fn>(fns.at("current"))),
        alias_(reinterpret_cast<alias_fn>(fns.at("alias"))),
        unmap_(reinterpret_cast<unmap_fn>(fns.at("unmap"))),
        sync_(reinterpret_cast<sync_fn>(fns.at("synchronize"))),
        new_stream_(reinterpret_cast<stream_fn>(fns.at("new_stream"))) {}

  bool takes(const at::Tensor& t) const override { return t.is_cpu(); }
  int index(const at::Tensor&) const override { return 0; }
  bool address(const at::Tensor& t, std::uint64_t* addr, bool* mapped, std::string* why) override {
    const int r = alias_(t.data_ptr(), static_cast<std::size_t>(t.numel()) * t.element_size(), 0, addr);
    *mapped = r == 0;
    if (r != 0) *why = "the stand-in could not map the tensor (error " + std::to_string(r) + ")";
    return r == 0;
  }
  void unmap(std::uint64_t addr) override { (void)unmap_(addr); }
  std::uintptr_t current(int) override { return reinterpret_cast<std::uintptr_t>(current_()); }
  void follow(std::uintptr_t stream, int device) override { (void)sync_(reinterpret_cast<void*>(stream), device); }
  c10::intrusive_ptr<c10::ivalue::Future> future(int) override {
    return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  }
  void settle(int device, std::function<bool(std::uintptr_t)> order, std::function<void()> mark) override {
    std::lock_guard<std::mutex> lock(mu_);
    marks_.push_back(Mark{device, std::move(order), std::move(mark)});
    if (!started_) {
      started_ = true;
      // (The thread keeps the side: never destroyed once it marked a future, as the Watchdog.)
      std::thread([self = shared_from_this()] { self->run(); }).detach();
    }
    cv_.notify_one();
  }

 private:
  struct Mark {
    int device;
    std::function<bool(std::uintptr_t)> order;
    std::function<void()> mark;
  };
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return !marks_.empty(); });
      Mark m = std::move(marks_.front());
      marks_.pop_front();
      lock.unlock();
      if (stream_ == nullptr) (void)new_stream_(m.device, &stream_);
      const auto s = reinterpret_cast<std::uintptr_t>(stream_);
      if (m.order(s)) {
        (void)sync_(stream_, m.device);  // the future's readers run on the host once it is marked
        m.mark();
      }
      m = Mark{};  // (what it holds let go here, not under the lock)
      lock.lock();
    }
  }
  current_fn current_;
  alias_fn alias_;
  unmap_fn unmap_;
  sync_fn sync_;
  stream_fn new_stream_;
  void* stream_ = nullptr;  // the marker's own stream (the marker thread's alone)
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Mark> marks_;
  bool started_ = false;
};

// What a device Work holds beside its engine works: its side, its device, the addresses the side
// mapped for its tensors (given back once the device is done with them), and the inputs its copies in
// read that are not among its results (kept as long).
struct DeviceUse {
  std::shared_ptr<DeviceSide> side;
  int device = 0;
  std::vector<std::uint64_t> mapped;
  std::vector<at::Tensor> inputs;  // (inputs that are not results: an all-gather's, a reduce-scatter's)
  ~DeviceUse() {
    for (std::uint64_t a : mapped) side->unmap(a);
  }
};

// Whether the device is done with every copy of `ws` (none in flight, however each ended).
bool landed(const smddp_capi* t, const std::vector<smddp_work*>& ws) {
  for (smddp_work* w : ws)
    if (t->status(w) == SMDDP_PENDING || t->device_query(w) == SMDDP_PENDING) return false;
  return true;
}

// Keeps what a device Work let go of while the device still copies into or out of its tensors: the
// tensors (the caching allocator would hand their memory out again), the engine works and mapped
// addresses, until the copies land. One thread a process, started on first use, polling each
// millisecond while it holds anything. Never destroyed (its thread outlives main's exit).
class Reaper {
 public:
  static Reaper& get() {
    static Reaper* r = new Reaper();
    return *r;
  }
  void keep(std::shared_ptr<Table> tb, std::vector<smddp_work*> ws, std::vector<at::Tensor> ts,
            std::unique_ptr<DeviceUse> dev) {
    tb->works.fetch_add(1, std::memory_order_relaxed);  // (the table stays while these use it)
    std::lock_guard<std::mutex> lock(mu_);
    held_.push_back(Held{std::move(tb), std::move(ws), std::move(ts), std::move(dev)});
    if (!started_) {
      started_ = true;
      std::thread([this] { run(); }).detach();
    }
    cv_.notify_one();
  }

 private:
  struct Held {
    std::shared_ptr<Table> tb;
    std::vector<smddp_work*> ws;
    std::vector<at::Tensor> ts;
    std::unique_ptr<DeviceUse> dev;
  };
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return !held_.empty(); });
      std::vector<Held> done;
      for (auto it = held_.begin(); it != held_.end();) {
        if (landed(it->tb->t, it->ws)) {
          done.push_back(std::move(*it));
          it = held_.erase(it);
        } else {
          ++it;
        }
      }
      lock.unlock();
      for (Held& h : done) {
        for (smddp_work* w : h.ws) h.tb->t->release(w);
        h.tb->works.fetch_sub(1, std::memory_order_release);
      }
      done.clear();  // (tensors and mappings let go here, not under the lock)
      lock.lock();
      if (!held_.empty()) cv_.wait_for(lock, milliseconds(1));
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Held> held_;
  bool started_ = false;
};

// Fails armed Works still running at their timeout, so that a future (DDP's reducer waits on one in C++,
// with no timeout) ends with the timeout instead of hanging on a stopped rank. One thread a process,
// started on first use, asleep until the earliest deadline; Works are kept per timeout in start order
// (so in deadline order) and leave as they complete. Never destroyed (its thread outlives main's exit).
class Watchdog {
 public:
  static Watchdog& get() {
    static Watchdog* w = new Watchdog();
    return *w;
  }
  std::uint64_t watch(const c10::intrusive_ptr<c10d::Work>& w, milliseconds timeout);
  void forget(milliseconds timeout, std::uint64_t key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto q = by_timeout_.find(timeout.count());
    if (q != by_timeout_.end()) q->second.erase(key);
  }

 private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<long long, std::map<std::uint64_t, std::pair<Clock::time_point, c10::weak_intrusive_ptr<c10d::Work>>>>
      by_timeout_;
  std::uint64_t next_ = 1;
  bool started_ = false;
};

// A collective (or several: an all-reduce of several tensors) on the engine, as a torch Work.
class Work : public c10d::Work {
 public:
  // `dev`: where a device collective's tensors live (null: host memory).
  Work(std::shared_ptr<Table> tb, std::vector<smddp_work*> ws, std::vector<at::Tensor> result, c10d::OpType type,
       const char* name, milliseconds timeout, int rank, std::unique_ptr<DeviceUse> dev = nullptr)
      : c10d::Work(rank, type),
        tb_(std::move(tb)),
        ws_(std::move(ws)),
        result_(std::move(result)),
        name_(name),
        timeout_(timeout),
        dev_(std::move(dev)) {
    tb_->works.fetch_add(1, std::memory_order_relaxed);
  }

  ~Work() override {
    const smddp_capi* t = tb_->t;
    if (!armed_.load(std::memory_order_acquire)) {
      // Dropped before it completed and with nobody to complete it: the collective goes on (every rank
      // needs it), so its DONEs must still be taken and its result written where the caller asked; its
      // tensors are kept until then.
      for (smddp_work* w : ws_) {
        if (t->status(w) != SMDDP_PENDING) continue;
        auto* keep = new std::vector<at::Tensor>(result_);
        if (t->on_done(w, &Work::kept, keep) != SMDDP_OK) delete keep;
      }
    }
    if (dev_ != nullptr && !landed(t, ws_)) {
      // The device still copies into or out of the tensors: they, the works and the mappings are
      // kept until it is done.
      Reaper::get().keep(tb_, std::move(ws_), std::move(result_), std::move(dev_));
      ws_.clear();
    }
    for (smddp_work* w : ws_) t->release(w);
    tb_->works.fetch_sub(1, std::memory_order_release);
  }

  bool wait(milliseconds timeout) override {
    const milliseconds t = timeout > milliseconds(0) ? timeout : timeout_;
    const Clock::time_point deadline = Clock::now() + t;
    for (smddp_work* w : ws_) {
      const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
      int st = tb_->t->wait(w, left > 0 ? left : 0.0);
      if (st == SMDDP_PENDING) {
        time_out(t);  // (what completed meanwhile keeps its result)
        st = tb_->t->status(w);
      }
      if (st == SMDDP_FAILED) throw Failure(tb_->t->error_class(w), tb_->t->why(w));
    }
    if (dev_ != nullptr) {
      // As torch's device Works wait: the caller's current stream waits for the result's copies back.
      const std::uintptr_t stream = dev_->side->current(dev_->device);
      std::string why;
      if (!order(stream, &why)) throw Failure("DeviceError", why);
      dev_->side->follow(stream, dev_->device);
    }
    return true;
  }

  bool isCompleted() override {
    arm();  // (polled: it must complete on its own from now on)
    for (smddp_work* w : ws_)
      if (tb_->t->status(w) == SMDDP_PENDING) return false;
    return dev_ == nullptr || landed(tb_->t, ws_);  // (a device Work: once its copies back landed)
  }

  bool isSuccess() const override {
    for (smddp_work* w : ws_)
      if (tb_->t->status(w) != SMDDP_OK) return false;
    return true;
  }

  std::exception_ptr exception() const override {
    for (smddp_work* w : ws_)
      if (tb_->t->status(w) == SMDDP_FAILED) return as_future_error(tb_->t->error_class(w), tb_->t->why(w));
    return nullptr;
  }

  std::vector<at::Tensor> result() override { return result_; }

  // Made only when asked for (DDP's reducer asks at once; a Work only waited for never needs one), and
  // completed by whichever thread completes the collective.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    c10::intrusive_ptr<c10::ivalue::Future> f;
    bool late = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (future_) return future_;
      f = future_ = dev_ != nullptr
                        ? dev_->side->future(dev_->device)
                        : c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      late = completed_;  // complete() ran before there was a future: made complete here
    }
    if (late)
      settle(f);
    else
      arm();
    return f;
  }

  // The Work fails with the timeout (its waiter's, or the watchdog's) where still running; nothing more is
  // written into its tensors.
  void time_out(milliseconds t) {
    char ms[64];
    std::snprintf(ms, sizeof ms, "%g", static_cast<double>(t.count()));
    const std::string why = tb_->timeout_prefix + " waiting " + ms + "ms for " + name_ + "; it is still in flight";
    for (smddp_work* w : ws_) tb_->t->abandon(w, "CollectiveTimeoutError", why.c_str());
  }

 private:
  // From now on it completes on its own: each engine work's callback, on the thread that completes it;
  // the last completes the future. Watched until then, as torch's own backends watch theirs.
  void arm() {
    if (armed_.exchange(true, std::memory_order_acq_rel)) return;
    left_.store(static_cast<long>(ws_.size()), std::memory_order_relaxed);
    c10::intrusive_ptr<c10d::Work> self = c10::intrusive_ptr<c10d::Work>::reclaim_copy(this);
    watch_key_ = Watchdog::get().watch(self, timeout_);
    for (smddp_work* w : ws_) {
      c10::raw::intrusive_ptr::incref(this);  // the callback's (given back there)
      if (tb_->t->on_done(w, &Work::done, this) != SMDDP_OK) done(this, w, tb_->t->status(w));
    }
  }

  static void done(void* arg, smddp_work* w, int status) {
    auto* self = static_cast<Work*>(arg);
    if (status != SMDDP_OK) {
      std::lock_guard<std::mutex> lock(self->mu_);
      if (self->failed_cls_.empty()) {
        self->failed_cls_ = self->tb_->t->error_class(w);
        self->failed_why_ = self->tb_->t->why(w);
      }
    }
    if (self->left_.fetch_sub(1, std::memory_order_acq_rel) == 1) self->complete();
    c10::raw::intrusive_ptr::decref(self);
  }

  void complete() {
    Watchdog::get().forget(timeout_, watch_key_);
    c10::intrusive_ptr<c10::ivalue::Future> f;
    {
      std::lock_guard<std::mutex> lock(mu_);
      completed_ = true;  // (a future made from now on is made complete: getFuture)
      f = future_;
    }
    if (f) settle(f);
  }

  // The future completed with the Work's outcome (its tensors, or its first failure).
  void settle(const c10::intrusive_ptr<c10::ivalue::Future>& f) {
    std::string cls, why;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cls = failed_cls_;
      why = failed_why_;
    }
    if (!cls.empty()) {
      f->setError(as_future_error(cls, why));
    } else if (dev_ == nullptr) {
      f->markCompleted(c10::IValue(result_));
    } else {
      // Marked where its readers are ordered after the copies back (the side says how).
      c10::intrusive_ptr<Work> self = c10::intrusive_ptr<Work>::reclaim_copy(this);
      dev_->side->settle(
          dev_->device,
          [self, f](std::uintptr_t stream) {
            std::string why;
            if (self->order(stream, &why)) return true;
            f->setError(as_future_error("DeviceError", why));
            return false;
          },
          [self, f] { f->markCompleted(c10::IValue(self->result_)); });
    }
  }

  // `stream` waits for every engine work's copies back; false with why where the driver refused.
  bool order(std::uintptr_t stream, std::string* why) {
    for (smddp_work* w : ws_) {
      char buf[512];
      if (tb_->t->device_order(w, stream, buf, sizeof buf) != SMDDP_OK) {
        *why = buf;
        return false;
      }
    }
    return true;
  }

  static void kept(void* arg, smddp_work*, int) { delete static_cast<std::vector<at::Tensor>*>(arg); }

  std::shared_ptr<Table> tb_;
  std::vector<smddp_work*> ws_;
  std::vector<at::Tensor> result_;
  std::string name_;
  milliseconds timeout_;
  std::atomic<bool> armed_{false};
  std::atomic<long> left_{0};
  std::uint64_t watch_key_ = 0;
  std::mutex mu_;  // guards what follows
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::string failed_cls_, failed_why_;
  bool completed_ = false;
  std::unique_ptr<DeviceUse> dev_;  // (set at construction; moved to the Reaper in the destructor)
};

std::uint64_t Watchdog::watch(const c10::intrusive_ptr<c10d::Work>& w, milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& q = by_timeout_[timeout.count()];
  const bool first = q.empty();
  const std::uint64_t key = next_++;
  q.emplace(key, std::make_pair(Clock::now() + timeout, c10::weak_intrusive_ptr<c10d::Work>(w)));
  if (!started_) {
    started_ = true;
    std::thread([this] { run(); }).detach();
  } else if (first) {
    cv_.notify_one();
  }
  return key;
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    std::vector<std::pair<milliseconds, c10::weak_intrusive_ptr<c10d::Work>>> expired;
    const Clock::time_point now = Clock::now();
    Clock::time_point earliest = Clock::time_point::max();
    for (auto& [ms, q] : by_timeout_) {
      while (!q.empty()) {
        auto it = q.begin();
        if (it->second.first > now) {
          earliest = std::min(earliest, it->second.first);
          break;
        }
        expired.emplace_back(milliseconds(ms), std::move(it->second.second));
        q.erase(it);
      }
    }
    if (expired.empty()) {
      if (earliest == Clock::time_point::max())
        cv_.wait(lock);
      else
        cv_.wait_until(lock, earliest);
      continue;
    }
    lock.unlock();
    for (auto& [ms, weak] : expired) {
      c10::intrusive_ptr<c10d::Work> w = weak.lock();
      if (w) static_cast<Work*>(w.get())->time_out(ms);  // (only Works are watched)
    }
    lock.lock();
  }
}

// A Work complete before it is returned (a blocking call run whole in the caller's thread).
class DoneWork : public c10d::Work {
 public:
  DoneWork(std::vector<at::Tensor> result, c10d::OpType type, int rank)
      : c10d::Work(rank, type), result_(std::move(result)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(milliseconds) override { return true; }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto f = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    f->markCompleted(c10::IValue(result_));
    return f;
  }

 private:
  std::vector<at::Tensor> result_;
};

// The Python group's Work as a C++ one, the Python object kept alive with it. Its state is asked of the
// Python object (torch's trampoline forwards only wait and get_future of a Work written in Python;
// the rest would answer the C++ base's defaults), which also serves a side group's C++ Work through
// its bindings: those calls take the GIL, as the Python group's Works always have.
class PyWork : public c10d::Work {
 public:
  PyWork(c10::intrusive_ptr<c10d::Work> w, py::object keep) : w_(std::move(w)), keep_(std::move(keep)) {}
  ~PyWork() override {
    if (!python_alive()) {
      (void)keep_.release();  // (the interpreter is gone: nothing to give back)
      return;
    }
    py::gil_scoped_acquire gil;
    keep_ = py::object();
  }
  bool isCompleted() override { return ask<bool>("is_completed"); }
  bool isSuccess() const override { return ask<bool>("is_success"); }
  std::exception_ptr exception() const override {
    py::gil_scoped_acquire gil;
    py::object e = keep_.attr("exception")();
    if (e.is_none()) return nullptr;
    return as_future_error(py::str(py::type::handle_of(e).attr("__name__")), py::str(e));
  }
  std::vector<at::Tensor> result() override { return ask<std::vector<at::Tensor>>("result"); }
  void synchronize() override {
    py::gil_scoped_acquire gil;
    keep_.attr("synchronize")();
  }
  int sourceRank() const override { return ask<int>("_source_rank"); }  // (a recv from any source's)
  bool wait(milliseconds timeout) override { return w_->wait(timeout); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return w_->getFuture(); }

 private:
  // The Python object's answer, converted while the GIL is held (its Python objects let go there too).
  template <typename T>
  T ask(const char* method) const {
    py::gil_scoped_acquire gil;
    return keep_.attr(method)().template cast<T>();
  }

  c10::intrusive_ptr<c10d::Work> w_;
  py::object keep_;
};

class Backend : public c10d::Backend {
 public:
  using c10d_work_t = c10::intrusive_ptr<c10d::Work>;

  // `capsule`: the client's table (Client.native_api()); `group`: the Python group every other call
  // goes to; `direct`: whether calls on host tensors may take the table (not where a device runtime
  // claims CPU tensors, as smddp's stand-in does); `timeout_ms`: the group's.
  // `piece_bytes`: the job's all-reduce pieces (0: whole); `doubles`: a runtime's native doubles of
  // torch's CUDA calls, under which host tensors take the device route (StandinSide), else none.
  Backend(py::object capsule, py::object group, int rank, int size, long long timeout_ms, bool direct,
          std::string timeout_prefix, long long piece_bytes, const std::map<std::string, std::uintptr_t>& doubles)
      : c10d::Backend(rank, size),
        tb_(std::make_shared<Table>()),
        capsule_(std::move(capsule)),
        group_(std::move(group)),
        timeout_(timeout_ms),
        direct_(direct),
        piece_bytes_(piece_bytes),
        side_(doubles.empty() ? std::shared_ptr<DeviceSide>(std::make_shared<CudaSide>())
                              : std::shared_ptr<DeviceSide>(std::make_shared<StandinSide>(doubles))) {
    const auto* t = static_cast<const smddp_capi*>(PyCapsule_GetPointer(capsule_.ptr(), SMDDP_CAPI_CAPSULE));
    if (t == nullptr) throw py::error_already_set();
    if (t->version != SMDDP_CAPI_VERSION || t->size < sizeof(smddp_capi))
      throw std::runtime_error("smddp: the engine's C table is version " + std::to_string(t->version) +
                               " of " + std::to_string(t->size) + " bytes; this backend was built for version " +
                               std::to_string(SMDDP_CAPI_VERSION) + " of " + std::to_string(sizeof(smddp_capi)));
    if (static_cast<int>(t->world) != size || static_cast<int>(t->rank) != rank)
      throw std::runtime_error("smddp: the engine's table is rank " + std::to_string(t->rank) + " of " +
                               std::to_string(t->world) + ", the group rank " + std::to_string(rank) + " of " +
                               std::to_string(size));
    tb_->t = t;
    tb_->timeout_prefix = std::move(timeout_prefix);
    // (A table of an engine before the device route ends at `abandon`: device calls go to the group.)
    device_ok_ = t->size >= offsetof(smddp_capi, device_query) + sizeof t->device_query;
  }

  ~Backend() override {
    if (!python_alive()) {
      (void)capsule_.release();
      (void)group_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    group_ = py::object();
    if (tb_->works.load(std::memory_order_acquire) == 0)
      capsule_ = py::object();
    else
      (void)capsule_.release();  // a Work still uses the table: kept for good (a table is small)
  }

  const std::string getBackendName() const override { return "smddp"; }

  // The group's collective count, as gloo keeps it (torch's debug wrapper, TORCH_DISTRIBUTED_DEBUG=DETAIL,
  // compares it across ranks): every call, whichever way it runs.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_.load(std::memory_order_relaxed); }

  py::object group() const { return group_; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                          const c10d::AllreduceOptions& opts) override {
    if (auto w = allreduce_each(tensors, opts.reduceOp, c10d::OpType::ALLREDUCE, opts.timeout, opts.asyncOp))
      return w;
    if (auto w = in_place_device(SMDDP_ALLREDUCE, tensors, op_code(opts.reduceOp), 0, c10d::OpType::ALLREDUCE,
                                 "all_reduce", opts.timeout, opts.asyncOp))
      return w;
    auto w = delegate("allreduce", tensors, opts);
    learn_device_route(tensors);
    return w;
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                    const c10d::AllreduceCoalescedOptions& opts) override {
    if (auto w = allreduce_each(tensors, opts.reduceOp, c10d::OpType::ALLREDUCE_COALESCED, opts.timeout,
                                opts.asyncOp))
      return w;
    if (auto w = in_place_device(SMDDP_ALLREDUCE, tensors, op_code(opts.reduceOp), 0,
                                 c10d::OpType::ALLREDUCE_COALESCED, "all_reduce", opts.timeout, opts.asyncOp))
      return w;
    auto w = delegate("allreduce_coalesced", tensors, opts);
    learn_device_route(tensors);
    return w;
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                          const c10d::BroadcastOptions& opts) override {
    const auto root = static_cast<std::uint32_t>(opts.rootRank);
    if (direct_ && opts.rootTensor == 0 && opts.rootRank >= 0 && opts.rootRank < getSize() && all_plain(tensors)) {
      std::vector<smddp_collective> cs;
      for (at::Tensor& t : tensors) {
        smddp_collective c = collective(SMDDP_BROADCAST, t, t, 0);
        c.root = root;
        if (static_cast<int>(root) != getRank()) c.src = nullptr;
        cs.push_back(c);
      }
      if (auto w = run(cs, tensors, c10d::OpType::BROADCAST, "broadcast", opts.timeout, opts.asyncOp)) return w;
    }
    if (opts.rootTensor == 0 && opts.rootRank >= 0 && opts.rootRank < getSize()) {
      if (auto w = in_place_device(SMDDP_BROADCAST, tensors, 0, root, c10d::OpType::BROADCAST, "broadcast",
                                   opts.timeout, opts.asyncOp))
        return w;
    }
    auto w = delegate("broadcast", tensors, opts);
    learn_device_route(tensors);
    return w;
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                const c10d::AllgatherOptions& opts) override {
    if (direct_ && plain(in) && plain(out) && out.scalar_type() == in.scalar_type() &&
        out.numel() == in.numel() * getSize()) {
      std::vector<smddp_collective> cs{collective(SMDDP_ALLGATHER, in, out, 0)};
      std::vector<at::Tensor> result{out};
      if (auto w = run(cs, result, c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", opts.timeout,
                       opts.asyncOp))
        return w;
    }
    std::vector<at::Tensor> result{out};
    if (out.numel() == in.numel() * getSize()) {
      std::vector<DeviceCall> calls{{in, out}};
      if (auto w = device_route(SMDDP_ALLGATHER, calls, 0, 0, result, c10d::OpType::_ALLGATHER_BASE,
                                "all_gather_into_tensor", opts.timeout, opts.asyncOp))
        return w;
    }
    auto w = delegate("_allgather_base", out, in, opts);
    learn_device_route(result);
    return w;
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                     const c10d::ReduceScatterOptions& opts) override {
    const std::uint8_t op = op_code(opts.reduceOp);
    if (direct_ && op != 0 && plain(in) && plain(out) && out.scalar_type() == in.scalar_type() &&
        in.numel() == out.numel() * getSize()) {
      std::vector<smddp_collective> cs{collective(SMDDP_REDUCE_SCATTER, in, out, op)};
      std::vector<at::Tensor> result{out};
      if (auto w = run(cs, result, c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", opts.timeout,
                       opts.asyncOp))
        return w;
    }
    std::vector<at::Tensor> result{out};
    if (in.numel() == out.numel() * getSize()) {
      std::vector<DeviceCall> calls{{in, out}};
      if (auto w = device_route(SMDDP_REDUCE_SCATTER, calls, op, 0, result, c10d::OpType::_REDUCE_SCATTER_BASE,
                                "reduce_scatter_tensor", opts.timeout, opts.asyncOp))
        return w;
    }
    auto w = delegate("_reduce_scatter_base", out, in, opts);
    learn_device_route(result);
    return w;
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    if (direct_) {
      smddp_collective c{};
      c.kind = SMDDP_BARRIER;
      c.dtype = SMDDP_UINT8;
      std::vector<smddp_collective> cs{c};
      std::vector<at::Tensor> none;
      if (auto w = run(cs, none, c10d::OpType::BARRIER, "barrier", opts.timeout, opts.asyncOp)) return w;
    }
    return delegate("barrier", opts);
  }

  // What the table does not run: the Python group's calls of the same names.
  c10d_work_t reduce(std::vector<at::Tensor>& ts, const c10d::ReduceOptions& o) override {
    return delegate("reduce", ts, o);
  }
  c10d_work_t allgather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                        const c10d::AllgatherOptions& o) override {
    return delegate("allgather", outs, ins, o);
  }
  c10d_work_t allgather_coalesced(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                                  const c10d::AllgatherOptions& o) override {
    return delegate("allgather_coalesced", outs, ins, o);
  }
  c10d_work_t allgather_into_tensor_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                              const c10d::AllgatherOptions& o) override {
    return delegate("allgather_into_tensor_coalesced", outs, ins, o);
  }
  c10d_work_t gather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                     const c10d::GatherOptions& o) override {
    return delegate("gather", outs, ins, o);
  }
  c10d_work_t scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                      const c10d::ScatterOptions& o) override {
    return delegate("scatter", outs, ins, o);
  }
  c10d_work_t reduce_scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                             const c10d::ReduceScatterOptions& o) override {
    return delegate("reduce_scatter", outs, ins, o);
  }
  c10d_work_t reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                              const c10d::ReduceScatterOptions& o) override {
    return delegate("reduce_scatter_tensor_coalesced", outs, ins, o);
  }
  c10d_work_t alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                            std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    return delegate("alltoall_base", out, in, out_splits, in_splits, o);
  }
  c10d_work_t alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                       const c10d::AllToAllOptions& o) override {
    return delegate("alltoall", outs, ins, o);
  }
  c10d_work_t send(std::vector<at::Tensor>& ts, int dst, int tag) override { return delegate("send", ts, dst, tag); }
  c10d_work_t recv(std::vector<at::Tensor>& ts, int src, int tag) override { return delegate("recv", ts, src, tag); }
  c10d_work_t recvAnysource(std::vector<at::Tensor>& ts, int tag) override {
    return delegate("recv_anysource", ts, tag);
  }

 private:
  // Each tensor all-reduced on its own through the table (as the Python group runs several); null where
  // the call is not the table's (the caller hands it to the Python group).
  c10d_work_t allreduce_each(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& reduce_op, c10d::OpType type,
                             milliseconds timeout, bool async) {
    const std::uint8_t op = op_code(reduce_op);
    if (!direct_ || op == 0 || !all_plain(tensors)) return {};
    std::vector<smddp_collective> cs;
    cs.reserve(tensors.size());
    for (at::Tensor& t : tensors) cs.push_back(collective(SMDDP_ALLREDUCE, t, t, op));
    return run(cs, tensors, type, "all_reduce", timeout, async);
  }

  // One device collective of a call: `in` into `out` (the same tensor for an all-reduce or a broadcast).
  struct DeviceCall {
    at::Tensor in, out;
  };

  // Each tensor of an in-place call (all-reduce, broadcast) on the engine's device route.
  c10d_work_t in_place_device(std::uint8_t kind, std::vector<at::Tensor>& tensors, std::uint8_t op,
                              std::uint32_t root, c10d::OpType type, const char* name, milliseconds timeout,
                              bool async) {
    std::vector<DeviceCall> calls;
    calls.reserve(tensors.size());
    for (at::Tensor& t : tensors) calls.push_back(DeviceCall{t, t});
    return device_route(kind, calls, op, root, tensors, type, name, timeout, async);
  }

  // `calls` (collectives of `kind`) on the engine's device route: copies on torch's current stream, or
  // after it on the engine's lanes; null where the call is not the route's, with nothing enqueued or
  // sent. The route is taken once the job's device collectives are known to go through the engine's
  // device path: the Python group starts the device machinery at its first device collective, where
  // every rank together decides whether the GPU step takes them instead (learn_device_route).
  c10d_work_t device_route(std::uint8_t kind, std::vector<DeviceCall>& calls, std::uint8_t op, std::uint32_t root,
                           std::vector<at::Tensor>& result, c10d::OpType type, const char* name,
                           milliseconds timeout, bool async) {
    const bool reduces = kind == SMDDP_ALLREDUCE || kind == SMDDP_REDUCE_SCATTER;
    if (route_.load(std::memory_order_acquire) != kEngine || calls.empty() || (reduces && op == 0)) return {};
    int device = -1;
    std::int64_t bytes = 0;
    for (const DeviceCall& k : calls) {
      for (const at::Tensor* t : {&k.in, &k.out}) {
        if (!t->defined() || !side_->takes(*t) || t->layout() != at::kStrided || !t->is_contiguous() ||
            dtype_code(t->scalar_type()) == 0 || t->numel() == 0)
          return {};
        const int d = side_->index(*t);
        if (device >= 0 && d != device) return {};  // (one call, one device: the group says so)
        device = d;
      }
      if (k.in.scalar_type() != k.out.scalar_type()) return {};
      bytes += k.in.numel() * static_cast<std::int64_t>(k.in.element_size());
    }
    auto use = std::make_unique<DeviceUse>();
    use->side = side_;
    use->device = device;
    // A blocking call of one tensor in one piece (every kind but an all-reduce goes in one) runs both
    // copies on the caller's stream (its later work ordered after the copy back already); else on the
    // engine's lanes after the caller's stream.
    const bool one_piece = kind != SMDDP_ALLREDUCE || piece_bytes_ <= 0 || bytes <= piece_bytes_;
    const bool in_line = !async && calls.size() == 1 && one_piece;
    const smddp_device_call where{device, in_line ? SMDDP_DEVICE_IN_LINE : 0u, side_->current(device)};
    const smddp_capi* t = tb_->t;
    std::vector<smddp_work*> ws;
    for (DeviceCall& k : calls) {
      std::uint64_t src = 0, dst = 0;
      std::string why;
      const bool same = k.in.is_same(k.out);
      bool ok = address(k.in, &src, use.get(), &why);
      dst = src;
      if (ok && !same) ok = address(k.out, &dst, use.get(), &why);
      if (!ok) {
        if (ws.empty()) return {};
        started(std::move(ws), result, type, name, timeout, std::move(use));
        throw Failure("DeviceError", why);
      }
      if (!same) use->inputs.push_back(k.in);
      smddp_collective c = collective(kind, k.in, k.out, op);
      c.root = root;
      c.src = kind == SMDDP_BROADCAST && static_cast<int>(root) != getRank()
                  ? nullptr
                  : reinterpret_cast<void*>(static_cast<std::uintptr_t>(src));
      c.dst = reinterpret_cast<void*>(static_cast<std::uintptr_t>(dst));
      smddp_work* w = nullptr;
      char buf[512];
      const int st = t->start_device(t->ctx, &c, &where, &w, buf, sizeof buf);
      if (st != SMDDP_OK) {
        if (ws.empty()) return {};  // (nothing sent: the group takes the call, and says why as it does)
        started(std::move(ws), result, type, name, timeout, std::move(use));
        throw Failure(st == SMDDP_CLOSED ? "CollectiveError" : "SmddpError", buf);
      }
      ws.push_back(w);
    }
    seq_.fetch_add(1, std::memory_order_relaxed);
    g_device_calls[kind - 1].fetch_add(1, std::memory_order_relaxed);
    auto work = c10::make_intrusive<Work>(tb_, std::move(ws), result, type, name, timeout_of(timeout), getRank(),
                                          std::move(use));
    if (async) return work;
    work->wait(milliseconds(0));  // (the caller's stream ordered after the result, as torch's wait does)
    return c10::make_intrusive<DoneWork>(result, type, getRank());
  }

  // `t`'s device address, the mapping (if the side made one) given back with `use`; false, with why,
  // where it cannot be had.
  bool address(const at::Tensor& t, std::uint64_t* addr, DeviceUse* use, std::string* why) {
    bool mapped = false;
    if (!side_->address(t, addr, &mapped, why)) return false;
    if (mapped) use->mapped.push_back(*addr);
    return true;
  }

  // The works a call started before one was refused: they complete on every rank (the Work made of
  // them here keeps what they use until they have, device copies included), and the call fails.
  void started(std::vector<smddp_work*> ws, std::vector<at::Tensor>& tensors, c10d::OpType type, const char* name,
               milliseconds timeout, std::unique_ptr<DeviceUse> use) {
    auto w = c10::make_intrusive<Work>(tb_, std::move(ws), tensors, type, name, timeout_of(timeout), getRank(),
                                       std::move(use));
    (void)w;
  }

  // After the group took a device all-reduce while the route is unknown: where this job's device
  // all-reduces go, asked once it is decided (the group's first device collective decides it).
  void learn_device_route(const std::vector<at::Tensor>& tensors) {
    if (route_.load(std::memory_order_acquire) != kUnknown || !device_ok_ || tensors.empty() ||
        !tensors[0].defined() || !side_->takes(tensors[0]))
      return;
    py::gil_scoped_acquire gil;
    const std::string r = group_.attr("_native_device_route")().cast<std::string>();
    if (!r.empty()) route_.store(r == "engine" ? kEngine : kGroup, std::memory_order_release);
  }

  static bool all_plain(const std::vector<at::Tensor>& ts) {
    if (ts.empty()) return false;
    for (const at::Tensor& t : ts)
      if (!plain(t)) return false;
    return true;
  }

  static smddp_collective collective(std::uint8_t kind, const at::Tensor& in, const at::Tensor& out,
                                     std::uint8_t op) {
    smddp_collective c{};
    c.kind = kind;
    c.dtype = dtype_code(in.scalar_type());
    c.op = op;
    c.src = in.data_ptr();
    c.dst = out.data_ptr();
    c.count = static_cast<std::uint64_t>(in.numel());
    return c;
  }

  milliseconds timeout_of(milliseconds t) const { return t > milliseconds(0) ? t : timeout_; }

  // Starts `cs` on the table; null, with nothing sent, where the table refuses the first (the Python
  // group then takes the call, and says why as it does). A blocking call (torch waits for its Work at
  // once, in this thread) is waited for here, and its error raised from the call.
  c10d_work_t run(const std::vector<smddp_collective>& cs, std::vector<at::Tensor>& result, c10d::OpType type,
                  const char* name, milliseconds timeout, bool async) {
    const smddp_capi* t = tb_->t;
    std::vector<smddp_work*> ws;
    ws.reserve(cs.size());
    for (const smddp_collective& c : cs) {
      smddp_work* w = nullptr;
      char why[512];
      const int st = t->start(t->ctx, &c, &w, why, sizeof why);
      if (st != SMDDP_OK) {
        if (ws.empty()) return {};
        started(std::move(ws), result, type, name, timeout, nullptr);
        throw Failure(st == SMDDP_CLOSED ? "CollectiveError" : "SmddpError", why);
      }
      ws.push_back(w);
    }
    seq_.fetch_add(1, std::memory_order_relaxed);
    auto work = c10::make_intrusive<Work>(tb_, std::move(ws), result, type, name, timeout_of(timeout), getRank());
    if (async) return work;
    work->wait(milliseconds(0));
    return c10::make_intrusive<DoneWork>(result, type, getRank());
  }

  template <typename... Args>
  c10d_work_t delegate(const char* method, Args&... args) {
    seq_.fetch_add(1, std::memory_order_relaxed);
    py::gil_scoped_acquire gil;
    py::object r = group_.attr(method)(args...);
    if (r.is_none()) return c10::make_intrusive<DoneWork>(std::vector<at::Tensor>{}, c10d::OpType::UNKNOWN, getRank());
    auto w = r.cast<c10::intrusive_ptr<c10d::Work>>();
    return c10::make_intrusive<PyWork>(std::move(w), std::move(r));
  }

  static constexpr int kUnknown = 0, kEngine = 1, kGroup = 2;

  std::shared_ptr<Table> tb_;
  py::object capsule_;
  py::object group_;
  milliseconds timeout_;
  bool direct_;
  long long piece_bytes_;
  std::shared_ptr<DeviceSide> side_;
  bool device_ok_ = false;
  std::atomic<int> route_{kUnknown};  // where device all-reduces go: learnt once (learn_device_route)
  std::atomic<uint64_t> seq_{0};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "smddp's torch.distributed backend in C++ (smddp/torch/c10d.cpp)";
  m.attr("CAPI_VERSION") = SMDDP_CAPI_VERSION;
  py::class_<Backend, c10d::Backend, c10::intrusive_ptr<Backend>>(m, "Backend")
      .def(py::init<py::object, py::object, int, int, long long, bool, std::string, long long,
                    const std::map<std::string, std::uintptr_t>&>(),
           py::arg("capsule"), py::arg("group"), py::arg("rank"), py::arg("size"), py::arg("timeout_ms"),
           py::arg("direct"), py::arg("timeout_prefix"), py::arg("piece_bytes"), py::arg("doubles"))
      .def_property_readonly("group", &Backend::group);
  // How many device all-reduces this process's Backends ran on the engine's device route (tests ask).
  m.def("device_calls", [] {
    std::map<std::string, long long> by_kind;
    const char* names[] = {"all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"};
    for (int k = 0; k < 4; k++) by_kind[names[k]] = g_device_calls[k].load(std::memory_order_relaxed);
    return by_kind;
  });
  // A Failure reaches Python as its smddp.errors class (the Python backend's errors, word for word).
  static py::handle errors = py::module_::import("smddp.errors").release();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Failure& e) {
      py::object cls = py::getattr(errors, e.cls.c_str(), py::getattr(errors, "CollectiveError"));
      py::object err = cls(e.what());
      PyErr_SetObject(cls.ptr(), err.ptr());
    }
  });
}
