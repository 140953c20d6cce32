// smddp's torch.distributed backend in C++: host collectives through the engine's C table, no Python a call.
//
// torch reaches this c10d::Backend as it reaches gloo or NCCL: through its dispatcher, with no GIL. The
// calls smddp runs on host memory in the ordinary case (contiguous CPU tensors of a dtype and op smddp
// carries, in a group of every rank) go straight to the engine's C table (smddp/engine/capi.h). Every
// other call, and every refusal, goes to the Python group (smddp.torch.backend.ProcessGroupSmddp) as
// the same call: its checks, messages, device path and side-group routing are the one definition of
// what the backend does, and this file only ever takes a shorter way to the same result.
//
// Memory: a Backend holds a reference to the client's table capsule and to the Python group (both let
// go with the GIL in its destructor; the capsule is kept for good while a Work still uses the table).
// A Work holds its engine works (released in its destructor) and its result tensors; while its engine
// works are armed (on_done), each callback holds a reference to the Work. A Work dropped before it
// completed hands its tensors to a callback that keeps them until the engine has written them.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
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
  Work(std::shared_ptr<Table> tb, std::vector<smddp_work*> ws, std::vector<at::Tensor> result, c10d::OpType type,
       const char* name, milliseconds timeout, int rank)
      : c10d::Work(rank, type),
        tb_(std::move(tb)),
        ws_(std::move(ws)),
        result_(std::move(result)),
        name_(name),
        timeout_(timeout) {
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
    return true;
  }

  bool isCompleted() override {
    arm();  // (polled: it must complete on its own from now on)
    for (smddp_work* w : ws_)
      if (tb_->t->status(w) == SMDDP_PENDING) return false;
    return true;
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
      f = future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
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
    if (cls.empty())
      f->markCompleted(c10::IValue(result_));
    else
      f->setError(as_future_error(cls, why));
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
  Backend(py::object capsule, py::object group, int rank, int size, long long timeout_ms, bool direct,
          std::string timeout_prefix)
      : c10d::Backend(rank, size),
        tb_(std::make_shared<Table>()),
        capsule_(std::move(capsule)),
        group_(std::move(group)),
        timeout_(timeout_ms),
        direct_(direct) {
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
    return delegate("allreduce", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                    const c10d::AllreduceCoalescedOptions& opts) override {
    if (auto w = allreduce_each(tensors, opts.reduceOp, c10d::OpType::ALLREDUCE_COALESCED, opts.timeout,
                                opts.asyncOp))
      return w;
    return delegate("allreduce_coalesced", tensors, opts);
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
    return delegate("broadcast", tensors, opts);
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
    return delegate("_allgather_base", out, in, opts);
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
    return delegate("_reduce_scatter_base", out, in, opts);
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
        // (the first ones went: they complete on every rank, and this call fails with why)
        auto started = c10::make_intrusive<Work>(tb_, std::move(ws), result, type, name, timeout_of(timeout), getRank());
        (void)started;
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

  std::shared_ptr<Table> tb_;
  py::object capsule_;
  py::object group_;
  milliseconds timeout_;
  bool direct_;
  std::atomic<uint64_t> seq_{0};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "smddp's torch.distributed backend in C++ (smddp/torch/c10d.cpp)";
  m.attr("CAPI_VERSION") = SMDDP_CAPI_VERSION;
  py::class_<Backend, c10d::Backend, c10::intrusive_ptr<Backend>>(m, "Backend")
      .def(py::init<py::object, py::object, int, int, long long, bool, std::string>(), py::arg("capsule"),
           py::arg("group"), py::arg("rank"), py::arg("size"), py::arg("timeout_ms"), py::arg("direct"),
           py::arg("timeout_prefix"))
      .def_property_readonly("group", &Backend::group);
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
