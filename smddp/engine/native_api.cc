// The engine's C function table over a client's channel (native_api.h).
#include "native_api.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <utility>

#include "layout.h"
#include "reduce.h"
#include "wire.h"

namespace smddp {

// capi.h is a C header of its own (a front end includes it alone), so it names the wire's codes
// itself: bound here to the one definition (wire.h, generated from smddp.proto).
static_assert(SMDDP_ALLREDUCE == static_cast<int>(Kind::kAllreduce) &&
                  SMDDP_BROADCAST == static_cast<int>(Kind::kBroadcast) &&
                  SMDDP_ALLGATHER == static_cast<int>(Kind::kAllgather) &&
                  SMDDP_REDUCE_SCATTER == static_cast<int>(Kind::kReduceScatter) &&
                  SMDDP_BARRIER == static_cast<int>(Kind::kBarrier),
              "capi.h's kinds are the wire's");
static_assert(SMDDP_UINT8 == static_cast<int>(DType::kUint8) && SMDDP_INT32 == static_cast<int>(DType::kInt32) &&
                  SMDDP_INT64 == static_cast<int>(DType::kInt64) &&
                  SMDDP_FLOAT16 == static_cast<int>(DType::kFloat16) &&
                  SMDDP_BFLOAT16 == static_cast<int>(DType::kBfloat16) &&
                  SMDDP_FLOAT32 == static_cast<int>(DType::kFloat32) &&
                  SMDDP_FLOAT64 == static_cast<int>(DType::kFloat64),
              "capi.h's dtypes are the wire's");
static_assert(SMDDP_SUM == static_cast<int>(ReduceOp::kSum) && SMDDP_AVG == static_cast<int>(ReduceOp::kAvg) &&
                  SMDDP_MIN == static_cast<int>(ReduceOp::kMin) && SMDDP_MAX == static_cast<int>(ReduceOp::kMax),
              "capi.h's ops are the wire's");

namespace {

using Clock = std::chrono::steady_clock;

// The C entry points: the table's ctx is the NativeWorks.
NativeWorks* of(void* ctx) { return static_cast<NativeWorks*>(ctx); }

int c_start(void* ctx, const smddp_collective* c, smddp_work** out, char* why, std::size_t why_len) {
  if (out != nullptr) *out = nullptr;
  std::string w;
  int r;
  if (ctx == nullptr || c == nullptr || out == nullptr) {
    w = "start: a null table, collective or out";
    r = SMDDP_INVALID;
  } else {
    r = of(ctx)->start(*c, out, &w);
  }
  if (why != nullptr && why_len > 0) {
    const std::size_t n = w.size() < why_len - 1 ? w.size() : why_len - 1;
    std::memcpy(why, w.data(), n);
    why[n] = '\0';
  }
  return r;
}

int c_wait(smddp_work* w, double timeout_s) { return w == nullptr ? SMDDP_INVALID : w->owner->wait(w, timeout_s); }
int c_status(smddp_work* w) { return w == nullptr ? SMDDP_INVALID : w->owner->status(w); }
int c_on_done(smddp_work* w, smddp_done_fn fn, void* arg) {
  return w == nullptr || fn == nullptr ? SMDDP_INVALID : w->owner->on_done(w, fn, arg);
}
// Set once, before the state leaves PENDING, and never again: readable without the lock once the
// caller has seen FAILED (through status, wait or its callback).
const char* c_why(smddp_work* w) { return w == nullptr ? "" : w->why.c_str(); }
const char* c_error_class(smddp_work* w) { return w == nullptr ? "" : w->error_class.c_str(); }
void c_release(smddp_work* w) {
  if (w != nullptr) NativeWorks::release(w);
}
int c_abandon(smddp_work* w, const char* error_class, const char* why) {
  if (w == nullptr || error_class == nullptr || why == nullptr || *why == '\0') return SMDDP_INVALID;
  return w->owner->abandon(w, error_class, why);
}

std::string num(std::uint64_t v) { return std::to_string(v); }

// Seconds as Python's {:g} writes them.
std::string seconds(std::int64_t ns) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", static_cast<double>(ns) / 1e9);
  return b;
}

const char* kind_name(std::uint8_t kind) {
  switch (static_cast<Kind>(kind)) {
    case Kind::kAllreduce: return "all-reduce";
    case Kind::kBroadcast: return "broadcast";
    case Kind::kAllgather: return "all-gather";
    case Kind::kReduceScatter: return "reduce-scatter";
    case Kind::kBarrier: return "barrier";
  }
  return nullptr;
}

// The wait's budget: `timeout_s` (< 0: the job's).
std::int64_t budget_ns(double timeout_s, std::int64_t job_ns) {
  if (!(timeout_s >= 0)) return job_ns;
  const double ns = timeout_s * 1e9;
  return ns > 9e18 ? INT64_MAX : static_cast<std::int64_t>(ns);
}

std::int64_t left_ns(Clock::time_point t0, std::int64_t budget) {
  const std::int64_t spent = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  return budget > spent ? budget - spent : 0;
}

constexpr int kEnough = -1;  // settle(): what the caller waited for came, the work still pending

// Waits on `w` until it is no longer pending or `enough()` holds (checked under its lock), within
// `budget` from `t0`: its state, or kEnough (its state PENDING when the time ran out).
template <typename Enough>
int settle(smddp_work* w, Clock::time_point t0, std::int64_t budget, Enough enough) {
  std::unique_lock<std::mutex> lock(w->mu);
  for (;;) {
    if (w->state != SMDDP_PENDING) return w->state;
    if (enough()) return kEnough;
    const std::int64_t left = left_ns(t0, budget);
    if (left <= 0) return w->state;
    w->cv.wait_for(lock, std::chrono::nanoseconds(left));
  }
}

}  // namespace

NativeWorks::NativeWorks(WorkerChannel* ch, Arena* arena, const NativeConfig& cfg) : ch_(ch), arena_(arena), cfg_(cfg) {
  table_.version = SMDDP_CAPI_VERSION;
  table_.size = sizeof(smddp_capi);
  table_.ctx = this;
  table_.rank = cfg.rank;
  table_.world = cfg.world;
  table_.start = c_start;
  table_.wait = c_wait;
  table_.status = c_status;
  table_.on_done = c_on_done;
  table_.why = c_why;
  table_.error_class = c_error_class;
  table_.release = c_release;
  table_.abandon = c_abandon;
}

int NativeWorks::start(const smddp_collective& c, smddp_work** out, std::string* why) {
  const char* what = kind_name(c.kind);
  if (what == nullptr) {
    *why = "start: no collective kind " + num(c.kind);
    return SMDDP_INVALID;
  }
  const std::size_t isz = dtype_size(c.dtype);
  if (isz == 0) {
    *why = std::string(what) + ": no dtype " + num(c.dtype);
    return SMDDP_INVALID;
  }
  const bool reduces = c.kind == SMDDP_ALLREDUCE || c.kind == SMDDP_REDUCE_SCATTER;
  if (reduces ? c.op < SMDDP_SUM || c.op > SMDDP_MAX : c.op != 0) {
    *why = std::string(what) + ": no reduction op " + num(c.op) + " for it";
    return SMDDP_INVALID;
  }
  const std::uint64_t w = cfg_.world, n = c.count;
  if (n > kMaxDataPayload / isz / (c.kind == SMDDP_ALLGATHER ? w : 1)) {
    *why = std::string(what) + ": " + num(n) + " elements are more than one collective carries";
    return SMDDP_INVALID;
  }
  const bool root = c.kind == SMDDP_BROADCAST && c.root == cfg_.rank;
  if (c.kind == SMDDP_BROADCAST ? c.root >= w : c.root != 0) {
    *why = c.kind == SMDDP_BROADCAST ? "root " + num(c.root) + " is out of range for " + num(w) + " ranks"
                                     : std::string(what) + ": a root applies to a broadcast only";
    return SMDDP_INVALID;
  }
  if (c.kind == SMDDP_REDUCE_SCATTER && n % w != 0) {
    *why = "reduce_scatter: " + num(n) + " elements cannot be split evenly among " + num(w) + " ranks";
    return SMDDP_INVALID;
  }
  const bool sends = c.kind == SMDDP_BARRIER ? false : c.kind == SMDDP_BROADCAST ? root : true;
  if (c.kind == SMDDP_BARRIER ? n != 0 || c.src != nullptr || c.dst != nullptr
                              : n > 0 && ((sends && c.src == nullptr) || c.dst == nullptr)) {
    *why = std::string(what) + ": a buffer is missing (or a barrier was given one)";
    return SMDDP_INVALID;
  }
  if (c.kind == SMDDP_BARRIER && c.dtype != SMDDP_UINT8) {  // (its fingerprint is the Python calls')
    *why = "barrier: its dtype is uint8 (" + num(SMDDP_UINT8) + "), not " + num(c.dtype);
    return SMDDP_INVALID;
  }
  // The pieces: an all-reduce of more than the job's piece cut as the Python calls cut it (the
  // shards' near-equal cut, layout.h), each naming how many there are (aux).
  std::uint32_t k = 1;
  if (c.kind == SMDDP_ALLREDUCE && cfg_.piece_bytes > 0 && n * isz > cfg_.piece_bytes) {
    const std::uint64_t want = (n * isz + cfg_.piece_bytes - 1) / cfg_.piece_bytes;
    k = static_cast<std::uint32_t>(want < n ? want : n);  // (n * isz is at most kMaxDataPayload)
  }
  const std::uint32_t aux = c.kind == SMDDP_BROADCAST ? c.root : k > 1 ? k : 0;
  auto* work = new smddp_work();
  work->owner = shared_from_this();
  const auto* src = static_cast<const std::uint8_t*>(c.src);
  auto* dst = static_cast<std::uint8_t*>(c.dst);
  work->pieces.resize(k);
  for (std::uint32_t j = 0; j < k; j++) {
    const Range r = shard_range(n, k, j);
    smddp_work::Piece& p = work->pieces[j];
    p.first = r.start;
    Header& h = p.submit;
    h.type = Msg::kSubmit;
    h.kind = c.kind;
    h.dtype = c.dtype;
    h.op = c.op;
    h.sender = cfg_.rank;
    h.aux = aux;
    h.count = r.end - r.start;
    const std::uint64_t bytes = h.count * isz;
    switch (c.kind) {
      case SMDDP_ALLREDUCE: p.out = Delivery{dst + r.start * isz, bytes, 0, bytes}; break;
      case SMDDP_BROADCAST: p.out = Delivery{dst, bytes, 0, bytes}; break;
      case SMDDP_ALLGATHER: p.out = Delivery{dst, bytes * w, 0, bytes * w}; break;
      case SMDDP_REDUCE_SCATTER: p.out = Delivery{dst, bytes / w, cfg_.rank * (bytes / w), bytes}; break;
      default: p.out = Delivery{}; break;  // (a barrier)
    }
    if (p.out.nbytes == 0) p.out.dst = nullptr;
  }
  work->left = work->pieces.size();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      delete work;
      *why = closed_why_;
      return SMDDP_CLOSED;
    }
  }
  // Each piece started in order (its slot, its copy in, its SUBMIT: WorkerChannel::start); one that
  // cannot start fails the work, and the client where the channel says the daemon is lost or broke it.
  // Pieces [i, end) never go: done as they are (nothing of them is out).
  const auto never_out = [work](std::size_t i) {
    std::lock_guard<std::mutex> lock(work->mu);
    for (std::size_t j = i; j < work->pieces.size(); j++) work->pieces[j].done = true;
    work->left -= work->pieces.size() - i;
  };
  for (std::size_t i = 0; i < work->pieces.size(); i++) {
    smddp_work::Piece& p = work->pieces[i];
    if (i > 0 && status(work) != SMDDP_PENDING) {  // (failed meanwhile, with the client: no more go)
      never_out(i);
      break;
    }
    Source s{src == nullptr ? nullptr : src + p.first * isz, sends ? p.submit.count * isz : 0};
    Header h = p.submit;
    Slot slot;
    const FastEnd end = ch_->start(*arena_, &s, s.nbytes > 0 ? 1 : 0, &h, &slot, cfg_.timeout_ns, cfg_.spin_ns, true);
    if (end == FastEnd::kDone) {
      {
        std::lock_guard<std::mutex> lock(work->mu);
        p.submit = h;
        p.slot = slot;
        p.started = true;
      }
      if (i == 0) {
        // Live from its first SUBMIT: a failure of the client from now on fails it too.
        bool closed;
        std::string cls, text;
        {
          std::lock_guard<std::mutex> lock(mu_);
          closed = closed_;
          cls = closed_class_;
          text = closed_why_;
          live_.insert(work);
        }
        if (closed) fail(work, cls, text);
      }
      continue;
    }
    std::string cls = "ProtocolError", text = ch_->why();
    bool client = true;
    switch (end) {
      case FastEnd::kHeld:
        cls = "NotInitializedError";
        text = "smddp has been shut down";
        client = false;
        break;
      case FastEnd::kArena:
        cls = "OSError";
        client = false;
        break;
      case FastEnd::kBacklog:
        cls = "CollectiveTimeoutError";
        text = ch_->backlog_why();
        client = false;
        break;
      case FastEnd::kRingFull:
        cls = "PeerLostError";  // (as the Python calls' _daemon_lost says it)
        text = "rank " + num(cfg_.rank) + ": lost the node daemon: it did not read this worker's ring for " +
               seconds(cfg_.timeout_ns) + "s (frozen or gone)";
        break;
      default: break;
    }
    if (client) note_failure(cls, text);
    if (i == 0) {  // nothing went: no work, the caller is told
      delete work;
      *why = text;
      return end == FastEnd::kHeld ? SMDDP_CLOSED : SMDDP_FAILED;
    }
    never_out(i);
    fail(work, cls, text);
    break;
  }
  *out = work;
  return SMDDP_OK;
}

int NativeWorks::status(smddp_work* w) {
  std::lock_guard<std::mutex> lock(w->mu);
  return w->state;
}

int NativeWorks::wait(smddp_work* w, double timeout_s) {
  const Clock::time_point t0 = Clock::now();
  const std::int64_t budget = budget_ns(timeout_s, cfg_.timeout_ns);
  std::unique_lock<std::mutex> driving(w->wait_mu, std::defer_lock);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(w->mu);
      if (w->state != SMDDP_PENDING) return w->state;
    }
    if (driving.owns_lock() || driving.try_lock()) break;
    // Another thread drives its pieces: this one waits for the state.
    std::unique_lock<std::mutex> lock(w->mu);
    const std::int64_t left = left_ns(t0, budget);
    if (left <= 0) return w->state;
    w->cv.wait_for(lock, std::chrono::nanoseconds(left < 1000000 ? left : 1000000));
  }
  for (std::size_t i = 0; i < w->pieces.size(); i++) {
    smddp_work::Piece& p = w->pieces[i];
    {
      std::lock_guard<std::mutex> lock(w->mu);
      if (w->state != SMDDP_PENDING) return w->state;
      if (p.done) continue;
    }
    const FastEnd end = ch_->finish(*arena_, p.slot, p.submit, p.out, cfg_.batch_bytes, left_ns(t0, budget),
                                    cfg_.spin_ns);
    if (end == FastEnd::kDone) {
      piece_done(w, i, false, "", "");  // (finish freed its slot)
      continue;
    }
    if (end == FastEnd::kTimeout && ch_->aborted()) {
      // The channel aborted: the client is failing, and fails this work with why (fail_all) in a
      // moment; its state then, within this wait's time.
      return settle(w, t0, budget, [] { return false; });
    }
    if (end == FastEnd::kTimeout) return status(w);  // (not in time: it goes on)
    if (end == FastEnd::kGone) {
      // Collected (on_done): the taker that met its DONE completes it, and says so.
      const int got = settle(w, t0, budget, [&p] { return p.done; });
      if (got != kEnough) return got;
      continue;
    }
    note_failure("ProtocolError", ch_->why());
    fail(w, "ProtocolError", ch_->why());
    return status(w);
  }
  return status(w);
}

int NativeWorks::on_done(smddp_work* w, smddp_done_fn fn, void* arg) {
  std::vector<std::size_t> out;
  int now = SMDDP_PENDING;
  {
    std::lock_guard<std::mutex> lock(w->mu);
    if (w->fn != nullptr || w->collected) return SMDDP_INVALID;
    w->collected = true;
    if (w->state == SMDDP_PENDING) {
      w->fn = fn;
      w->arg = arg;
      for (std::size_t i = 0; i < w->pieces.size(); i++)
        if (w->pieces[i].started && !w->pieces[i].done) out.push_back(i);
    } else {
      now = w->state;
    }
  }
  if (now != SMDDP_PENDING) {
    fn(arg, w, now);  // (complete already: here, now)
    return SMDDP_OK;
  }
  // Each piece still out goes to whichever taker meets its DONE (the client's DONE thread). One the
  // channel no longer has was taken by a wait's finish() meanwhile, which completes it. The hook holds
  // a reference to the work for as long as the channel holds the hook (told, replaced or dropped).
  for (const std::size_t i : out) {
    w->refs.fetch_add(1, std::memory_order_relaxed);
    std::shared_ptr<smddp_work> held(w, unref);
    collect(w->pieces[i], w->pieces[i].out, [held, i](const std::string& why) {
      held->owner->piece_done(held.get(), i, true, why.empty() ? "" : "ProtocolError", why);
    });
  }
  return SMDDP_OK;
}

void NativeWorks::collect(const smddp_work::Piece& p, const Delivery& out,
                          std::function<void(const std::string&)> hook) {
  WorkerChannel::Collected how;
  how.submit = p.submit;
  how.out = out;
  how.batch_bytes = cfg_.batch_bytes;
  how.timeout_ns = cfg_.timeout_ns;
  how.native = std::move(hook);
  (void)ch_->collect(p.submit.seq, how);
}

void NativeWorks::piece_done(smddp_work* w, std::size_t i, bool free_slot, const std::string& error_class,
                             const std::string& why) {
  smddp_work::Piece& p = w->pieces[i];
  if (free_slot) this->free_slot(p.slot);
  if (!why.empty()) {
    note_failure(error_class, why);
    {
      std::lock_guard<std::mutex> lock(w->mu);
      if (!p.done) {
        p.done = true;
        w->left--;
      }
    }
    fail(w, error_class, why);
    return;
  }
  smddp_done_fn fn = nullptr;
  void* arg = nullptr;
  bool complete = false;
  {
    std::lock_guard<std::mutex> lock(w->mu);
    if (p.done) return;
    p.done = true;
    w->left--;
    if (w->left == 0 && w->state == SMDDP_PENDING) {
      w->state = SMDDP_OK;
      fn = w->fn;
      arg = w->arg;
      complete = true;
    }
  }
  w->cv.notify_all();
  if (!complete) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(w);
  }
  finished(w, fn, arg, SMDDP_OK);
}

void NativeWorks::free_slot(const Slot& slot) {
  if (slot.segment != kNoSegment && slot.nbytes > 0) (void)arena_->free(slot);  // (a barrier's has none)
}

void NativeWorks::fail(smddp_work* w, const std::string& error_class, const std::string& why) {
  smddp_done_fn fn = nullptr;
  void* arg = nullptr;
  std::vector<std::size_t> out;
  {
    std::lock_guard<std::mutex> lock(w->mu);
    if (w->state != SMDDP_PENDING) return;
    w->why = why;
    w->error_class = error_class;
    w->state = SMDDP_FAILED;
    fn = w->fn;
    arg = w->arg;
    for (std::size_t i = 0; i < w->pieces.size(); i++)
      if (w->pieces[i].started && !w->pieces[i].done) out.push_back(i);
  }
  w->cv.notify_all();
  // Nothing more into the caller's memory: each piece still out is collected with no destination
  // (its DONE, if it comes, is taken and RELEASEd, and its slot freed through the hook).
  for (const std::size_t i : out) {
    const smddp_work::Piece& p = w->pieces[i];
    std::shared_ptr<NativeWorks> self = shared_from_this();
    const Slot slot = p.slot;
    collect(p, Delivery{nullptr, 0, 0, p.out.result_bytes}, [self, slot](const std::string&) {
      self->free_slot(slot);
    });
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(w);
  }
  finished(w, fn, arg, SMDDP_FAILED);
}

int NativeWorks::abandon(smddp_work* w, const std::string& error_class, const std::string& why) {
  fail(w, error_class, why);  // (nothing, when it is complete or failed already)
  return status(w);
}

void NativeWorks::fail_all(const std::string& error_class, const std::string& why) {
  std::vector<smddp_work*> works;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closed_) {
      closed_ = true;
      closed_class_ = error_class;
      closed_why_ = why;
    }
    works.assign(live_.begin(), live_.end());
    // (each still holds the engine's reference: fail() lets it go, and fail() of one failed meanwhile
    // by its own wait does nothing)
    for (smddp_work* w : works) w->refs.fetch_add(1, std::memory_order_relaxed);
  }
  for (smddp_work* w : works) {
    fail(w, error_class, why);
    unref(w);
  }
}

std::size_t NativeWorks::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.size();
}

void NativeWorks::note_failure(const std::string& error_class, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_why_.empty()) return;
  failure_class_ = error_class;
  failure_why_ = why;
}

std::pair<std::string, std::string> NativeWorks::take_failure() {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_why_.empty() || failure_taken_) return {};
  failure_taken_ = true;
  return {failure_class_, failure_why_};
}

void NativeWorks::finished(smddp_work* w, smddp_done_fn fn, void* arg, int state) {
  if (fn != nullptr) fn(arg, w, state);
  unref(w);
}

void NativeWorks::unref(smddp_work* w) {
  if (w->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete w;
}

void NativeWorks::release(smddp_work* w) { unref(w); }

}  // namespace smddp
