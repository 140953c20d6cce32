// The daemon's data plane for one node: a thread per worker ring, the table's rules, the kernels, DONE.
#include "local_plane.h"

#include <chrono>
#include <cstring>
#include <utility>

#include "reduce.h"
#include "reduce16.h"

namespace smddp {
namespace {

using Clock = std::chrono::steady_clock;

// How long one pop of a link thread waits before it looks at its stop flag again: remove_worker
// returns within about this much.
constexpr std::int64_t kPopSliceNs = 20'000'000;
// Completions kept for the statistics between two takes; past this the oldest go (the counters stay).
constexpr std::size_t kMaxCompletions = 1 << 16;

constexpr std::uint8_t kFloat16 = 4;
constexpr std::uint8_t kBfloat16 = 5;
constexpr std::uint8_t kOpAvg = 2;
constexpr std::uint8_t kOpMin = 3;
constexpr std::uint8_t kOpMax = 4;
// Collectives larger than this are reduced by the compute threads, smaller ones by the thread whose
// SUBMIT completed them (as the Python daemon's INLINE_BYTES).
constexpr std::uint64_t kInlineBytes = 64 << 10;

std::uint64_t s_bytes(const Spec& s) { return s.count * s.itemsize; }

std::string num(std::uint64_t v) { return std::to_string(v); }

}  // namespace

std::size_t channel_bytes() { return 2 * ring_bytes(kChannelSlots); }

struct LocalPlane::Link {
  Link(std::uint32_t l, std::uint32_t r, std::string n, std::shared_ptr<Segment> ch)
      : local(l),
        rank(r),
        name(std::move(n)),
        channel(std::move(ch)),
        submit(channel->base(), kChannelSlots, false),
        done(channel->base() + done_ring_offset(), kChannelSlots, false) {}
  std::uint32_t local;
  std::uint32_t rank;
  std::string name;
  std::shared_ptr<Segment> channel;
  RingView submit;  // popped by this link's thread only
  RingView done;    // pushed under done_mu
  std::mutex done_mu;
  std::map<std::uint32_t, std::shared_ptr<Segment>> segments;  // under the plane's mutex
  std::atomic<bool> stop{false};
  bool said_bye = false;  // under the plane's mutex
  std::thread thread;
  std::mutex join_mu;  // remove_worker and close may both join it, from two threads: one at a time

  void join() {
    stop.store(true, std::memory_order_release);
    std::lock_guard<std::mutex> g(join_mu);
    if (thread.joinable()) thread.join();
  }
};

struct LocalPlane::Op {
  std::shared_ptr<Collective> c;
  Spec spec;
  std::vector<const std::uint8_t*> inputs;     // by local rank; nullptr: no data
  std::vector<std::shared_ptr<Segment>> held;  // the input segments, mapped while the op lives
  Slot result;
  std::shared_ptr<Segment> result_seg;
  std::uint8_t* out = nullptr;
  Clock::time_point t0;
};

LocalPlane::LocalPlane(PlaneConfig cfg, Arena* results)
    : cfg_(std::move(cfg)), results_(results), table_(cfg_.topo, {cfg_.me}, cfg_.rank_names) {
  links_.resize(cfg_.topo.local_size);
  try {
    for (std::uint32_t i = 0; i < cfg_.threads; i++) pool_.emplace_back([this] { compute(); });
  } catch (...) {  // no destructor runs for a constructor that throws: stop what started
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : pool_) t.join();
    throw;
  }
}

LocalPlane::~LocalPlane() { close(); }

std::string LocalPlane::add_worker(std::uint32_t local, std::uint32_t rank, const std::string& name,
                                   std::shared_ptr<Segment> channel) {
  if (local >= links_.size()) return "local rank " + num(local) + " out of range";
  if (!channel || channel->size() < channel_bytes() || !channel->writable())
    return name + ": its channel is not a writable segment of " + num(channel_bytes()) + " bytes";
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return "the plane is closed";
  if (links_[local]) return name + " joined twice";
  links_[local] = std::make_unique<Link>(local, rank, name, std::move(channel));
  Link* link = links_[local].get();
  link->thread = std::thread([this, link] { run(link); });
  return {};
}

std::string LocalPlane::add_segment(std::uint32_t local, std::shared_ptr<Segment> seg) {
  std::lock_guard<std::mutex> lock(mu_);
  if (local >= links_.size() || !links_[local]) return "local rank " + num(local) + " has not joined";
  Link* link = links_[local].get();
  if (!link->segments.emplace(seg->id(), seg).second)
    return link->name + ": segment " + num(seg->id()) + " attached twice";
  attach_cv_.notify_all();
  return {};
}

bool LocalPlane::remove_worker(std::uint32_t local) {
  Link* link = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (local >= links_.size() || !links_[local]) return false;
    link = links_[local].get();
  }
  link->stop.store(true, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(mu_);
    attach_cv_.notify_all();  // a SUBMIT waiting for its segment gives up
  }
  link->join();
  std::lock_guard<std::mutex> lock(mu_);
  return link->said_bye;
}

void LocalPlane::run(Link* link) {
  alignas(8) std::uint8_t slot[kSlotBytes];
  for (;;) {
    // Once told to stop, whatever the worker had published is still handled (its last RELEASEs and
    // BYE come before its connection ends), then the thread ends.
    const bool stopping = link->stop.load(std::memory_order_acquire);
    const RingWait r = link->submit.pop(slot, stopping ? 0 : kPopSliceNs, stopping ? 0 : cfg_.spin_ns);
    if (r == RingWait::kReady) {
      handle(link, slot);
    } else if (r == RingWait::kCorrupt) {
      fail(Verdict{Fault::kProtocol, link->name + " broke its submit ring: " + link->submit.why()});
      return;
    } else if (stopping) {
      return;
    }
  }
}

void LocalPlane::handle(Link* link, const std::uint8_t* slot) {
  Header h;
  const std::string why = decode_header(slot, kHeaderSize, &h);
  if (!why.empty()) return fail(Verdict{Fault::kProtocol, link->name + " wrote a descriptor that is not a frame: " + why});
  if (h.sender != link->rank)
    return fail(Verdict{Fault::kProtocol, link->name + " wrote a frame claiming to be rank " + num(h.sender)});
  switch (h.type) {
    case Msg::kSubmit: return on_submit(link, h);
    case Msg::kRelease: return on_release(link, h);
    case Msg::kBye: return on_bye(link);
    default:
      return fail(Verdict{Fault::kProtocol, link->name + " wrote " + msg_name(static_cast<std::uint8_t>(h.type)) +
                                                ", which workers may not write on their ring"});
  }
}

void LocalPlane::on_submit(Link* link, const Header& h) {
  const std::size_t isz = dtype_size(h.dtype);  // decode_header checked the code
  if (isz == 0 || h.count > kMaxU63 / isz)
    return fail(Verdict{Fault::kProtocol, link->name + " submitted collective #" + num(h.seq) + " of an impossible size"});
  const std::uint64_t nbytes = h.count * isz;
  std::unique_lock<std::mutex> lock(mu_);
  if (failed_) return;
  std::shared_ptr<Segment> seg;
  const std::uint8_t* data = nullptr;
  if (h.shard != kNoSegment) {
    // Its ATTACH travels on the socket and may be read after this SUBMIT: wait for it a while.
    const Clock::time_point deadline = Clock::now() + std::chrono::nanoseconds(cfg_.attach_wait_ns);
    for (;;) {
      auto it = link->segments.find(h.shard);
      if (it != link->segments.end()) {
        seg = it->second;
        break;
      }
      if (failed_) return;
      if (link->stop.load() || attach_cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
        if (link->segments.count(h.shard)) continue;
        return fail_locked(Verdict{Fault::kProtocol,
                                   link->name + " named segment " + num(h.shard) + ", which it never attached"});
      }
    }
    std::uint8_t* p = nullptr;
    const std::string w = seg->range(h.offset, nbytes, &p);
    if (!w.empty())
      return fail_locked(Verdict{Fault::kProtocol,
                                 link->name + " submitted collective #" + num(h.seq) + " outside its memory: " + w});
    data = p;
  } else if (nbytes != 0 && !(h.kind == static_cast<std::uint8_t>(Kind::kBroadcast) && h.aux != link->rank)) {
    return fail_locked(Verdict{Fault::kProtocol, link->name + " submitted collective #" + num(h.seq) + " without data"});
  }
  Spec spec;
  spec.seq = h.seq;
  spec.kind = h.kind;
  spec.dtype = h.dtype;
  spec.itemsize = static_cast<std::uint32_t>(isz);
  spec.widened = h.dtype == kFloat16 || h.dtype == kBfloat16;
  spec.count = h.count;
  spec.op = h.op;
  spec.has_op = h.op != 0;
  spec.root = h.aux;
  std::shared_ptr<Collective> c;
  bool created = false, all_in = false;
  const Verdict v = table_.submit(link->local, spec, &c, &created, &all_in);
  if (!v.ok()) return fail_locked(v);
  std::shared_ptr<Op> op;
  if (created) {
    op = std::make_shared<Op>();
    op->c = c;
    op->spec = spec;
    op->inputs.assign(cfg_.topo.local_size, nullptr);
    op->held.resize(cfg_.topo.local_size);
    op->t0 = Clock::now();
    std::shared_ptr<Segment> fresh;
    const std::uint64_t total = c->result_bytes();
    std::string w = results_->alloc(total, &op->result, &fresh);
    if (w.empty()) {
      op->result_seg = results_->segment(op->result.segment);
      w = op->result_seg ? op->result_seg->range(op->result.offset, total, &op->out) : "its segment is gone";
    }
    if (!w.empty())
      return fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": no result memory for collective #" + num(h.seq) + ": " + w});
    if (fresh) push_event_locked(PlaneEvent{PlaneEvent::kSegment, fresh, {}});
    ops_[h.seq] = op;
  } else {
    auto it = ops_.find(h.seq);
    if (it == ops_.end())
      return fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": collective #" + num(h.seq) + " has no record"});
    op = it->second;
  }
  op->inputs[link->local] = data;
  op->held[link->local] = std::move(seg);
  if (!all_in) return;
  std::vector<Chunk> tasks = op->c->local_tasks();
  if (!pool_.empty() && tasks.size() > 1 && s_bytes(op->spec) > kInlineBytes) {
    // Large, in several chunks: the compute threads share them, and this thread goes back to its
    // ring. (A single chunk gains nothing from a hand-off but its wake-up.)
    for (const Chunk& t : tasks) queue_.push_back(Task{op, t});
    work_cv_.notify_all();
    return;
  }
  lock.unlock();
  // Small: this thread runs the work now (a hand-off would cost more than the work).
  for (const Chunk& t : tasks)
    if (!run_chunk(op, t)) return;
}

bool LocalPlane::run_chunk(const std::shared_ptr<Op>& op, const Chunk& t) {
  const Spec& s = op->spec;
  const std::uint32_t k = cfg_.topo.local_size;
  if (op->c->is_gather()) {
    const std::uint64_t a = t.start, b = t.end;
    if (s.kind == static_cast<std::uint8_t>(Kind::kBroadcast)) {
      const std::uint32_t root = s.root - cfg_.topo.first_rank;
      if (b > a) {
        if (root >= k || op->inputs[root] == nullptr) {
          fail(Verdict{Fault::kProtocol, cfg_.me + ": broadcast #" + num(s.seq) + " has no root input"});
          return false;
        }
        std::memcpy(op->out + a, op->inputs[root] + a, b - a);
      }
    } else {
      const std::uint64_t per = s.count * s.itemsize;
      const std::uint64_t block = op->c->own_range().start;
      for (std::uint32_t r = 0; r < k; r++) {
        const std::uint64_t s0 = block + r * per;
        const std::uint64_t lo = a > s0 ? a : s0, hi = b < s0 + per ? b : s0 + per;
        if (lo < hi) std::memcpy(op->out + lo, op->inputs[r] + (lo - s0), hi - lo);
      }
    }
  } else if (t.end > t.start) {
    const std::size_t n = t.end - t.start;
    std::vector<const void*> in(k);
    for (std::uint32_t i = 0; i < k; i++) in[i] = op->inputs[i] + t.start * s.itemsize;
    void* out = op->out + t.start * s.itemsize;
    const std::uint8_t rop = s.has_op ? s.op : 1;
    const Clock::time_point r0 = Clock::now();
    if (s.widened) {
      const Half half = s.dtype == kFloat16 ? Half::kFloat16 : Half::kBfloat16;
      const Fold fold = rop == kOpMin ? Fold::kMin : rop == kOpMax ? Fold::kMax : Fold::kSum;
      const float div = rop == kOpAvg ? static_cast<float>(cfg_.topo.world) : 0.0f;
      std::vector<const std::uint16_t*> in16(k);
      for (std::uint32_t i = 0; i < k; i++) in16[i] = static_cast<const std::uint16_t*>(in[i]);
      auto* out16 = static_cast<std::uint16_t*>(out);
      std::vector<std::size_t> nan_blocks;
      if (half == Half::kFloat16 && !have_f16c()) {
        for (std::size_t b = 0; b * kReduceBlock < n; b++) nan_blocks.push_back(b);  // all by the portable path
      } else {
        reduce16(half, fold, in16.data(), k, n, out16, div, &nan_blocks);
      }
      for (std::size_t b : nan_blocks) reduce16_nan_block(half, fold, in16.data(), k, n, b, out16, div);
    } else {
      const std::string w = reduce(s.dtype, rop, in.data(), k, n, out, rop == kOpAvg ? cfg_.topo.world : 0);
      if (!w.empty()) {
        fail(Verdict{Fault::kProtocol, cfg_.me + ": collective #" + num(s.seq) + ": " + w});
        return false;
      }
    }
    const double secs = std::chrono::duration<double>(Clock::now() - r0).count();
    std::lock_guard<std::mutex> g(mu_);
    counters_.reduced_bytes += std::uint64_t{k} * n * s.itemsize;
    counters_.reduce_seconds += secs;
  }
  std::unique_lock<std::mutex> relock(mu_);
  if (failed_) return false;
  if (op->c->chunk_completed()) complete_locked(op, &relock);
  return true;
}

void LocalPlane::compute() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [this] { return closed_ || !queue_.empty(); });
    if (queue_.empty()) return;  // closed
    Task task = std::move(queue_.front());
    queue_.pop_front();
    if (failed_) continue;  // a failed job's work is dropped
    lock.unlock();
    run_chunk(task.op, task.chunk);
    lock.lock();
  }
}

void LocalPlane::complete_locked(const std::shared_ptr<Op>& op, std::unique_lock<std::mutex>* lock) {
  const Spec& s = op->spec;
  counters_.collectives++;
  if (completions_.size() < kMaxCompletions)
    completions_.push_back(Completion{s.kind, s.dtype, s.count * s.itemsize,
                                      std::chrono::duration<double>(Clock::now() - op->t0).count()});
  Header h;
  h.type = Msg::kDone;
  h.sender = cfg_.topo.node;
  h.seq = s.seq;
  h.shard = op->result.segment;
  h.offset = op->result.offset;
  h.aux = s.root;
  h.count = s.count;
  h.dtype = s.dtype;
  h.op = s.op;
  h.kind = s.kind;
  std::uint8_t frame[kHeaderSize];
  const std::string w = encode_header(h, frame);
  if (!w.empty()) return fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": " + w});
  std::vector<Link*> to;
  for (auto& l : links_)
    if (l && !l->said_bye && !l->stop.load()) to.push_back(l.get());
  lock->unlock();  // a full ring may make a push wait: never with the plane's lock held
  for (Link* l : to) {
    RingWait r;
    {
      std::lock_guard<std::mutex> g(l->done_mu);
      r = l->done.push(frame, kHeaderSize, cfg_.push_timeout_ns, 0);
    }
    if (r == RingWait::kTimeout)
      return fail(Verdict{Fault::kPeerLost, l->name + " did not take its results for " +
                                                num(static_cast<std::uint64_t>(cfg_.push_timeout_ns / 1'000'000'000)) +
                                                " s (its done ring stayed full)"});
    if (r == RingWait::kCorrupt) return fail(Verdict{Fault::kProtocol, l->name + " broke its done ring: " + l->done.why()});
  }
}

void LocalPlane::on_release(Link* link, const Header& h) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return;
  bool retire = false;
  const Verdict v = table_.release(link->local, h.seq, &retire);
  if (!v.ok()) return fail_locked(v);
  if (retire) retire_locked(h.seq);
}

void LocalPlane::retire_locked(std::uint64_t seq) {
  auto it = ops_.find(seq);
  if (it == ops_.end()) return;
  const std::string w = results_->free(it->second->result);
  ops_.erase(it);
  if (!w.empty()) fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": " + w});
}

void LocalPlane::on_bye(Link* link) {
  std::lock_guard<std::mutex> lock(mu_);
  link->said_bye = true;
  if (failed_) return;
  const Verdict v = table_.rank_said_bye(link->local);
  if (!v.ok()) fail_locked(v);
}

void LocalPlane::push_event_locked(PlaneEvent e) {
  events_.push_back(std::move(e));
  event_cv_.notify_all();
}

void LocalPlane::fail_locked(const Verdict& v) {
  if (failed_) return;
  failed_ = true;
  push_event_locked(PlaneEvent{PlaneEvent::kFailed, nullptr, v});
  attach_cv_.notify_all();
}

void LocalPlane::fail(const Verdict& v) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_locked(v);
}

void LocalPlane::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  failed_ = true;
  attach_cv_.notify_all();
}

Verdict LocalPlane::rank_left_early(std::uint32_t local, bool joined, const std::string& reason, bool* recorded) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.rank_left_early(local, joined, reason, recorded);
}

bool LocalPlane::left_early(std::uint32_t local) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.left_early(local);
}

bool LocalPlane::all_ranks_gone() {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.all_ranks_gone();
}

void LocalPlane::name_rank(std::uint32_t local, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  table_.name_rank(local, name);
}

std::size_t LocalPlane::in_flight() {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_.size();
}

std::vector<LocalPlane::Waiting> LocalPlane::waiting() {
  std::lock_guard<std::mutex> lock(mu_);
  const Clock::time_point now = Clock::now();
  std::vector<Waiting> out;
  for (const auto& [seq, op] : ops_) {
    if (op->c->done()) continue;
    Waiting w{seq, std::chrono::duration<double>(now - op->t0).count(), describe(op->spec), {}};
    for (std::uint32_t i = 0; i < cfg_.topo.local_size; i++)
      if (!op->c->submitted_by(i)) w.late.push_back(i);
    out.push_back(std::move(w));
  }
  return out;
}

bool LocalPlane::next_event(std::int64_t timeout_ns, PlaneEvent* out) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!event_cv_.wait_for(lock, std::chrono::nanoseconds(timeout_ns), [this] { return !events_.empty() || closed_; }))
    return false;
  if (events_.empty()) return false;
  *out = std::move(events_.front());
  events_.pop_front();
  return true;
}

std::vector<Completion> LocalPlane::take_completions() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Completion> out;
  out.swap(completions_);
  return out;
}

PlaneCounters LocalPlane::counters() {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

void LocalPlane::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    attach_cv_.notify_all();
    event_cv_.notify_all();
    work_cv_.notify_all();
  }
  for (auto& l : links_)
    if (l) l->join();
  for (auto& t : pool_)
    if (t.joinable()) t.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.clear();
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [seq, op] : ops_) (void)results_->free(op->result);
  ops_.clear();
}

// ------------------------------------------------------------------------------------ WorkerChannel

WorkerChannel::WorkerChannel(std::shared_ptr<Segment> seg)
    : seg_(std::move(seg)),
      submit_(seg_->base(), kChannelSlots, true),
      done_(seg_->base() + done_ring_offset(), kChannelSlots, true) {}

std::unique_ptr<WorkerChannel> WorkerChannel::create(const std::string& name, std::string* why) {
  std::shared_ptr<Segment> seg = Segment::create(0, channel_bytes(), name, why);
  if (!seg) return nullptr;
  return std::unique_ptr<WorkerChannel>(new WorkerChannel(std::move(seg)));
}

RingWait WorkerChannel::push(const std::uint8_t* header, std::int64_t timeout_ns, std::int64_t spin_ns) {
  std::lock_guard<std::mutex> lock(push_mu_);
  return submit_.push(header, kHeaderSize, timeout_ns, spin_ns);
}

RingWait WorkerChannel::try_push(const std::uint8_t* header) {
  std::unique_lock<std::mutex> lock(push_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return RingWait::kTimeout;
  return submit_.push(header, kHeaderSize, 0, 0);
}

RingWait WorkerChannel::pop(std::uint8_t* out, std::int64_t timeout_ns, std::int64_t spin_ns, bool waiter) {
  const Clock::time_point t0 = Clock::now();
  std::unique_lock<std::mutex> lock(pop_mu_);
  if (waiter) {
    waiters_++;
    yield_.store(true, std::memory_order_seq_cst);
    if (popping_) done_.nudge();  // the background taker is asleep in the ring: hand it over
  }
  RingWait r = RingWait::kTimeout;
  std::array<std::uint8_t, kSlotBytes> slot;
  for (bool first = true;; first = false) {
    if (waiter && kick_.exchange(false)) break;  // kick(): look at the collective again
    if (!kept_.empty() && (waiter || waiters_ == 0)) {
      std::memcpy(out, kept_.front().data(), kSlotBytes);
      kept_.pop_front();
      r = RingWait::kReady;
      break;
    }
    const std::int64_t left =
        timeout_ns - std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    if (aborted_.load() || (left <= 0 && !first)) break;
    if (popping_ || (!waiter && waiters_ > 0)) {  // not our turn: wait for the ring, a slice at a time
      pop_cv_.wait_for(lock, std::chrono::nanoseconds(left < kPopSliceNs ? (left > 0 ? left : 0) : kPopSliceNs));
      continue;
    }
    popping_ = true;
    lock.unlock();
    const std::int64_t slice = left < kPopSliceNs ? (left > 0 ? left : 0) : kPopSliceNs;
    r = done_.pop(slot.data(), slice, first ? spin_ns : 0, waiter ? &kick_ : &yield_);
    lock.lock();
    popping_ = false;
    pop_cv_.notify_all();
    if (r == RingWait::kReady && !waiter && waiters_ > 0) {
      kept_.push_back(slot);  // it may be what a waiter waits for: theirs to take
      r = RingWait::kTimeout;
      continue;
    }
    if (r == RingWait::kReady) std::memcpy(out, slot.data(), kSlotBytes);
    if (r != RingWait::kTimeout) break;
  }
  if (waiter && --waiters_ == 0) yield_.store(false, std::memory_order_seq_cst);
  pop_cv_.notify_all();
  return r;
}

void WorkerChannel::kick() {
  std::lock_guard<std::mutex> lock(pop_mu_);
  // Sticky: a waiter that checked its collective just before, and has not reached its pop yet
  // (between the two it gave up the GIL to this thread), must still see it. A waiter that finds
  // it stale returns once for nothing and looks again.
  kick_.store(true, std::memory_order_seq_cst);
  if (popping_) done_.nudge();
  pop_cv_.notify_all();
}

std::string WorkerChannel::why() {
  if (!done_.why().empty()) return done_.why();
  return submit_.why();
}

}  // namespace smddp
