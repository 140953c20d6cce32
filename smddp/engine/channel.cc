// The worker's side of its channel: the submit ring's producer, the done ring's takers, the fast path.
#include "channel.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>
#include <utility>

namespace smddp {
namespace {

using Clock = std::chrono::steady_clock;

// The longest single sleep of a taker that is not its turn: every wait still ends at its own timeout.
constexpr std::int64_t kTakeSliceNs = 20'000'000;
// The fast path's adaptive spin (channel.h, spin_rest_): misses in a row before it rests, waits it rests.
constexpr std::uint32_t kSpinMisses = 4;
constexpr std::uint32_t kSpinRest = 64;

std::int64_t left_of(Clock::time_point t0, std::int64_t timeout_ns) {
  return timeout_ns - std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

std::int64_t slice_of(std::int64_t left) { return left < kTakeSliceNs ? (left > 0 ? left : 0) : kTakeSliceNs; }

std::string num(std::uint64_t v) { return std::to_string(v); }

}  // namespace

std::size_t channel_bytes() { return counts_offset() + sizeof(DeviceCounts); }

WorkerChannel::WorkerChannel(std::shared_ptr<Segment> seg, int side, int daemon_end)
    : seg_(std::move(seg)),
      submit_(seg_->base(), kChannelSlots, true),
      done_(seg_->base() + done_ring_offset(), kChannelSlots, true),
      // Zeroed (value-initialized): no collective is #0, so nothing streams or is published yet.
      stream_block_(new (seg_->base() + stream_offset()) StreamShared{}),
      counts_(new (seg_->base() + counts_offset()) DeviceCounts{}),
      side_(side),
      daemon_end_(daemon_end) {}

WorkerChannel::~WorkerChannel() {
  close_daemon_end();
  if (side_ >= 0) ::close(side_);
}

std::unique_ptr<WorkerChannel> WorkerChannel::create(const std::string& name, std::string* why) {
  std::shared_ptr<Segment> seg = Segment::create(0, channel_bytes(), name, why);
  if (!seg) return nullptr;
  int fds[2];
  *why = side_pair(fds);
  if (!why->empty()) return nullptr;
  return std::unique_ptr<WorkerChannel>(new WorkerChannel(std::move(seg), fds[0], fds[1]));
}

void WorkerChannel::close_daemon_end() {
  if (daemon_end_ >= 0) ::close(daemon_end_);
  daemon_end_ = -1;
}

RingWait WorkerChannel::attach(const Segment& seg, std::uint32_t rank, std::int64_t timeout_ns,
                               std::int64_t spin_ns) {
  std::lock_guard<std::mutex> lock(push_mu_);
  return attach_locked(seg, rank, timeout_ns, spin_ns);
}

RingWait WorkerChannel::attach_locked(const Segment& seg, std::uint32_t rank, std::int64_t timeout_ns,
                                      std::int64_t spin_ns) {
  Header h;
  h.type = Msg::kAttach;
  h.sender = rank;
  h.shard = seg.id();
  h.offset = seg.size();
  std::array<std::uint8_t, kHeaderSize> frame{};
  std::string w = encode_header(h, frame.data());
  if (w.empty() && seg.fd() < 0) w = "segment " + num(seg.id()) + " has no fd left to pass";
  if (w.empty()) {
    // Under the push lock: the fds leave in the order of their descriptors on the ring.
    bool gone = false;
    w = send_fd(side_, seg.id(), seg.size(), seg.fd(), &gone);
    // The daemon's plane is gone (its end closes only with it): the daemon is ending, and what ends
    // it (its ERROR naming the cause, or its connection's end) comes on the unix socket. Nothing to
    // push: the collective waits for that, as one pushed just before would.
    if (gone) return RingWait::kReady;
  }
  if (!w.empty()) {
    refused("ATTACH: " + w);
    return RingWait::kCorrupt;
  }
  return push_locked(frame.data(), timeout_ns, spin_ns);
}

RingWait WorkerChannel::alloc(Arena& arena, std::uint64_t nbytes, std::uint32_t rank, std::int64_t timeout_ns,
                              std::int64_t spin_ns, Slot* slot, std::shared_ptr<Segment>* fresh,
                              std::string* arena_why) {
  std::lock_guard<std::mutex> lock(push_mu_);
  return alloc_locked(arena, nbytes, rank, timeout_ns, spin_ns, slot, fresh, arena_why);
}

RingWait WorkerChannel::alloc_locked(Arena& arena, std::uint64_t nbytes, std::uint32_t rank, std::int64_t timeout_ns,
                                     std::int64_t spin_ns, Slot* slot, std::shared_ptr<Segment>* fresh,
                                     std::string* arena_why) {
  fresh->reset();
  *arena_why = arena.alloc(nbytes, slot, fresh);
  if (!arena_why->empty()) return RingWait::kCorrupt;
  if (!*fresh) return RingWait::kReady;
  const RingWait r = attach_locked(**fresh, rank, timeout_ns, spin_ns);
  if (r != RingWait::kReady) {
    arena.free(*slot);  // (a slot it has just given out: freeing it cannot be refused)
    fresh->reset();
  }
  return r;
}

std::uint64_t WorkerChannel::reserve() {
  std::lock_guard<std::mutex> lock(push_mu_);
  reserved_.insert(next_seq_);
  return next_seq_++;
}

std::uint64_t WorkerChannel::reserve_fast() {
  std::lock_guard<std::mutex> lock(push_mu_);
  const std::uint64_t seq = next_seq_++;
  reserved_.insert(seq);
  reserved_fast_.insert(seq);
  {
    // Registered before its SUBMIT can go, and so before any taker can meet its DONE.
    std::lock_guard<std::mutex> pop_lock(pop_mu_);
    Fast f;
    f.async = true;
    fast_.emplace(seq, f);
  }
  if (trace_.load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> trace_lock(trace_mu_);
    begun_[seq] = {wall(), 0.0};  // its SUBMIT's time is noted when it goes (give, drain_locked)
  }
  return seq;
}

RingWait WorkerChannel::give(const Header& h, std::int64_t timeout_ns, std::int64_t spin_ns, bool* backlog) {
  if (backlog != nullptr) *backlog = false;
  std::array<std::uint8_t, kHeaderSize> frame{};
  const std::string w = h.type == Msg::kSubmit ? encode_header(h, frame.data()) : "not a SUBMIT";
  if (!w.empty()) {
    refused("give: " + w);
    return RingWait::kCorrupt;
  }
  const RingWait room = make_room(h.sender, timeout_ns, spin_ns);
  if (room != RingWait::kReady) {
    if (backlog != nullptr) *backlog = room == RingWait::kTimeout && !aborted_.load();  // (aborted: the job's failure says why)
    return room;
  }
  std::lock_guard<std::mutex> lock(push_mu_);
  if (reserved_fast_.erase(h.seq) == 0) {
    refused("give: SUBMIT #" + num(h.seq) + " was not reserved for the fast path, or was given already");
    return RingWait::kCorrupt;
  }
  const RingWait r = submit_locked(h.seq, frame.data(), timeout_ns, spin_ns);
  if (r == RingWait::kReady && !queued_.count(h.seq) && trace_.load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> trace_lock(trace_mu_);
    auto b = begun_.find(h.seq);
    if (b != begun_.end()) b->second.second = wall();
  }
  return r;
}

void WorkerChannel::close_starts() {
  std::lock_guard<std::mutex> lock(push_mu_);
  starts_closed_ = true;
}

std::vector<std::uint64_t> WorkerChannel::blocking() {
  std::lock_guard<std::mutex> lock(pop_mu_);
  std::vector<std::uint64_t> out;
  for (const auto& [seq, f] : fast_)
    if (!f.async) out.push_back(seq);
  return out;
}

std::uint64_t WorkerChannel::queued_starts() {
  std::lock_guard<std::mutex> lock(push_mu_);
  return queued_starts_;
}

RingWait WorkerChannel::submit_locked(std::uint64_t seq, const std::uint8_t* frame, std::int64_t timeout_ns,
                                      std::int64_t spin_ns) {
  reserved_.erase(seq);  // (a fast one was never reserved)
  if (!in_window_locked(seq)) {
    // A SUBMIT at least the window before it is reserved and not given yet (a device copy-in still
    // running): the daemon would refuse it, so it waits here.
    std::array<std::uint8_t, kHeaderSize> f{};
    std::memcpy(f.data(), frame, kHeaderSize);
    queued_.emplace(seq, f);
    return RingWait::kReady;
  }
  // Within the window: it goes, then those queued that the window takes now.
  const RingWait r = push_submit_locked(frame, timeout_ns, spin_ns);
  if (r != RingWait::kReady) return r;
  return drain_locked(timeout_ns, spin_ns);
}

bool WorkerChannel::in_window_locked(std::uint64_t seq) const {
  std::uint64_t low = seq;
  if (!reserved_.empty() && *reserved_.begin() < low) low = *reserved_.begin();
  if (!queued_.empty() && queued_.begin()->first < low) low = queued_.begin()->first;
  return seq - low < kSubmitWindow;
}

RingWait WorkerChannel::drain_locked(std::int64_t timeout_ns, std::int64_t spin_ns) {
  // (The lowest queued first: if the window does not take it, it takes none after it.)
  while (!queued_.empty() && in_window_locked(queued_.begin()->first)) {
    const auto it = queued_.begin();
    const RingWait r = push_submit_locked(it->second.data(), timeout_ns, spin_ns);
    if (r != RingWait::kReady) return r;
    if (trace_.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> trace_lock(trace_mu_);
      auto b = begun_.find(it->first);
      if (b != begun_.end()) b->second.second = wall();
    }
    queued_.erase(it);
  }
  return RingWait::kReady;
}

std::shared_ptr<Segment> WorkerChannel::result(std::uint32_t id) {
  std::lock_guard<std::mutex> lock(results_mu_);
  auto it = results_.find(id);
  return it == results_.end() ? nullptr : it->second;
}

bool WorkerChannel::take_segment(const Header& h) {
  const std::uint32_t id = h.shard;
  std::lock_guard<std::mutex> lock(results_mu_);
  if (results_.count(id)) {
    refused("the daemon sent result segment " + num(id) + " twice");
    return false;
  }
  int fd = -1;
  std::string w = recv_fd(side_, id, h.offset, &fd);
  std::shared_ptr<Segment> seg;
  if (w.empty()) seg = Segment::attach(id, fd, h.offset, false, &w);
  if (!seg) {
    refused("the daemon's result " + w);
    return false;
  }
  results_.emplace(id, std::move(seg));
  return true;
}

FastEnd WorkerChannel::refused(const std::string& why) {
  std::lock_guard<std::mutex> lock(why_mu_);
  why_ = why;
  return FastEnd::kRefused;
}

std::string WorkerChannel::backlog_why() {
  std::lock_guard<std::mutex> lock(why_mu_);
  return backlog_why_;
}

std::string WorkerChannel::why() {
  {
    std::lock_guard<std::mutex> lock(why_mu_);
    if (!why_.empty()) return why_;
  }
  if (!done_.why().empty()) return done_.why();
  return submit_.why();
}

void WorkerChannel::abort() {
  aborted_.store(true, std::memory_order_seq_cst);
  done_.nudge();  // a taker asleep in the ring looks at the flag now, not a slice later
  std::lock_guard<std::mutex> lock(pop_mu_);
  pop_cv_.notify_all();
  bg_cv_.notify_all();
}

void WorkerChannel::wake_background() {
  // Only when it can do something: a background taker woken for nothing costs a context switch on
  // every collective, which on two cores is a measurable part of a 4 KiB all-reduce.
  if (bg_waiting_ == 0) return;
  if (!kept_.empty() || (!popping_ && !may_yield() && general_out_ > 0) || aborted_.load())
    bg_cv_.notify_all();
}

void WorkerChannel::wake_takers() {
  if (fast_waiters_ > 0) pop_cv_.notify_all();
}

// --------------------------------------------------------------------------------- the submit ring

RingWait WorkerChannel::push_locked(const std::uint8_t* header, std::int64_t timeout_ns, std::int64_t spin_ns) {
  // The held RELEASEs first: the daemon reads the ring in order, so they are freed before what follows.
  while (!held_.empty()) {
    const RingWait w = submit_.push(held_.front().data(), kHeaderSize, timeout_ns, spin_ns);
    if (w != RingWait::kReady) return w;
    held_.pop_front();
  }
  held_bytes_ = 0;
  return submit_.push(header, kHeaderSize, timeout_ns, spin_ns);
}

RingWait WorkerChannel::push_submit_locked(const std::uint8_t* header, std::int64_t timeout_ns,
                                           std::int64_t spin_ns) {
  // Counted before it goes: its DONE can be taken the moment the daemon sees it, and the taker's
  // acquire of the count (route()) orders it after this thread only if the release came first. A
  // TSan job caught the copy back of a GPU step's piece "racing" its copy-in, once: the device watch
  // that gave the SUBMIT was preempted between its push and the count, the DONE came meanwhile.
  submits_pushed_.fetch_add(1, std::memory_order_release);
  const RingWait r = push_locked(header, timeout_ns, spin_ns);
  if (r != RingWait::kReady) submits_pushed_.fetch_sub(1, std::memory_order_relaxed);  // (it never went)
  return r;
}

RingWait WorkerChannel::push(const std::uint8_t* header, std::int64_t timeout_ns, std::int64_t spin_ns) {
  Header h;
  const bool submit = decode_header(header, kHeaderSize, &h).empty() && h.type == Msg::kSubmit;
  if (submit) {
    // Counted before it can complete, so that no DONE of it is ever taken before it is counted.
    std::lock_guard<std::mutex> lock(pop_mu_);
    general_out_++;
    wake_background();  // it has a collective to collect now
  }
  RingWait r = submit ? make_room(h.sender, timeout_ns, spin_ns) : RingWait::kReady;
  if (r == RingWait::kReady) {
    std::lock_guard<std::mutex> lock(push_mu_);
    r = submit ? submit_locked(h.seq, header, timeout_ns, spin_ns) : push_locked(header, timeout_ns, spin_ns);
  }
  if (submit && r != RingWait::kReady) {
    std::lock_guard<std::mutex> lock(pop_mu_);
    general_out_--;
  }
  return r;
}

RingWait WorkerChannel::try_push(const std::uint8_t* header) {
  Header h;
  const bool submit = decode_header(header, kHeaderSize, &h).empty() && h.type == Msg::kSubmit;
  if (submit) {
    std::lock_guard<std::mutex> lock(pop_mu_);
    general_out_++;
    wake_background();
  }
  RingWait r = RingWait::kTimeout;
  {
    std::unique_lock<std::mutex> lock(push_mu_, std::try_to_lock);
    // Only a push that goes on the ring alone: one that waits for, or carries, queued SUBMITs is
    // push()'s, which has a timeout for their room.
    if (lock.owns_lock() && queued_.empty() && (!submit || in_window_locked(h.seq))) {
      // (Not past kMaxInFlight: that wait is push()'s, which takes DONEs meanwhile.)
      if (!submit)
        r = push_locked(header, 0, 0);
      else if (in_flight() < kMaxInFlight)
        r = push_submit_locked(header, 0, 0);
      if (submit && r == RingWait::kReady) reserved_.erase(h.seq);
    }
  }
  if (submit && r != RingWait::kReady) {
    std::lock_guard<std::mutex> lock(pop_mu_);
    general_out_--;
  }
  return r;
}

RingWait WorkerChannel::release(std::uint32_t rank, std::uint64_t seq, std::int64_t nbytes,
                                std::uint64_t batch_bytes, std::int64_t timeout_ns, std::int64_t spin_ns) {
  Header h;
  h.type = Msg::kRelease;
  h.sender = rank;
  h.seq = seq;
  std::array<std::uint8_t, kHeaderSize> frame{};
  const std::string w = encode_header(h, frame.data());
  if (!w.empty()) {
    refused("cannot encode RELEASE: " + w);
    return RingWait::kCorrupt;
  }
  std::lock_guard<std::mutex> lock(push_mu_);
  // Pushed on its own, a RELEASE wakes the daemon's thread once more per collective, a good part of
  // a small collective's cost: a small one waits to go just ahead of the next descriptor.
  if (nbytes >= 0 && held_bytes_ + static_cast<std::uint64_t>(nbytes) <= batch_bytes &&
      held_.size() < kChannelSlots / 2) {
    held_.push_back(frame);
    held_bytes_ += static_cast<std::uint64_t>(nbytes);
    return RingWait::kReady;
  }
  return push_locked(frame.data(), timeout_ns, spin_ns);
}

// ----------------------------------------------------------------------------------- the done ring

WorkerChannel::Route WorkerChannel::route(const Descriptor& d) {
  Header h;
  // Decoded once here for every taker; one that does not decode is the caller's to refuse.
  if (!decode_header(d.data(), kHeaderSize, &h).empty()) return Route::kGeneral;
  if (h.type == Msg::kSegment) return take_segment(h) ? Route::kKept : Route::kBroken;
  if (h.type != Msg::kDone) return Route::kGeneral;
  dones_taken_.fetch_add(1, std::memory_order_release);
  // A DONE comes only for a SUBMIT this worker pushed (the daemon read it first, in its own process):
  // reading the pushes' count with acquire orders whatever came before that push's count on its
  // thread (a device copy-in's landing, seen by the device watch that gave it; push_submit_locked
  // counts before it pushes) before what this taker does with the DONE (the copy back into the same
  // memory). The daemon's order, made visible in this process, to the C++ memory model and to TSan
  // alike: a TSan job caught the copy back "racing" the copy-in once the watch thread, which holds
  // no GIL, gave the SUBMIT.
  (void)submits_pushed_.load(std::memory_order_acquire);
  auto it = fast_.find(h.seq);
  if (it == fast_.end() || it->second.came) return Route::kGeneral;
  Fast& f = it->second;
  if (f.wanted && f.waited == 0) {
    // Nobody is in its finish() and its callbacks wait: the takers' to hand out (counted since
    // collect()), and the one that does completes it (complete_collected).
    fast_.erase(it);
    return Route::kGeneral;
  }
  if (f.wanted && general_out_ > 0) general_out_--;  // it will not go the general way
  f.wanted = false;
  f.came = true;  // for its finish(), now or later
  f.done = d;
  wake_takers();
  return Route::kKept;
}

RingWait WorkerChannel::pop(std::uint8_t* out, std::int64_t timeout_ns, std::int64_t spin_ns, bool* completed,
                            Located* at) {
  if (completed != nullptr) *completed = false;
  const Clock::time_point t0 = Clock::now();
  for (bool again = false;; again = true) {
    // (again: the last one taken was a native front end's, completed and told through its hook)
    if (again && left_of(t0, timeout_ns) <= 0) return RingWait::kTimeout;
    bool native = false;
    const RingWait r = pop_once(out, t0, timeout_ns, spin_ns, completed, at, &native);
    if (!native) return r;
  }
}

RingWait WorkerChannel::pop_once(std::uint8_t* out, Clock::time_point t0, std::int64_t timeout_ns,
                                 std::int64_t spin_ns, bool* completed, Located* at, bool* native) {
  std::unique_lock<std::mutex> lock(pop_mu_);
  RingWait r = RingWait::kTimeout;
  Descriptor slot;
  for (bool first = true;; first = false) {
    if (!kept_.empty()) {
      std::memcpy(out, kept_.front().data(), kSlotBytes);
      kept_.pop_front();
      r = RingWait::kReady;
      break;
    }
    const std::int64_t left = left_of(t0, timeout_ns);
    if (aborted_.load() || (left <= 0 && !first)) break;
    // It enters the ring only for collectives nobody waits for, and never while the fast path wants it.
    if (popping_ || may_yield() || general_out_ == 0) {
      bg_waiting_++;
      bg_cv_.wait_for(lock, std::chrono::nanoseconds(slice_of(left)));
      bg_waiting_--;
      continue;
    }
    popping_ = true;
    lock.unlock();
    r = done_.pop(slot.data(), slice_of(left), first ? spin_ns : 0, &yield_);
    lock.lock();
    popping_ = false;
    wake_takers();
    if (r == RingWait::kReady) {
      const Route where = route(slot);
      if (where == Route::kBroken) {
        r = RingWait::kCorrupt;
        break;
      }
      if (where == Route::kKept) {  // a result segment taken in, or a fast collective's DONE kept for it
        r = RingWait::kTimeout;
        continue;
      }
      if (general_out_ > 0) general_out_--;
      std::memcpy(out, slot.data(), kSlotBytes);
    }
    if (r != RingWait::kTimeout) break;
  }
  wake_takers();
  wake_background();
  if (r != RingWait::kReady) return r;
  bool done = false;
  r = complete_collected(out, &lock, &done, at, native);
  if (completed != nullptr) *completed = done;
  return r;
}

RingWait WorkerChannel::complete_collected(const std::uint8_t* d, std::unique_lock<std::mutex>* lock, bool* done,
                                           Located* at, bool* native) {
  *done = false;
  *native = false;
  Header h;
  if (!decode_header(d, kHeaderSize, &h).empty() || h.type != Msg::kDone) return RingWait::kReady;
  auto it = collected_.find(h.seq);
  if (it == collected_.end()) return RingWait::kReady;  // the general way's: the caller's to complete
  const Collected c = std::move(it->second);  // (moved: a native hook is not copied)
  collected_.erase(it);
  lock->unlock();  // the copy and the RELEASE need none of the takers' state
  *done = !c.native;
  *native = static_cast<bool>(c.native);
  Located here;
  const RingWait r = deliver(h, c.submit, c.out, c.batch_bytes, c.timeout_ns, 0, &here, Streamed{});
  if (at != nullptr) *at = here;
  if (r == RingWait::kTimeout)
    refused("the daemon left this worker's submit ring full: the RELEASE of #" + num(h.seq) + " could not go");
  if (c.native) {
    if (r != RingWait::kReady)
      c.native("ProtocolError", why());
    else
      c.native("DeviceError", here.why);  // (empty: delivered; else its sink's copy back could not go)
    return RingWait::kReady;
  }
  return r == RingWait::kTimeout ? RingWait::kCorrupt : r;
}

RingWait WorkerChannel::take_turn(std::unique_lock<std::mutex>* lock, std::int64_t slice_ns, std::int64_t spin_ns) {
  popping_ = true;
  lock->unlock();
  Descriptor d;
  const RingWait r = done_.pop(d.data(), slice_ns, spin_ns, &aborted_);
  lock->lock();
  popping_ = false;
  wake_takers();
  if (r == RingWait::kCorrupt) {
    refused("the daemon broke this worker's done ring: " + done_.why());
    return r;
  }
  if (r != RingWait::kReady) return r;
  const Route where = route(d);
  if (where == Route::kBroken) return RingWait::kCorrupt;  // (take_segment said why)
  if (where == Route::kGeneral) {
    // The general way's, or a collected one's (another thread's collective): the background taker's.
    if (general_out_ > 0) general_out_--;
    kept_.push_back(d);
    wake_takers();
    wake_background();
  }
  return RingWait::kReady;
}

RingWait WorkerChannel::make_room(std::uint32_t rank, std::int64_t timeout_ns, std::int64_t spin_ns) {
  if (in_flight() < kMaxInFlight) return RingWait::kReady;  // (the common case: two loads)
  const Clock::time_point t0 = Clock::now();
  std::unique_lock<std::mutex> lock(pop_mu_);
  // A taker as finish() is: counted among the fast waits, so that the background taker yields the ring.
  fast_waiters_++;
  yield_.store(true, std::memory_order_seq_cst);
  if (popping_) done_.nudge();
  RingWait end = RingWait::kTimeout;
  for (bool first = true;; first = false) {
    if (in_flight() < kMaxInFlight) {
      end = RingWait::kReady;
      break;
    }
    const std::int64_t left = left_of(t0, timeout_ns);
    if (aborted_.load() || (left <= 0 && !first)) break;
    if (popping_) {  // another taker is in the ring: what it takes counts as well
      pop_cv_.wait_for(lock, std::chrono::nanoseconds(slice_of(left)));
      continue;
    }
    if (take_turn(&lock, slice_of(left), first ? spin_ns : 0) == RingWait::kCorrupt) {
      end = RingWait::kCorrupt;
      break;
    }
  }
  fast_waiters_--;
  yield_.store(may_yield(), std::memory_order_seq_cst);
  wake_takers();
  wake_background();
  if (end == RingWait::kTimeout && !aborted_.load()) {
    std::lock_guard<std::mutex> g(why_mu_);
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", static_cast<double>(timeout_ns) / 1e9);
    backlog_why_ = "rank " + num(rank) + ": a collective could not start: the " + num(in_flight()) +
                   " this worker started before it had no result for " + secs +
                   " s (are the other ranks still calling them?)";
  }
  return end;
}

// ----------------------------------------------------------------------------------- the fast path

FastEnd WorkerChannel::start(Arena& arena, const Source* src, std::size_t n, Header* submit, Slot* slot,
                             std::int64_t timeout_ns, std::int64_t spin_ns, bool async, const Delivery* back,
                             Streamed* got) {
  if ((back == nullptr) != (got == nullptr)) return refused("start: a result to stream back needs its record");
  const double t_start = trace_.load(std::memory_order_relaxed) ? wall() : 0;
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < n; i++) {
    if (src[i].nbytes > UINT64_MAX - total) return refused("a fast SUBMIT's sources overflow");
    total += src[i].nbytes;
  }
  // What it sends is its count of its dtype, or nothing (a barrier, a broadcast's other ranks).
  const DTypeInfo* dt = dtype_info(submit->dtype);
  const std::uint64_t isz = dt != nullptr ? dt->itemsize : 0;
  if (total != 0 && (isz == 0 || submit->count > total / isz || submit->count * isz != total))
    return refused("a fast SUBMIT's data (" + num(total) + " bytes) is not its count of its dtype");
  if (submit->type != Msg::kSubmit) return refused("a fast collective is a SUBMIT");
  switch (make_room(submit->sender, timeout_ns, spin_ns)) {
    case RingWait::kReady: break;
    case RingWait::kTimeout: return aborted_.load() ? FastEnd::kRingFull : FastEnd::kBacklog;
    case RingWait::kCorrupt: return FastEnd::kRefused;
  }
  // A large all-reduce on one node streams (the stream block): its SUBMIT goes before its copy-in,
  // which publishes its progress as it goes. One streams at a time (the block's `in` has one writer).
  const bool streaming = stream_.load(std::memory_order_relaxed) && streams(submit->kind, total);
  std::unique_lock<std::mutex> stream_lock(stream_mu_, std::defer_lock);
  if (streaming) stream_lock.lock();
  *slot = Slot{kNoSegment, 0, 0};
  std::shared_ptr<Segment> seg;
  std::uint8_t* in = nullptr;
  if (total != 0) {
    std::string arena_why;
    std::shared_ptr<Segment> fresh;
    RingWait r;
    {
      std::lock_guard<std::mutex> lock(push_mu_);
      if (starts_closed_) return FastEnd::kHeld;
      // A blocking streaming one's slot is its input ring: it goes round it (stream_room).
      r = alloc_locked(arena, streaming && !async ? stream_ring_bytes(total) : total, submit->sender, timeout_ns,
                       spin_ns, slot, &fresh, &arena_why);
    }
    if (!arena_why.empty()) return refused_by_arena(arena_why);
    if (r == RingWait::kTimeout) return FastEnd::kRingFull;
    if (r != RingWait::kReady) return FastEnd::kRefused;  // (attach said why)
    seg = arena.segment(slot->segment);
    std::uint8_t* p = nullptr;
    const std::string w = seg ? seg->range(slot->offset, slot->nbytes, &p) : "not in the arena";
    if (!w.empty()) {
      arena.free(*slot);
      return refused("input slot: " + w);
    }
    in = p;
    // The copy goes outside the push lock: RELEASEs and other threads' descriptors need not wait for
    // it. (A streaming one's goes after its SUBMIT, below.)
    if (!streaming) {
      for (std::size_t i = 0; i < n; i++) {
        if (src[i].nbytes != 0) std::memcpy(p, src[i].data, src[i].nbytes);
        p += src[i].nbytes;
      }
    }
  }
  submit->shard = slot->segment;
  submit->offset = slot->offset;
  FastEnd end = FastEnd::kDone;
  {
    std::lock_guard<std::mutex> lock(push_mu_);
    if (starts_closed_) {
      end = FastEnd::kHeld;  // shutdown closed starts between the two locks: its BYE is the last descriptor
    } else {
      submit->seq = next_seq_;
      std::array<std::uint8_t, kHeaderSize> frame{};
      const std::string w = encode_header(*submit, frame.data());
      if (!w.empty()) {
        end = refused("cannot encode SUBMIT: " + w);
      } else {
        {
          // Registered before it can complete: whoever takes its DONE keeps it for finish().
          std::lock_guard<std::mutex> pop_lock(pop_mu_);
          Fast f;
          f.async = async;
          fast_.emplace(submit->seq, f);
        }
        if (streaming) {
          // Before its SUBMIT can go: the daemon that takes it sees that it streams.
          // (Busy first, then the fields with release order: a daemon that reads one of them sees
          // in_seq busy or this number after it, never the last one's.)
          stream_block_->in_seq.store(kStreamBusy, std::memory_order_relaxed);
          stream_block_->in_bytes.store(0, std::memory_order_release);
          stream_block_->in_ring.store(slot->nbytes, std::memory_order_release);
          stream_block_->in_seq.store(submit->seq, std::memory_order_release);
        }
        // It goes at once unless it is the window past a reserved SUBMIT not on the ring yet (a
        // device copy-in still running): then it waits here until the window takes it (submit_locked).
        const RingWait r = submit_locked(submit->seq, frame.data(), timeout_ns, spin_ns);
        if (r == RingWait::kReady) {
          if (queued_.count(submit->seq)) queued_starts_++;
          next_seq_++;
          if (t_start != 0) {
            // Noted before start() returns, and so before anything can finish or collect it (a
            // queued one's SUBMIT time is noted again when it goes).
            std::lock_guard<std::mutex> trace_lock(trace_mu_);
            begun_[submit->seq] = {t_start, wall()};
          }
        } else {
          if (streaming) stream_block_->in_bytes.store(kStreamAll, std::memory_order_release);  // (never pushed)
          std::lock_guard<std::mutex> pop_lock(pop_mu_);
          fast_.erase(submit->seq);  // nobody could collect() it yet: it was never counted
          end = r == RingWait::kTimeout ? FastEnd::kRingFull : FastEnd::kRefused;
        }
      }
    }
  }
  if (end != FastEnd::kDone && total != 0) arena.free(*slot);
  if (end == FastEnd::kDone && streaming) {
    // The copy-in, behind its SUBMIT, round the input ring (a whole slot: once round, never waiting):
    // the daemon reduces each chunk once every worker is past it, and says so before this worker
    // writes over it.
    const std::uint64_t ring = slot->nbytes;
    const Clock::time_point t0 = Clock::now();
    std::uint64_t done = 0;
    bool stopped = false;
    for (std::size_t i = 0; i < n && !stopped; i++) {
      for (std::uint64_t k = 0; k < src[i].nbytes;) {
        std::uint64_t step = src[i].nbytes - k < kStreamStepBytes ? src[i].nbytes - k : kStreamStepBytes;
        const std::uint64_t at = done % ring;
        if (step > ring - at) step = ring - at;  // never across the ring's end
        if (!stream_room(submit->seq, done, done + step, ring, t0, timeout_ns, spin_ns, back, got)) {
          // Aborted, or the daemon stopped reducing for the whole timeout: the job is failing (its
          // wait says so). Its input stays short of its end: the daemon never takes it as whole.
          stopped = true;
          break;
        }
        std::memcpy(in + at, src[i].data + k, step);
        k += step;
        done += step;
        stream_block_->in_bytes.store(done, std::memory_order_release);
      }
    }
    if (!stopped) stream_block_->in_bytes.store(kStreamAll, std::memory_order_release);
    streamed_in_.fetch_add(done, std::memory_order_relaxed);
  }
  return end;
}

FastEnd WorkerChannel::refused_by_arena(const std::string& why) {
  refused(why);
  return FastEnd::kArena;
}

FastEnd WorkerChannel::finish(Arena& arena, const Slot& slot, const Header& submit, const Delivery& out,
                              std::uint64_t batch_bytes, std::int64_t timeout_ns, std::int64_t spin_ns, Located* located,
                              Streamed* carried) {
  if (out.src_offset > out.result_bytes || out.nbytes > out.result_bytes - out.src_offset)
    return refused("collective #" + num(submit.seq) + ": its destination lies outside its result");
  const Clock::time_point t0 = Clock::now();
  Streamed streamed;
  if (carried != nullptr) streamed = *carried;  // what start() copied out already
  bool counted = false;  // this wait counted in `waited` already (while it streamed)
  if (stream_.load(std::memory_order_relaxed) && !out.hold && out.src_offset == 0 &&
      out.nbytes == out.result_bytes && streams(submit.kind, out.nbytes)) {
    bool came = true;
    {
      std::lock_guard<std::mutex> lock(pop_mu_);
      auto at = fast_.find(submit.seq);
      if (at == fast_.end()) return FastEnd::kGone;
      came = at->second.came;
      // Counted before it streams: a taker that meets its DONE meanwhile keeps it for this wait
      // rather than completing it (collected) into the memory this wait is copying into. A TSan
      // job caught the two copying at once (a native front end's wait and its done callback).
      if (!came) {
        at->second.waited++;
        counted = true;
      }
    }
    // Its DONE already here: the result is whole, nothing to stream.
    if (!came) stream_out(submit.seq, out, t0, timeout_ns, spin_ns, &streamed);
  }
  Descriptor mine;
  FastEnd end = FastEnd::kTimeout;
  {
    std::unique_lock<std::mutex> lock(pop_mu_);
    auto at = fast_.find(submit.seq);
    if (at == fast_.end()) return FastEnd::kGone;
    if (!counted) at->second.waited++;
    const bool async = at->second.async;
    fast_waiters_++;
    yield_.store(true, std::memory_order_seq_cst);
    if (popping_) done_.nudge();
    for (bool first = true;; first = false) {
      auto it = fast_.find(submit.seq);
      if (it == fast_.end()) {
        // An asynchronous one another thread waited for too, and finished: this wait is over. A
        // blocking one adopted while it was waited for: the caller's misuse.
        end = async ? FastEnd::kGone
                    : refused("collective #" + num(submit.seq) + " was handed over while it was waited for");
        break;
      }
      if (it->second.came) {
        mine = it->second.done;
        fast_.erase(it);
        collected_.erase(submit.seq);  // completed here, not by a taker
        end = FastEnd::kDone;
        break;
      }
      const std::int64_t left = left_of(t0, timeout_ns);
      if (aborted_.load() || (left <= 0 && !first)) break;
      if (popping_) {
        pop_cv_.wait_for(lock, std::chrono::nanoseconds(slice_of(left)));
        continue;
      }
      const std::int64_t spin = spin_rest_ > 0 ? 0 : spin_ns;
      if (spin_rest_ > 0) spin_rest_--;
      const Clock::time_point p0 = Clock::now();
      const RingWait r = take_turn(&lock, slice_of(left), spin);
      if (r == RingWait::kCorrupt) {
        end = FastEnd::kRefused;  // (take_turn said why)
        break;
      }
      if (r == RingWait::kReady && spin > 0) {
        // Caught while spinning, or only after the sleep: the spin's record.
        spin_misses_ = Clock::now() - p0 <= std::chrono::nanoseconds(spin) ? 0 : spin_misses_ + 1;
        if (spin_misses_ >= kSpinMisses) {
          spin_misses_ = kSpinMisses - 1;  // after the rest, one more miss is enough to rest again
          spin_rest_ = kSpinRest;
        }
      }
    }
    fast_waiters_--;
    if (end != FastEnd::kDone) {
      auto it = fast_.find(submit.seq);
      if (it != fast_.end()) it->second.waited--;
    }
    yield_.store(may_yield(), std::memory_order_seq_cst);
    wake_takers();
    wake_background();
  }
  if (end != FastEnd::kDone) return end;  // kTimeout: parked until adopt()

  Header h;
  const std::string w = decode_header(mine.data(), kHeaderSize, &h);
  if (!w.empty()) return refused("the daemon wrote a descriptor that is not a frame: " + w);
  Located here;
  const RingWait r = deliver(h, submit, out, batch_bytes, timeout_ns, spin_ns, &here, streamed);
  if (r == RingWait::kCorrupt) return FastEnd::kRefused;
  if (located != nullptr) *located = here;
  if (slot.segment != kNoSegment) {
    const std::string fw = arena.free(slot);
    if (!fw.empty()) return refused("input slot of #" + num(h.seq) + ": " + fw);
  }
  return r == RingWait::kTimeout ? FastEnd::kRingFull : FastEnd::kDone;
}

bool WorkerChannel::stream_room(std::uint64_t seq, std::uint64_t done, std::uint64_t end, std::uint64_t ring,
                                Clock::time_point t0, std::int64_t timeout_ns, std::int64_t spin_ns,
                                const Delivery* back, Streamed* got) {
  const StreamShared& b = *stream_block_;
  Clock::time_point moved = Clock::now();
  for (;;) {
    // Reduced so far: nothing until the daemon starts it (its other workers' SUBMITs still to come).
    // ack_bytes went to 0 before ack_seq became this one's, and no later one of this worker's
    // streams before this copy-in ends: a value read after ack_seq == seq is this one's.
    std::uint64_t acked = 0;
    if (b.ack_seq.load(std::memory_order_acquire) == seq) acked = b.ack_bytes.load(std::memory_order_acquire);
    if (end <= ring || end - ring <= acked) return true;
    if (aborted_.load() || left_of(t0, timeout_ns) <= 0) return false;
    // The ring is full: the result behind the reduction goes out meanwhile (below `done`: in place,
    // the result overwrites its source, which is copied in that far).
    const std::uint64_t before = got != nullptr ? got->bytes : 0;
    if (back != nullptr && !got->stopped && stream_step(seq, *back, got, done) == Step::kStop) got->stopped = true;
    if (got != nullptr && got->bytes > before) {
      moved = Clock::now();
      continue;
    }
    stream_pause(moved, spin_ns);
  }
}

WorkerChannel::Step WorkerChannel::stream_step(std::uint64_t seq, const Delivery& out, Streamed* got,
                                               std::uint64_t limit) {
  const StreamShared& b = *stream_block_;
  const std::uint64_t s = b.out_seq.load(std::memory_order_acquire);
  if (s != seq) return s != kStreamBusy && s > seq ? Step::kStop : Step::kMore;
  if (got->src == nullptr) {
    // Where its result is: read between two looks at out_seq (a sequence lock; the daemon sets it
    // busy before it rewrites the block, and writes each field with release order, so a field read
    // here that is a later collective's makes the second look see busy or that one's number).
    const std::uint64_t segment = b.out_segment.load(std::memory_order_acquire);
    const std::uint64_t offset = b.out_offset.load(std::memory_order_acquire);
    if (b.out_seq.load(std::memory_order_relaxed) != seq) return Step::kMore;
    std::shared_ptr<Segment> seg = segment <= UINT32_MAX ? result(static_cast<std::uint32_t>(segment)) : nullptr;
    std::uint8_t* p = nullptr;
    if (!seg || !seg->range(offset, out.result_bytes, &p).empty()) return Step::kStop;
    // (The segment stays mapped: result segments stay in the table while the channel lives.)
    got->src = p;
    got->segment = segment;
    got->offset = offset;
  }
  const std::uint64_t ready = b.out_bytes.load(std::memory_order_acquire);
  if (b.out_seq.load(std::memory_order_relaxed) != seq) return Step::kStop;  // moved on: the DONE does the rest
  std::uint64_t upto = ready < out.nbytes ? ready : out.nbytes;
  if (upto > limit) upto = limit;
  if (upto > got->bytes) {
    // Result memory the daemon does not reuse before this worker's RELEASE.
    std::memcpy(out.dst + got->bytes, got->src + got->bytes, upto - got->bytes);
    streamed_out_.fetch_add(upto - got->bytes, std::memory_order_relaxed);
    got->bytes = upto;
  }
  return got->bytes == out.nbytes ? Step::kAll : Step::kMore;
}

void WorkerChannel::stream_out(std::uint64_t seq, const Delivery& out, Clock::time_point t0, std::int64_t timeout_ns,
                               std::int64_t spin_ns, Streamed* got) {
  Clock::time_point moved = Clock::now();  // the last progress: spinning restarts from there
  while (!got->stopped) {
    const std::uint64_t before = got->bytes;
    const Step st = stream_step(seq, out, got, UINT64_MAX);
    if (st != Step::kMore) break;
    if (aborted_.load() || left_of(t0, timeout_ns) <= 0) break;
    if (got->bytes > before) moved = Clock::now();
    stream_pause(moved, spin_ns);
  }
}

RingWait WorkerChannel::deliver(const Header& h, const Header& submit, const Delivery& out, std::uint64_t batch_bytes,
                                std::int64_t timeout_ns, std::int64_t spin_ns, Located* at, const Streamed& streamed) {
  const double t_done = trace_.load(std::memory_order_relaxed) ? wall() : 0;
  if (h.kind != submit.kind || h.dtype != submit.dtype || h.count != submit.count) {
    refused("DONE for collective #" + num(h.seq) + " does not match what this rank submitted");
    return RingWait::kCorrupt;
  }
  // Its SEGMENT came before it on the same ring: a segment not in the table was never sent.
  std::shared_ptr<Segment> seg = result(h.shard);
  if (!seg) {
    refused("DONE for #" + num(h.seq) + " names result segment " + num(h.shard) + ", which was never sent");
    return RingWait::kCorrupt;
  }
  std::uint8_t* p = nullptr;
  const std::string w = seg->range(h.offset, out.result_bytes, &p);
  if (!w.empty()) {
    refused("DONE for #" + num(h.seq) + ": " + w);
    return RingWait::kCorrupt;
  }
  if (out.hold) {
    // A device collective's: its caller copies the result to the device and RELEASEs it after that copy.
    *at = Located{true, h.shard, h.offset, out.result_bytes};
    if (out.sink) {
      at->sunk = true;
      out.sink->arrived(submit, p, *at, seg, &at->why);
    }
    if (t_done != 0) traced(submit, h.seq, t_done, wall());
    return RingWait::kReady;
  }
  if (streamed.bytes != 0 && (h.shard != streamed.segment || h.offset != streamed.offset)) {
    refused("DONE for #" + num(h.seq) + " names another result slot than the one its daemon streamed");
    return RingWait::kCorrupt;
  }
  if (out.nbytes > streamed.bytes)
    std::memcpy(out.dst + streamed.bytes, p + out.src_offset + streamed.bytes, out.nbytes - streamed.bytes);
  if (t_done != 0) traced(submit, h.seq, t_done, wall());
  // The collective is complete: its RELEASE may wait for ring space the whole timeout, not what is
  // left of it (a full ring for that long means the daemon is gone).
  return release(submit.sender, h.seq, static_cast<std::int64_t>(out.result_bytes), batch_bytes, timeout_ns, spin_ns);
}

bool WorkerChannel::collect(std::uint64_t seq, const Collected& how) {
  std::lock_guard<std::mutex> lock(pop_mu_);
  auto it = fast_.find(seq);
  if (it == fast_.end() || !it->second.async) return false;  // done (or never the fast path's)
  // A destination outside its result is not taken: the caller completes that one its own way.
  const bool stored =
      how.out.src_offset <= how.out.result_bytes && how.out.nbytes <= how.out.result_bytes - how.out.src_offset;
  if (stored) collected_[seq] = how;
  if (it->second.wanted) return stored;                        // asked before
  if (it->second.came && it->second.waited > 0) return stored;  // a finish() is taking it now
  if (it->second.came) {
    // Its DONE came and waits parked: the general way's now (kept_ holds DONEs uncounted in general_out_).
    kept_.push_back(it->second.done);
    fast_.erase(it);
  } else {
    it->second.wanted = true;
    general_out_++;  // the background taker enters the ring for it
  }
  wake_background();
  return stored;
}

// ----------------------------------------------------------------------------------- the timeline

void WorkerChannel::traced(const Header& submit, std::uint64_t seq, double done, double copied) {
  std::lock_guard<std::mutex> lock(trace_mu_);
  auto it = begun_.find(seq);
  if (it == begun_.end()) return;  // started before the timeline was turned on
  if (traces_.size() < kMaxChannelTraces) {
    traces_.push_back(ChannelTrace{seq, submit.kind, submit.dtype, submit.count, it->second.first, it->second.second,
                                   done, copied});
  } else {
    traces_dropped_++;
  }
  begun_.erase(it);
}

std::vector<ChannelTrace> WorkerChannel::take_traces(std::uint64_t* dropped) {
  std::lock_guard<std::mutex> lock(trace_mu_);
  std::vector<ChannelTrace> out;
  out.swap(traces_);
  *dropped = traces_dropped_;
  traces_dropped_ = 0;
  return out;
}

bool WorkerChannel::unblock(std::uint64_t seq) {
  std::lock_guard<std::mutex> lock(pop_mu_);
  auto it = fast_.find(seq);
  if (it == fast_.end()) return false;
  it->second.async = true;  // (blocking() lists it no more; collect() takes it)
  return true;
}

bool WorkerChannel::adopt(std::uint64_t seq, std::uint8_t* out) {
  bool came = false;
  {
    std::lock_guard<std::mutex> lock(pop_mu_);
    auto it = fast_.find(seq);
    if (it == fast_.end()) return false;
    came = it->second.came;
    if (came) std::memcpy(out, it->second.done.data(), kSlotBytes);
    fast_.erase(it);  // a blocking one's: never collect()ed, so never counted
    if (!came) {
      general_out_++;  // its DONE is still to come: the general way's takers collect it
      wake_background();
    }
  }
  std::lock_guard<std::mutex> trace_lock(trace_mu_);
  begun_.erase(seq);  // (not traced here: deliver() never sees it)
  return came;
}

}  // namespace smddp
