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

// why (`w`) into the caller's buffer of `why_len` bytes, cut and NUL-terminated.
void say(const std::string& w, char* why, std::size_t why_len) {
  if (why == nullptr || why_len == 0) return;
  const std::size_t n = w.size() < why_len - 1 ? w.size() : why_len - 1;
  std::memcpy(why, w.data(), n);
  why[n] = '\0';
}

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
  say(w, why, why_len);
  return r;
}

int c_start_device(void* ctx, const smddp_collective* c, const smddp_device_call* d, smddp_work** out, char* why,
                   std::size_t why_len) {
  if (out != nullptr) *out = nullptr;
  std::string w;
  int r;
  if (ctx == nullptr || c == nullptr || d == nullptr || out == nullptr) {
    w = "start_device: a null table, collective, device call or out";
    r = SMDDP_INVALID;
  } else {
    r = of(ctx)->start_device(*c, *d, out, &w);
  }
  say(w, why, why_len);
  return r;
}

int c_device_order(smddp_work* work, std::uintptr_t stream, char* why, std::size_t why_len) {
  std::string w = "device_order: a null work";
  const int r = work == nullptr ? SMDDP_INVALID : work->owner->device_order(work, stream, &w);
  say(r == SMDDP_OK ? std::string() : w, why, why_len);
  return r;
}

int c_device_query(smddp_work* w) { return w == nullptr ? SMDDP_INVALID : w->owner->device_query(w); }

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

// "an all-reduce", "a broadcast": a kind's name (kind_name) with its article.
std::string article(const std::string& kind) { return (kind[0] == 'a' ? "an " : "a ") + kind; }

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
  table_.start_device = c_start_device;
  table_.device_order = c_device_order;
  table_.device_query = c_device_query;
}

void NativeWorks::use_device(DevicePath* path) {
  std::lock_guard<std::mutex> lock(mu_);
  if (path_ == nullptr) path_ = path;
}

namespace {

// Whether rank `rank` sends data for `c` (a barrier: none; a broadcast: its root alone).
bool sends_data(const smddp_collective& c, std::uint32_t rank) {
  return c.kind == SMDDP_BROADCAST ? c.root == rank : c.kind != SMDDP_BARRIER;
}

// A SUBMIT's aux: a broadcast's root, else how many pieces an all-reduce goes in (0: one).
std::uint32_t aux_of(const smddp_collective& c, std::uint32_t pieces) {
  return c.kind == SMDDP_BROADCAST ? c.root : pieces > 1 ? pieces : 0;
}

// Where a piece's result goes, into host memory (start) or device memory (start_device) alike:
// `nbytes` of its result (`result_bytes` in all) from `src_offset`, to byte `dst_offset` of the
// collective's destination. `first`, `bytes`: the piece's first element and its size.
struct Landing {
  std::uint64_t dst_offset = 0, nbytes = 0, src_offset = 0, result_bytes = 0;
};
Landing landing(const smddp_collective& c, std::uint64_t first, std::uint64_t bytes, std::size_t isz,
                std::uint64_t world, std::uint32_t rank) {
  switch (c.kind) {
    case SMDDP_ALLREDUCE: return {first * isz, bytes, 0, bytes};  // (its piece, in place)
    case SMDDP_BROADCAST: return {0, bytes, 0, bytes};
    case SMDDP_ALLGATHER: return {0, bytes * world, 0, bytes * world};  // (the W inputs)
    case SMDDP_REDUCE_SCATTER: return {0, bytes / world, rank * (bytes / world), bytes};  // (this rank's block)
    default: return {};                                                                  // (a barrier)
  }
}

// Why `c` cannot start (empty: it can): its kind, dtype, op, count, root and buffers checked as
// smddp's Python calls check them, in their words.
std::string refusal(const smddp_collective& c, const NativeConfig& cfg) {
  const char* what = kind_name(c.kind);
  if (what == nullptr) return "start: no collective kind " + num(c.kind);
  const std::size_t isz = dtype_size(c.dtype);
  if (isz == 0) return std::string(what) + ": no dtype " + num(c.dtype);
  const bool reduces = c.kind == SMDDP_ALLREDUCE || c.kind == SMDDP_REDUCE_SCATTER;
  if (reduces ? c.op < SMDDP_SUM || c.op > SMDDP_MAX : c.op != 0)
    return std::string(what) + ": no reduction op " + num(c.op) + " for it";
  const std::uint64_t w = cfg.world, n = c.count;
  if (n > kMaxDataPayload / isz / (c.kind == SMDDP_ALLGATHER ? w : 1))
    return std::string(what) + ": " + num(n) + " elements are more than one collective carries";
  if (c.kind == SMDDP_BROADCAST ? c.root >= w : c.root != 0)
    return c.kind == SMDDP_BROADCAST ? "root " + num(c.root) + " is out of range for " + num(w) + " ranks"
                                     : std::string(what) + ": a root applies to a broadcast only";
  if (c.kind == SMDDP_REDUCE_SCATTER && n % w != 0)
    return "reduce_scatter: " + num(n) + " elements cannot be split evenly among " + num(w) + " ranks";
  if (c.kind == SMDDP_BARRIER ? n != 0 || c.src != nullptr || c.dst != nullptr
                              : n > 0 && ((sends_data(c, cfg.rank) && c.src == nullptr) || c.dst == nullptr))
    return std::string(what) + ": a buffer is missing (or a barrier was given one)";
  if (c.kind == SMDDP_BARRIER && c.dtype != SMDDP_UINT8)  // (its fingerprint is the Python calls')
    return "barrier: its dtype is uint8 (" + num(SMDDP_UINT8) + "), not " + num(c.dtype);
  return {};
}

// The daemon left this worker's submit ring full for the whole timeout: as the Python calls'
// _daemon_lost says it (a PeerLostError).
std::string daemon_lost(const NativeConfig& cfg) {
  return "rank " + num(cfg.rank) + ": lost the node daemon: it did not read this worker's ring for " +
         seconds(cfg.timeout_ns) + "s (frozen or gone)";
}

// How many pieces an all-reduce of `n` elements of `isz` bytes goes in: more than the job's piece
// cut as the Python calls cut it (the shards' near-equal cut, layout.h), each naming how many there
// are (aux); every other kind in one.
std::uint32_t piece_count(const smddp_collective& c, std::size_t isz, std::uint64_t piece_bytes) {
  const std::uint64_t n = c.count;
  if (c.kind != SMDDP_ALLREDUCE || piece_bytes == 0 || n * isz <= piece_bytes) return 1;
  const std::uint64_t want = (n * isz + piece_bytes - 1) / piece_bytes;
  return static_cast<std::uint32_t>(want < n ? want : n);  // (n * isz is at most kMaxDataPayload)
}

// A SUBMIT of `count` elements of `c` from `rank` (its seq, shard and offset are the channel's to give).
Header submit_of(const smddp_collective& c, std::uint32_t rank, std::uint32_t aux, std::uint64_t count) {
  Header h;
  h.type = Msg::kSubmit;
  h.kind = c.kind;
  h.dtype = c.dtype;
  h.op = c.op;
  h.sender = rank;
  h.aux = aux;
  h.count = count;
  return h;
}

// Pieces [i, end) of `w` never go: done as they are (nothing of them is out).
void never_out(smddp_work* w, std::size_t i) {
  std::lock_guard<std::mutex> lock(w->mu);
  for (std::size_t j = i; j < w->pieces.size(); j++) w->pieces[j].done = true;
  w->left -= w->pieces.size() - i;
}

}  // namespace

void NativeWorks::went_live(smddp_work* w) {
  bool closed;
  std::string cls, text;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed = closed_;
    cls = closed_class_;
    text = closed_why_;
    live_.insert(w);
  }
  if (closed) fail(w, cls, text);
}

int NativeWorks::not_started(smddp_work* w, std::size_t i, const std::string& error_class, const std::string& text,
                             bool client, bool closed, std::string* why) {
  if (client) note_failure(error_class, text);
  if (i == 0) {  // nothing went: no work, the caller is told
    delete w;
    *why = text;
    return closed ? SMDDP_CLOSED : SMDDP_FAILED;
  }
  never_out(w, i);
  fail(w, error_class, text);
  return SMDDP_OK;
}

int NativeWorks::start(const smddp_collective& c, smddp_work** out, std::string* why) {
  *why = refusal(c, cfg_);
  if (!why->empty()) return SMDDP_INVALID;
  const std::size_t isz = dtype_size(c.dtype);
  const std::uint64_t w = cfg_.world, n = c.count;
  const bool sends = sends_data(c, cfg_.rank);
  const std::uint32_t k = piece_count(c, isz, cfg_.piece_bytes);
  const std::uint32_t aux = aux_of(c, k);
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
    h = submit_of(c, cfg_.rank, aux, r.end - r.start);
    const Landing l = landing(c, r.start, h.count * isz, isz, w, cfg_.rank);
    p.out = Delivery{l.nbytes == 0 ? nullptr : dst + l.dst_offset, l.nbytes, l.src_offset, l.result_bytes};
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
  for (std::size_t i = 0; i < work->pieces.size(); i++) {
    smddp_work::Piece& p = work->pieces[i];
    if (i > 0 && status(work) != SMDDP_PENDING) {  // (failed meanwhile, with the client: no more go)
      never_out(work, i);
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
      if (i == 0) went_live(work);
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
        text = daemon_lost(cfg_);
        break;
      default: break;
    }
    const int r = not_started(work, i, cls, text, client, end == FastEnd::kHeld, why);
    if (i == 0) return r;
    break;
  }
  *out = work;
  return SMDDP_OK;
}

int NativeWorks::start_device(const smddp_collective& c, const smddp_device_call& d, smddp_work** out,
                              std::string* why) {
  if (c.kind == SMDDP_BARRIER) {
    *why = "barrier: it has no buffers, and so no device route (start() runs it)";
    return SMDDP_INVALID;
  }
  *why = refusal(c, cfg_);
  if (!why->empty()) return SMDDP_INVALID;
  const std::string what = kind_name(c.kind);  // (refusal() took every kind that has no name)
  if (d.device < 0 || (d.flags & ~SMDDP_DEVICE_IN_LINE) != 0) {
    *why = what + ": device " + std::to_string(d.device) + " with flags " + num(d.flags) +
           " (a device ordinal, and SMDDP_DEVICE_IN_LINE or 0)";
    return SMDDP_INVALID;
  }
  DevicePath* path;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      *why = closed_why_;
      return SMDDP_CLOSED;
    }
    path = path_;
  }
  if (path == nullptr) {
    *why = what + ": this client's device path is not started (its first device collective starts it, "
           "or Client.device_runtime())";
    return SMDDP_INVALID;
  }
  const std::size_t isz = dtype_size(c.dtype);
  const std::uint64_t n = c.count;
  if (n == 0) {
    // Nothing to copy: the host's empty SUBMIT, every rank's alike (a device work with no copies).
    smddp_collective none = c;
    none.src = nullptr;
    none.dst = nullptr;
    const int r = start(none, out, why);
    if (r == SMDDP_OK) (*out)->device = d.device;
    return r;
  }
  const std::uint32_t k = piece_count(c, isz, cfg_.piece_bytes);  // (every kind but an all-reduce: 1)
  const bool in_line = (d.flags & SMDDP_DEVICE_IN_LINE) != 0;
  if (in_line && k > 1) {
    *why = what + ": in line on the caller's stream, but " + num(n * isz) + " bytes go in " + num(k) +
           " pieces of the job's " + num(cfg_.piece_bytes) + " (in line is for one piece)";
    return SMDDP_INVALID;
  }
  const std::string on = "cuda:" + std::to_string(d.device);
  bool capturing = false;
  cuda::Result cr = path->capturing(d.device, d.stream, &capturing);
  if (cr != cuda::kSuccess) {
    *why = what + " on " + on + ": " + path->driver().describe(cr, "cuStreamIsCapturing");
    return SMDDP_INVALID;
  }
  if (capturing) {
    char b[40];
    std::snprintf(b, sizeof b, "%#llx", static_cast<unsigned long long>(d.stream));
    *why = std::string("a device collective on stream ") + b + " of " + on +
           ", which is capturing a CUDA graph: smddp's collectives cannot be captured (their copies are waited "
           "for by the host); issue it outside torch.cuda.graph() / stream capture";
    return SMDDP_INVALID;
  }
  // Where its copies run: in line on the caller's stream, or on the engine's lanes after the point of
  // the caller's stream at this call (`mark`), which every piece's copies wait for.
  std::uintptr_t lane_in = d.stream, lane_back = d.stream;
  std::shared_ptr<DeviceMark> mark;
  if (!in_line) {
    std::string w;
    if (!path->lanes(d.device, &lane_in, &lane_back, &w) || !(mark = path->mark(d.device, d.stream, &w))) {
      *why = what + " on " + on + ": " + w;
      return SMDDP_FAILED;  // (nothing enqueued, nothing sent)
    }
  }
  const std::uint32_t aux = aux_of(c, k);
  // A broadcast's other ranks send nothing: no input slot, and their copy in only an event (the point
  // of the stream their SUBMIT waits for, as the GPU step's broadcasts have).
  const bool sends = sends_data(c, cfg_.rank);
  auto* work = new smddp_work();
  work->owner = shared_from_this();
  work->device = d.device;
  work->pieces.resize(k);
  work->left = k;
  const auto src = reinterpret_cast<std::uintptr_t>(c.src);
  const auto dst = reinterpret_cast<std::uintptr_t>(c.dst);
  // Each piece in order: its slot, the copy into it enqueued, its number reserved, its way back made
  // (the copy back into `dst`, by whoever takes its DONE), and its SUBMIT handed to the engine to give
  // the moment the copy lands. One that cannot start fails the work (the client too from the second
  // on: the other ranks send that piece).
  for (std::uint32_t i = 0; i < k; i++) {
    smddp_work::Piece& p = work->pieces[i];
    if (i > 0 && status(work) != SMDDP_PENDING) {
      never_out(work, i);
      break;
    }
    const Range r = shard_range(n, k, i);
    const std::uint64_t bytes = (r.end - r.start) * isz;
    Slot slot{kNoSegment, 0, 0};
    std::string cls, text;
    bool client = true;
    if (sends) {
      std::shared_ptr<Segment> fresh;
      std::string arena_why;
      const RingWait got =
          ch_->alloc(*arena_, bytes, cfg_.rank, cfg_.timeout_ns, cfg_.spin_ns, &slot, &fresh, &arena_why);
      if (!arena_why.empty()) {
        cls = "OSError";
        text = arena_why;
        client = false;
      } else if (got == RingWait::kTimeout) {
        cls = "PeerLostError";
        text = daemon_lost(cfg_);
      } else if (got != RingWait::kReady) {
        cls = "ProtocolError";
        text = ch_->why();
      }
    }
    std::shared_ptr<DeviceIn> in;
    if (cls.empty()) {
      const std::shared_ptr<Segment> seg = sends ? arena_->segment(slot.segment) : nullptr;
      std::string why_not = "the arena lost segment " + num(slot.segment);
      if (seg || !sends)
        in = path->copy_in(d.device, lane_in, mark.get(), seg, slot.offset, sends ? src + r.start * isz : 0,
                           sends ? bytes : 0, &why_not);
      if (!in) {
        if (sends) (void)arena_->free(slot);
        cls = "DeviceError";
        text = "the copy-in of " + article(what) + " on " + on + " could not be enqueued: " + why_not;
        client = i > 0;
      }
    }
    if (!cls.empty()) {
      const int answer = not_started(work, i, cls, text, client, false, why);
      if (i == 0) return answer;
      break;
    }
    Header& h = p.submit;
    h = submit_of(c, cfg_.rank, aux, r.end - r.start);
    h.seq = ch_->reserve_fast();
    h.shard = slot.segment;
    h.offset = slot.offset;
    const Landing l = landing(c, r.start, bytes, isz, cfg_.world, cfg_.rank);
    auto back = std::make_shared<DeviceOut>(path, d.device, lane_back, mark,
                                            std::vector<DeviceOut::Part>{{dst + l.dst_offset, l.src_offset, l.nbytes}},
                                            0, DeviceOut::Then{});
    {
      std::lock_guard<std::mutex> lock(work->mu);
      p.first = r.start;
      p.slot = slot;
      p.in = in;
      p.back = back;
      p.out = Delivery{};
      p.out.result_bytes = l.result_bytes;
      p.out.hold = true;
      p.out.sink = back;
      p.started = true;
    }
    if (i == 0) went_live(work);
    if (!path->give_when(h, in, cfg_.timeout_ns, cfg_.spin_ns)) {
      // The path has stopped (the client is shutting down): this SUBMIT never goes, nor any after it.
      never_out(work, i + 1);
      fail(work, "NotInitializedError", "smddp has been shut down");
      break;
    }
  }
  *out = work;
  return SMDDP_OK;
}

int NativeWorks::device_order(smddp_work* w, std::uintptr_t stream, std::string* why) {
  std::vector<std::shared_ptr<DeviceOut>> backs;
  {
    std::lock_guard<std::mutex> lock(w->mu);
    if (w->device < 0 || w->state != SMDDP_OK) {
      *why = w->device < 0 ? "device_order: a host work" : "device_order: a work that has not completed";
      return SMDDP_INVALID;
    }
    for (const smddp_work::Piece& p : w->pieces)
      if (p.back) backs.push_back(p.back);
  }
  for (const auto& b : backs) {
    const cuda::Result r = b->order(stream);
    if (r != cuda::kSuccess) {
      std::lock_guard<std::mutex> lock(mu_);
      *why = "ordering a stream of cuda:" + std::to_string(w->device) + " after the copy back: " +
             (path_ != nullptr ? path_->driver().describe(r, "cuStreamWaitEvent") : std::string("error"));
      return SMDDP_FAILED;
    }
  }
  return SMDDP_OK;
}

int NativeWorks::device_query(smddp_work* w) {
  std::vector<std::shared_ptr<DeviceIn>> ins;
  std::vector<std::shared_ptr<DeviceOut>> backs;
  {
    std::lock_guard<std::mutex> lock(w->mu);
    if (w->device < 0) return SMDDP_INVALID;
    if (w->state == SMDDP_PENDING) return SMDDP_PENDING;  // (a copy back may still be enqueued)
    for (const smddp_work::Piece& p : w->pieces) {
      if (p.in) ins.push_back(p.in);
      if (p.back) backs.push_back(p.back);
    }
  }
  int answer = SMDDP_OK;
  for (const auto& in : ins) {
    const cuda::Result r = in->query();
    if (r == cuda::kNotReady) answer = answer == SMDDP_OK ? SMDDP_PENDING : answer;
    else if (r != cuda::kSuccess) return SMDDP_FAILED;
  }
  for (const auto& b : backs) {
    const cuda::Result r = b->query();
    if (r == cuda::kNotReady) answer = answer == SMDDP_OK ? SMDDP_PENDING : answer;
    else if (r != cuda::kSuccess) return SMDDP_FAILED;
  }
  return answer;
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
    Located here;
    const FastEnd end = ch_->finish(*arena_, p.slot, p.submit, p.out, cfg_.batch_bytes, left_ns(t0, budget),
                                    cfg_.spin_ns, &here);
    if (end == FastEnd::kDone) {
      // (finish freed its slot; a device piece's copy back was enqueued here, or `here.why` says why not)
      piece_done(w, i, false, here.why.empty() ? "" : "DeviceError", here.why);
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
    collect(w->pieces[i], w->pieces[i].out, [held, i](const char* error_class, const std::string& why) {
      held->owner->piece_done(held.get(), i, true, why.empty() ? "" : error_class, why);
    });
  }
  return SMDDP_OK;
}

void NativeWorks::collect(const smddp_work::Piece& p, const Delivery& out,
                          std::function<void(const char*, const std::string&)> hook) {
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
    for (std::size_t i = 0; i < w->pieces.size(); i++) {
      if (!w->pieces[i].started || w->pieces[i].done) continue;
      out.push_back(i);
      // A device piece's copy back is not enqueued from now on (a wait's finish() taking its DONE
      // right now included): its result slot goes back at once.
      if (w->pieces[i].back) w->pieces[i].back->drop();
    }
  }
  w->cv.notify_all();
  // Nothing more into the caller's memory: each piece still out is collected with no destination
  // (its DONE, if it comes, is taken and RELEASEd, and its slot freed through the hook).
  for (const std::size_t i : out) {
    const smddp_work::Piece& p = w->pieces[i];
    std::shared_ptr<NativeWorks> self = shared_from_this();
    const Slot slot = p.slot;
    collect(p, Delivery{nullptr, 0, 0, p.out.result_bytes}, [self, slot](const char*, const std::string&) {
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
