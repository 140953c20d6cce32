// A worker's channel to its daemon: the layout both sides share, and the worker's side (WorkerChannel).
//
// The channel is one memfd segment the worker creates and passes with CHANNEL: the submit ring
// (worker -> daemon: ATTACH, SUBMIT, RELEASE, BYE), then the done ring (daemon -> worker: SEGMENT,
// DONE), each of kChannelSlots slots holding one 56-byte frame header (docs/protocol.md), and a
// side socket for the fds of ATTACH and SEGMENT (fdpass.h). The rings are the one ordered channel:
// a segment is ATTACHed before the SUBMIT that names it, and the daemon pushes a result segment's
// SEGMENT before the first DONE that names it, so neither side ever waits for a segment. The
// daemon's side is the plane's WorkerPort (worker_port.h).
//
// Sequence numbers are the channel's, handed out in call order (reserve for the general way, and
// reserve_fast for a device collective, whose SUBMIT is given once its copy lands; start takes the
// next as it pushes). A SUBMIT goes on the ring as soon as it is given, out of sequence order, as
// long as it is less than kSubmitWindow past the lowest number not on the ring yet (the daemon's
// rule, docs/protocol.md): a host collective started after a device one whose copy-in is still
// running does not wait for it. One further on waits in the channel until the window has moved up
// to it. Input slots are the channel's too (alloc: a new segment's ATTACH under the same push lock
// as the slot, ahead of any SUBMIT that names it): no caller's lock orders the ring.
//
// Every collective the client starts is the fast path's, on one table (`fast_`), and the done
// ring has two kinds of takers, one popping at a time:
// - the background taker (pop): the client's DONE thread, for collectives nobody waits for (collected,
//   below); it enters the ring only while such collectives are out (`general_out_`), so a worker
//   whose every collective is waited for is never woken for nothing. Tests that drive a plane with
//   raw descriptors pop their DONEs this way too (the general way: reserve or a SUBMIT of their own
//   pushed, counted in `general_out_`, its DONE handed out of pop() as it is);
// - the fast path (start/finish): a host collective of any kind run entirely here, GIL released,
//   from the copy into shared memory to the copy of the result out of it (Delivery) and its
//   RELEASE. Its DONE is its own: any other taker that meets it keeps it aside for it (`fast_`), and
//   it hands any other DONE it meets to the others (`kept_`). A blocking call runs start and finish
//   on one thread; an asynchronous one (start(..., async)) returns after start, and its finish runs
//   in whichever thread waits for it, later. Until something waits for it, nobody is woken for it:
//   its DONE, if some taker meets it, is parked for a finish to come. Once callbacks wait for it
//   (collect(seq, ...)), it is counted in `general_out_` like a collective of the general way, and
//   if nobody is in its finish when its DONE is taken (or it is parked already), the taker that
//   hands it out of pop() completes it there: the DONE checked, its Delivery copied, its RELEASE
//   held or sent, all here (`collected_`), and pop() says so (`*completed`): the caller has only
//   its input slot to free and its callbacks to run. finish then answers kGone. A device collective
//   is a fast one too, reserved (reserve_fast) and given (give) rather than started, and held
//   (Delivery::hold): whoever takes its DONE checks it and locates its result (Located), copying
//   and RELEASEing nothing; the caller copies the result to the device and RELEASEs it after.
// The fast path goes first: the background taker's pop ends when one of its waits comes.
//
// A SEGMENT is taken in by whichever taker pops it (its fd off the side socket, mapped read-only
// into the result table); it never reaches the caller.
//
// Memory: the channel owns its segment, its end of the side socket (and the daemon's end until
// close_daemon_end), the result segments it was sent (shared with the callers of result()) and the
// timeline's phases (set_trace: until take_traces). The
// caller's buffers (start's source, finish's destination) and the arena must stay alive for the call;
// a collected collective's destination (collect) until it completes or the channel is gone (the
// Python binding holds it: module.cc's ChannelObject::keep). A held collective's input slot is the
// caller's to fill (reserve_fast: the caller allocates it), freed as a started one's is (by its
// finish() once its DONE is taken, or by the caller of the pop() that completed it); its result range (Located) stays the daemon's slot, which the
// daemon does not reuse until the caller's RELEASE, sent once its copy to the device has read it.
#pragma once

#include <sched.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "arena.h"
#include "fdpass.h"
#include "frame.h"
#include "ring.h"

namespace smddp {

constexpr std::uint32_t kChannelSlots = 256;  // per ring
// SUBMITs on the ring whose DONE no taker has taken yet, at most (make_room): each DONE may come with
// a SEGMENT before it, so this many leave the done ring room for every one of them, with room to
// spare for threads that start at the same moment. A caller may keep any number of collectives in
// flight; past this many, the one that starts takes DONEs off the ring itself first.
constexpr std::uint64_t kMaxInFlight = kChannelSlots / 2 - 16;
constexpr std::uint32_t kNoSegment = 0xFFFFFFFFu;  // a SUBMIT without data (a broadcast's non-root ranks)

// Bytes of a worker's channel segment: the submit ring, then the done ring, then the stream block.
std::size_t channel_bytes();
inline std::size_t done_ring_offset() { return ring_bytes(kChannelSlots); }
inline std::size_t stream_offset() { return 2 * ring_bytes(kChannelSlots); }

// The stream block (docs/protocol.md, CHANNEL): on one node a large all-reduce streams through shared
// memory instead of going in three passes one after another (every worker's copy in, the reduction,
// every copy out, each over more than the cache holds; issue 29, item 6). Its SUBMIT goes first; the
// daemon reduces each chunk once every worker's copy-in is past it, says how far it has reduced,
// and each worker copies the result out behind the reduction. A blocking one's input slot is a ring
// of at most kStreamRingBytes that its copy-in goes round, waiting for the reduction to free it:
// only a few MiB of shared memory are written per worker whatever the size, and they stay in the
// cache. An asynchronous one's slot holds its whole buffer, so that its start never waits for the
// other ranks (its caller goes on, and may be what another rank waits for).
// - in (the worker writes; the daemon reads): `in_seq`, the collective it is copying in, written
//   before that SUBMIT goes on the ring (so the daemon, taking the SUBMIT, sees that it streams);
//   `in_ring`, the size of its input slot (its whole size, or kStreamRingBytes for a larger one that
//   goes round it); `in_bytes`, how many of its bytes are in place, rising, and kStreamAll once every
//   byte is. For a new collective the worker sets `in_seq` to kStreamBusy, then `in_bytes` to 0 and
//   `in_ring`, then `in_seq` to its number (a sequence lock). One worker streams one collective at a
//   time, and a busy or later `in_seq` tells the daemon that the one before has every byte in.
// - ack (the daemon writes; the worker reads): `ack_seq`, the streaming collective it has started
//   reducing, then `ack_bytes`, how many of its bytes it has reduced from the first, rising (set to 0
//   before `ack_seq` changes). The worker writes position p of its input at p % ring only once
//   p < ack_bytes + ring: the bytes there before it are reduced.
// - out (the daemon writes; the worker reads), under a sequence lock: `out_seq` is kStreamBusy
//   while the daemon rewrites the block for a new collective, then that collective's number; its
//   result slot (`out_segment`, `out_offset`) and `out_bytes`, how many bytes of it from the slot's
//   start are final, rising, all of them before its DONE goes. Best effort: a later collective may
//   take the block over, and the DONE says where the rest is.
// Neither side trusts the other's numbers: the daemon only compares them (a worker that claims its
// bytes early reduces its own garbage; one that never finishes fails the job after the push
// timeout), and the worker bounds-checks the result slot against its segment before reading it.
struct alignas(64) StreamShared {
  alignas(64) std::atomic<std::uint64_t> in_seq;
  std::atomic<std::uint64_t> in_bytes;
  std::atomic<std::uint64_t> in_ring;
  alignas(64) std::atomic<std::uint64_t> ack_seq;
  std::atomic<std::uint64_t> ack_bytes;
  alignas(64) std::atomic<std::uint64_t> out_seq;
  std::atomic<std::uint64_t> out_segment;
  std::atomic<std::uint64_t> out_offset;
  std::atomic<std::uint64_t> out_bytes;
};
// The device counts (docs/protocol.md, CHANNEL), after the stream block: what the worker's engine
// copied between its devices and smddp's memory, so that `smddp status` and the metrics show each
// rank's PCIe traffic (issue 57: S a rank on the host path, S/G once the node sums on the GPUs).
// The worker adds with relaxed order (counts, not a protocol: nothing waits on them); the daemon
// only reads and shows them, trusting nothing of them.
struct alignas(64) DeviceCounts {
  std::atomic<std::uint64_t> d2h_bytes;   // device to host: copies into input slots
  std::atomic<std::uint64_t> h2d_bytes;   // host to device: results copied back
  std::atomic<std::uint64_t> d2h_copies;  // how many copies of each (one a collective, or a piece)
  std::atomic<std::uint64_t> h2d_copies;
  // Where its device all-reduces are summed (node_reduce): 0 not decided yet, 1 host, 2 the GPU
  // step, 3 host because the GPU step could not be had.
  std::atomic<std::uint32_t> node_reduce;
};
static_assert(sizeof(DeviceCounts) == 64, "the channel's layout holds 64 bytes of device counts");
inline std::size_t counts_offset() { return stream_offset() + sizeof(StreamShared); }
inline DeviceCounts* device_counts(std::uint8_t* channel_base) {
  return reinterpret_cast<DeviceCounts*>(channel_base + counts_offset());
}
constexpr std::uint64_t kStreamBusy = UINT64_MAX;  // out_seq while the daemon rewrites the block
constexpr std::uint64_t kStreamAll = UINT64_MAX;   // in_bytes: every byte is in place
// All-reduces of at least this many bytes stream on one node (both sides read this one constant).
constexpr std::uint64_t kStreamMinBytes = std::uint64_t{1} << 20;
// The input ring of a streaming all-reduce (its input slot, when the buffer is larger). The daemon
// cuts one node's reductions into chunks of a power of two no larger than half of it (LocalPlane), so
// a chunk never wraps round the ring's end and two can be reduced while the next is copied in.
constexpr std::uint64_t kStreamRingBytes = std::uint64_t{4} << 20;
constexpr std::uint64_t kStreamChunkMax = kStreamRingBytes / 4;
// How much a streaming copy-in copies between two publications of its progress.
constexpr std::uint64_t kStreamStepBytes = 256 << 10;
// Whether a collective of `kind` (a wire code) and `nbytes` streams, in a job of one node: the one
// rule the worker (start, finish) and the daemon (on_submit, new_op_locked) both follow.
inline bool streams(std::uint8_t kind, std::uint64_t nbytes) {
  return kind == static_cast<std::uint8_t>(Kind::kAllreduce) && nbytes >= kStreamMinBytes;
}
// One look of a streaming wait (the worker's stream_room and stream_out, the daemon's inputs_in)
// that found nothing: a yield while less than `spin_ns` has passed since `since`, else a 20 us nap,
// since the threads it waits for need the core more than it does.
inline void stream_pause(std::chrono::steady_clock::time_point since, std::int64_t spin_ns) {
  if (std::chrono::steady_clock::now() - since < std::chrono::nanoseconds(spin_ns))
    sched_yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(20));
}
inline std::uint64_t stream_ring_bytes(std::uint64_t nbytes) {
  return nbytes < kStreamRingBytes ? nbytes : kStreamRingBytes;
}
inline StreamShared* stream_block(std::uint8_t* channel_base) {
  return reinterpret_cast<StreamShared*>(channel_base + stream_offset());
}
// Whether a streamed collective `seq`'s input is in place up to `end` bytes, as `b` says.
inline bool stream_in_ready(const StreamShared& b, std::uint64_t seq, std::uint64_t end) {
  const std::uint64_t s = b.in_seq.load(std::memory_order_acquire);
  if (s != seq) return s > seq;  // a later one started: this one's copy-in had ended
  // in_bytes went to 0 before in_seq moved on, so a value read after in_seq == seq is this one's or
  // a later one's 0: never more than this one's.
  const std::uint64_t n = b.in_bytes.load(std::memory_order_acquire);
  return n >= end;
}

struct Located;

// Where a held delivery's result goes on from the channel (the device path's copy back,
// device_path.h): told where the result lies by whichever taker checked its DONE, on that taker's
// thread with none of the channel's locks held, before its collective completes. It sends the
// RELEASE itself, once it has read the result. `result` is the result's first byte, in `seg` (held by
// the caller for the call); *why set: it could not go on (the caller's collective fails with it).
class HeldSink {
 public:
  virtual ~HeldSink() = default;
  virtual void arrived(const Header& submit, const std::uint8_t* result, const Located& at,
                       const std::shared_ptr<Segment>& seg, std::string* why) = 0;
};

// Where a fast collective's result goes, for every kind alike: `nbytes` from `src_offset` of its
// result (`result_bytes` in all: the range the DONE names, and what its RELEASE gives back) to `dst`.
// An all-reduce takes its whole result back into its input; an all-gather the world's blocks into
// another buffer; a reduce-scatter its own shard; a broadcast's root and a barrier nothing.
struct Delivery {
  std::uint8_t* dst = nullptr;
  std::uint64_t nbytes = 0;
  std::uint64_t src_offset = 0;
  std::uint64_t result_bytes = 0;
  // A device collective's (reserve(true)): its DONE is checked and its result's range located
  // (Located), nothing is copied here and no RELEASE goes: the caller copies the result to the
  // device and RELEASEs it (release(..., -1, ...)) once that copy is done.
  bool hold = false;
  // A held delivery's way on (its record's, set before its SUBMIT goes): told where the result lies
  // (Located::sunk), it copies and RELEASEs. None: the caller of the wait or pop that located it does.
  std::shared_ptr<HeldSink> sink = nullptr;
};

// Where a held delivery's result lies: `nbytes` (its result_bytes) from `offset` of result segment
// `segment` (result()), the range checked against that segment's size.
struct Located {
  bool held = false;  // set by a held delivery: the three below say where
  std::uint32_t segment = 0;
  std::uint64_t offset = 0;
  std::uint64_t nbytes = 0;
  bool sunk = false;  // its Delivery's sink was told (and `why` says why it could not go on, if it could not)
  std::string why = std::string();
};

// One piece of what a fast collective sends: `nbytes` at `data` (the caller's memory).
struct Source {
  const std::uint8_t* data = nullptr;
  std::uint64_t nbytes = 0;
};

// The timelines' clock (the plane's traces and the channel's): wall-clock seconds, as Python's time.time().
inline double wall() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// One fast collective's phases on this worker, for the timeline (WorkerChannel::set_trace), in
// wall-clock seconds: start() entered, its SUBMIT pushed, its DONE met by deliver(), its result copied.
struct ChannelTrace {
  std::uint64_t seq = 0;
  std::uint8_t kind = 0;
  std::uint8_t dtype = 0;
  std::uint64_t count = 0;
  double start = 0;
  double submitted = 0;
  double done = 0;
  double copied = 0;
};
// Traces kept between two takes; past this the newest are counted (take_traces' *dropped), not kept.
constexpr std::size_t kMaxChannelTraces = std::size_t{1} << 20;

// How a fast-path call ended.
enum class FastEnd {
  kDone,      // finish: the result is in place, the slot freed, its RELEASE held or sent
  kTimeout,   // finish: not complete in time, or the channel aborted; the collective stays parked (unblock, adopt)
  kRingFull,  // start: the daemon left the submit ring full for the whole timeout (nothing was pushed)
  kRefused,   // why(): a broken ring, a DONE that does not match, or a range outside its segment
  kGone,      // finish: not (or no longer) the fast path's: an asynchronous one's DONE went the general way
  kHeld,      // start: starts are closed (the client is shutting down): nothing pushed, nothing kept
  kArena,     // start: the arena could not give a slot (why() says why; not the daemon's fault)
  kBacklog,   // start: kMaxInFlight collectives before it had no DONE for the whole timeout (backlog_why())
};

class WorkerChannel {
 public:
  // A new channel segment (sealed memfd) with both rings reset; nullptr and *why on failure.
  static std::unique_ptr<WorkerChannel> create(const std::string& name, std::string* why);
  ~WorkerChannel();
  const std::shared_ptr<Segment>& segment() const { return seg_; }
  // The daemon's end of the side socket, to pass with CHANNEL; -1 once closed here (after passing it).
  int daemon_end() const { return daemon_end_; }
  void close_daemon_end();

  // ATTACH of input segment `seg` (`rank`'s): its fd on the side socket, then the descriptor on the
  // submit ring, in the ring's order with every other push. kCorrupt (why()) if the fd cannot go;
  // kReady, with nothing pushed, when the daemon's end has closed (its plane is gone: the unix
  // socket says why).
  RingWait attach(const Segment& seg, std::uint32_t rank, std::int64_t timeout_ns, std::int64_t spin_ns);
  // A slot of `nbytes` from `arena` for a SUBMIT of `rank`'s, its segment ATTACHed first when the
  // arena made it for this slot (*fresh), all under the push lock: whichever thread allocates, no
  // SUBMIT naming a segment goes ahead of its ATTACH. Not kReady: nothing is kept (the slot is given
  // back); an arena that cannot grow is kCorrupt with *arena_why set (else why() says why).
  RingWait alloc(Arena& arena, std::uint64_t nbytes, std::uint32_t rank, std::int64_t timeout_ns,
                 std::int64_t spin_ns, Slot* slot, std::shared_ptr<Segment>* fresh, std::string* arena_why);

  // Sequence numbers are the channel's: SUBMITs go on the ring in their order, from 1, whatever
  // order they are given in. reserve() hands the general way its next one; its SUBMIT follows
  // through push() when the caller has it ready (a device one once its copy-in is complete), in any
  // order: one given while a SUBMIT before it is still reserved waits in the channel (queued_), and
  // so does a fast start() then (it takes the next number all the same). The push that gives the
  // last reserved SUBMIT before them pushes them.
  std::uint64_t reserve();
  // A reserved sequence number whose collective is the fast path's from the start (a device one):
  // registered as an asynchronous fast collective before its SUBMIT can go, so its DONE is kept for
  // its finish() or completed by collect()'s taker like any other; its SUBMIT follows through give().
  std::uint64_t reserve_fast();
  // The SUBMIT of a reserve_fast() number, given when its caller has it ready (a device copy-in
  // complete), in any order: it goes on the ring in its place (as push() does). kCorrupt (why()) for
  // a SUBMIT that is not such a number's, was given already, or does not encode.
  // *backlog (if given) is set when it timed out waiting for earlier collectives' DONEs (make_room).
  RingWait give(const Header& submit, std::int64_t timeout_ns, std::int64_t spin_ns, bool* backlog = nullptr);
  // How many fast starts waited in the channel so far (kSubmitWindow past a reserved SUBMIT).
  std::uint64_t queued_starts();
  // No fast collective starts from now on (start() answers kHeld): the client is shutting down,
  // and its BYE must be the last descriptor.
  void close_starts();
  // The sequence numbers of the blocking fast collectives started and not finished (or adopted).
  std::vector<std::uint64_t> blocking();
  // Result segment `id`, if the daemon has sent it (a DONE names only one it has).
  std::shared_ptr<Segment> result(std::uint32_t id);

  // Pushes the held RELEASEs, then one 56-byte header; kTimeout when the daemon left the ring full,
  // kCorrupt (why()) when the ring is broken. A SUBMIT pushed here is collected the general way; it
  // waits in the channel while a SUBMIT before it is still reserved (kReady all the same).
  RingWait push(const std::uint8_t* header, std::int64_t timeout_ns, std::int64_t spin_ns);
  // The same without waiting at all: kTimeout when the ring is full, another thread is pushing, or
  // SUBMITs wait in the channel (push() then, which has a timeout for their room).
  RingWait try_push(const std::uint8_t* header);
  // RELEASE of `seq`'s result slot of `nbytes` from `rank`: held to go ahead of the next push while
  // the held results stay within `batch_bytes` (nbytes < 0: never held), else pushed now with the
  // held ones.
  RingWait release(std::uint32_t rank, std::uint64_t seq, std::int64_t nbytes, std::uint64_t batch_bytes,
                   std::int64_t timeout_ns, std::int64_t spin_ns);

  // The background taker: pops the next DONE of a collective submitted the general way into `out`
  // (kSlotBytes); kTimeout when none came in time or the channel aborted. *completed
  // (if given) is true when that DONE was a collected fast collective's and it was completed here
  // (collect): its result is in place and its RELEASE held or sent.
  // A held delivery's (Delivery::hold) result is located in *at (if given) instead: not copied or RELEASEd.
  RingWait pop(std::uint8_t* out, std::int64_t timeout_ns, std::int64_t spin_ns, bool* completed = nullptr,
               Located* at = nullptr);

  // The fast path, first half: a slot for the `n` sources' bytes (alloc(); none when there are
  // none: a barrier, a broadcast's other ranks, whose slot is {kNoSegment, 0, 0}, never freed), the
  // sources copied into it one after another (a fused buffer's parts, never packed first), then,
  // under the push lock, the next sequence number and the held RELEASEs and the SUBMIT pushed.
  // `submit` gives its kind, dtype, op, count, aux and sender and comes back with its seq, shard
  // and offset, `slot` with its slot. From here the collective's DONE is this channel's to keep for
  // finish(); an `async` one's until collect() asks for it while no finish() waits for it.
  // A streamed all-reduce's result as copied out before its DONE: `bytes` of it from result slot
  // (`segment`, `offset`), whose memory is `src` here; the DONE must name that slot, and only the rest
  // is copied after it.
  struct Streamed {
    std::uint64_t bytes = 0;
    std::uint64_t segment = 0;
    std::uint64_t offset = 0;
    const std::uint8_t* src = nullptr;
    bool stopped = false;  // the DONE does the rest
  };
  // A blocking all-reduce that streams gives `back` (its finish's Delivery) and `got` (then finish's
  // `streamed`): while its copy-in waits for the reduction to free its ring, it copies the result
  // out behind it. (An `async` one streams through a whole slot and never waits.)
  FastEnd start(Arena& arena, const Source* src, std::size_t n, Header* submit, Slot* slot, std::int64_t timeout_ns,
                std::int64_t spin_ns, bool async = false, const Delivery* back = nullptr, Streamed* got = nullptr);
  // Second half: waits for `seq`'s DONE, checks it against `submit`, copies what `out` names of the
  // result to its destination, frees the slot and RELEASEs the result (held within `batch_bytes`);
  // a held delivery (Delivery::hold) copies nothing and RELEASEs nothing: its result is located in *at.
  // kTimeout leaves the collective parked until unblock(seq) or adopt(seq) (or, async, until a later finish or the
  // general way); kGone: its DONE went the general way (or it was never started here).
  FastEnd finish(Arena& arena, const Slot& slot, const Header& submit, const Delivery& out,
                 std::uint64_t batch_bytes, std::int64_t timeout_ns, std::int64_t spin_ns, Located* located = nullptr,
                 Streamed* streamed = nullptr);
  // What completing a collected collective takes: its SUBMIT's fingerprint and sender, where its
  // result goes, and its RELEASE's batch and timeout. `out.dst` is the caller's, kept alive (and
  // unmoved) by the caller until the collective completes or the channel is gone.
  struct Collected {
    Header submit;  // its SUBMIT's fingerprint (kind, dtype, count) and sender, as finish() takes it
    Delivery out;
    std::uint64_t batch_bytes = 0;
    std::int64_t timeout_ns = 0;
    // A native front end's (native_api.h): told on the taker's thread, with none of the channel's
    // locks held, once the result is delivered and its RELEASE held or sent (`why` empty), or why it
    // could not be, as an error of smddp.errors class `error_class` (ProtocolError: the channel's;
    // DeviceError: a held delivery's sink could not go on); pop() then goes on as if it had taken
    // nothing (the caller has nothing to do).
    std::function<void(const char* error_class, const std::string& why)> native = nullptr;
  };
  // An asynchronous one has callbacks waiting (and maybe no waiter ever): unless a finish() is
  // waiting for it when its DONE comes, the taker that hands that DONE out of pop() completes it as
  // `how` says; one parked goes now. Returns whether `how` was kept: not when the collective is no
  // longer the fast path's (finished, never started); not either when `how` names a destination
  // outside its result, and then its DONE comes out of pop() for the caller to complete.
  bool collect(std::uint64_t seq, const Collected& how);
  // A parked fast collective goes the general way from now on (the caller registered it): true and
  // its DONE in `out` if that had already come, else it is collected by pop() when it comes.
  bool adopt(std::uint64_t seq, std::uint8_t* out);
  // A parked blocking collective (its finish() timed out) is an asynchronous one from now on: a later
  // finish() or collect() completes it (its caller waits for it no more: the binding made a record of
  // it). False when it is no longer the fast path's.
  bool unblock(std::uint64_t seq);

  // Streaming (the stream block above): while on, a fast all-reduce of at least kStreamMinBytes
  // publishes its copy-in's progress as it copies (start), and its finish copies the result out
  // behind the daemon's reduction, before its DONE. On only in a job of one node, whose daemon
  // publishes the results (the client turns it on there; every rank of the node alike or not: each
  // worker's streaming is its own affair with its daemon).
  void set_stream(bool on) { stream_.store(on, std::memory_order_relaxed); }
  // Result bytes finish() copied out before their DONE, and copy-in bytes published as they went.
  std::uint64_t streamed_out() const { return streamed_out_.load(std::memory_order_relaxed); }
  std::uint64_t streamed_in() const { return streamed_in_.load(std::memory_order_relaxed); }

  // The device counts (DeviceCounts, in the channel for the daemon to show): a copy of `nbytes`
  // between a device and smddp's memory, device to host (`to_host`) or back. Any thread.
  void count_device(bool to_host, std::uint64_t nbytes) {
    (to_host ? counts_->d2h_bytes : counts_->h2d_bytes).fetch_add(nbytes, std::memory_order_relaxed);
    (to_host ? counts_->d2h_copies : counts_->h2d_copies).fetch_add(1, std::memory_order_relaxed);
  }

  // Where this worker's device all-reduces are summed (DeviceCounts::node_reduce), for the daemon to show.
  void set_node_reduce(std::uint32_t code) { counts_->node_reduce.store(code, std::memory_order_relaxed); }

  // The timeline: while on, every fast collective that completes here leaves its phases
  // (ChannelTrace) until take_traces().
  void set_trace(bool on) { trace_.store(on, std::memory_order_relaxed); }
  std::vector<ChannelTrace> take_traces(std::uint64_t* dropped);

  // Stops pops and fast waits (the job failed or the client closes): they return within one sleep slice.
  void abort();
  bool aborted() const { return aborted_.load(); }
  std::string why();
  // Why the last kBacklog (or give()'s *backlog) came: no DONE of the earlier collectives in time.
  std::string backlog_why();

 private:
  using Descriptor = std::array<std::uint8_t, kSlotBytes>;
  WorkerChannel(std::shared_ptr<Segment> seg, int side, int daemon_end);
  RingWait push_locked(const std::uint8_t* header, std::int64_t timeout_ns, std::int64_t spin_ns);
  // push_locked() of a SUBMIT, counted in submits_pushed_ before it goes (undone if it does not).
  RingWait push_submit_locked(const std::uint8_t* header, std::int64_t timeout_ns, std::int64_t spin_ns);
  // Where a descriptor a taker took off the ring goes (called with pop_mu_ held, decoding it once):
  // kKept, a SEGMENT taken into the result table or a fast collective's DONE kept in fast_ for its
  // finish(); kGeneral, the general way's (or not a frame: the caller refuses it); kBroken, a
  // SEGMENT refused (why() says why).
  enum class Route { kGeneral, kKept, kBroken };
  Route route(const Descriptor& d);
  bool may_yield() const { return fast_waiters_ > 0; }
  // With no lock held, before a SUBMIT goes: while kMaxInFlight SUBMITs are on the ring without their
  // DONE taken, this thread is a taker (as finish() is): it takes what the done ring holds, keeping
  // each fast collective's DONE for its finish() and handing the others to the background taker.
  // Else DONEs nobody waits for yet (asynchronous collectives not waited for, none collected) fill
  // the done ring, the daemon stops reading the submit ring until they are taken, and the next
  // SUBMIT waits for a ring nobody empties. kReady: there is room; kTimeout: none in time, or
  // aborted (aborted() says which; backlog_why() says why); kCorrupt: a broken ring or a refused SEGMENT (why()).
  RingWait make_room(std::uint32_t rank, std::int64_t timeout_ns, std::int64_t spin_ns);
  // One turn of a fast taker (finish, make_room), with pop_mu_ held by `lock` and nobody else
  // popping: pops the next descriptor (unlocked, at most `slice_ns`, spinning `spin_ns` first) and
  // routes it, a DONE of the general way's or a collected one's to kept_ for the background taker.
  // kReady: one was taken; kTimeout: none came (or aborted); kCorrupt: a broken ring or a refused
  // SEGMENT (why() says which).
  RingWait take_turn(std::unique_lock<std::mutex>* lock, std::int64_t slice_ns, std::int64_t spin_ns);
  std::uint64_t in_flight() const {
    // DONEs first: read after them, the count of SUBMITs is at least as large, unless the daemon
    // sent a DONE for nothing this worker pushed (the taker that meets it refuses it): then none.
    const std::uint64_t taken = dones_taken_.load(std::memory_order_acquire);
    const std::uint64_t pushed = submits_pushed_.load(std::memory_order_acquire);
    return pushed > taken ? pushed - taken : 0;
  }
  // With pop_mu_ held: wake the background taker if it can take something now; wake the fast waits.
  void wake_background();
  void wake_takers();
  FastEnd refused(const std::string& why);  // records why; kRefused
  FastEnd refused_by_arena(const std::string& why);  // records why; kArena
  // A SEGMENT some taker popped, taken in (its fd off the side socket); false: refused (why()).
  bool take_segment(const Header& h);

  std::shared_ptr<Segment> seg_;
  std::mutex push_mu_;  // guards the submit ring's producer side, held_, queued_ and the sequence numbers
  std::uint64_t next_seq_ = 1;
  std::set<std::uint64_t> reserved_;  // reserved (reserve, reserve_fast), not pushed yet
  std::set<std::uint64_t> reserved_fast_;  // those of reserve_fast(), for give()
  bool starts_closed_ = false;
  // attach() with push_mu_ held.
  RingWait attach_locked(const Segment& seg, std::uint32_t rank, std::int64_t timeout_ns, std::int64_t spin_ns);
  RingWait alloc_locked(Arena& arena, std::uint64_t nbytes, std::uint32_t rank, std::int64_t timeout_ns,
                        std::int64_t spin_ns, Slot* slot, std::shared_ptr<Segment>* fresh, std::string* arena_why);
  // With push_mu_ held: SUBMIT `seq` (`frame`) given, reserved no more. It goes on the ring now if
  // it is within the window (in_window_locked; and then those queued that the window now takes
  // follow it), else it waits in queued_.
  RingWait submit_locked(std::uint64_t seq, const std::uint8_t* frame, std::int64_t timeout_ns, std::int64_t spin_ns);
  // With push_mu_ held: the queued SUBMITs the window takes go, in order.
  RingWait drain_locked(std::int64_t timeout_ns, std::int64_t spin_ns);
  // With push_mu_ held: whether SUBMIT `seq` is less than kSubmitWindow past the lowest number not
  // on the ring yet (reserved and not given, or queued here; `seq` itself counts as not on it).
  bool in_window_locked(std::uint64_t seq) const;
  // SUBMITs given past the window: seq -> frame, pushed in seq order as the window moves up.
  std::map<std::uint64_t, std::array<std::uint8_t, kHeaderSize>> queued_;
  std::uint64_t queued_starts_ = 0;  // how many ever waited there (queued_starts())
  std::atomic<std::uint64_t> submits_pushed_{0};  // SUBMITs on the ring so far, each counted just before it goes (push_mu_ held)
  std::atomic<std::uint64_t> dones_taken_{0};     // DONEs taken off it so far (route(), with pop_mu_ held)
  RingView submit_;
  std::deque<std::array<std::uint8_t, kHeaderSize>> held_;  // RELEASEs waiting for the next push
  std::uint64_t held_bytes_ = 0;
  RingView done_;
  std::atomic<bool> aborted_{false};
  std::mutex pop_mu_;               // guards everything below
  std::condition_variable pop_cv_;  // the fast path's waits: the ring is free, a DONE was kept
  std::condition_variable bg_cv_;   // the background taker: something is there for it to take
  int bg_waiting_ = 0;              // background takers waiting on bg_cv_
  bool popping_ = false;            // a thread is inside done_.pop (it has one consumer)
  int fast_waiters_ = 0;            // threads inside finish()
  std::uint64_t general_out_ = 0;   // collectives pushed the general way whose DONE is not taken yet
  std::atomic<bool> yield_{false};  // the fast path wants the ring: a background pop gives it up
  // The fast path's spin adapts (finish): a spin that keeps missing the DONE only takes cores from
  // the threads the collective waits for, so after kSpinMisses misses in a row the next kSpinRest
  // waits sleep at once; then one spins again to see whether spinning pays once more.
  std::uint32_t spin_misses_ = 0;
  std::uint32_t spin_rest_ = 0;
  // DONEs of the general way (or collected) that a fast wait took: the background taker's, handed out first.
  std::deque<Descriptor> kept_;
  // Fast collectives started and not finished or adopted, with their DONE once some taker met it.
  struct Fast {
    bool came = false;  // its DONE was taken, and is in `done`
    Descriptor done{};
    bool async = false;   // started by start(..., async)
    bool wanted = false;  // collect(): counted in general_out_ until it is taken
    int waited = 0;       // threads in finish() for it
  };
  std::map<std::uint64_t, Fast> fast_;
  // Collected fast collectives (collect) whose DONE the taker that hands it out completes.
  std::map<std::uint64_t, Collected> collected_;
  // With pop_mu_ held by `lock`: completes the collected collective whose DONE is `d`, if it is one
  // (unlocking to copy and RELEASE); kReady and *done true when it did, kCorrupt when it refused.
  // One pop (pop() as it was before native front ends): *native when what it took was a native
  // front end's, completed through its hook (pop() then pops again, within its timeout).
  RingWait pop_once(std::uint8_t* out, std::chrono::steady_clock::time_point t0, std::int64_t timeout_ns,
                    std::int64_t spin_ns, bool* completed, Located* at, bool* native);
  // (*native: it was a native front end's, told through its hook: nothing for the caller.)
  RingWait complete_collected(const std::uint8_t* d, std::unique_lock<std::mutex>* lock, bool* done, Located* at,
                              bool* native);
  // `submit`'s DONE `h` taken, by its finish() or by a taker (collect): checked against `submit`,
  // `out` copied from its result, its RELEASE held or sent (held: located in *at, nothing else).
  // kCorrupt (why()) when refused; kTimeout when the RELEASE found the ring full for the whole timeout.
  RingWait deliver(const Header& h, const Header& submit, const Delivery& out, std::uint64_t batch_bytes,
                   std::int64_t timeout_ns, std::int64_t spin_ns, Located* at, const Streamed& streamed);
  // One look at the stream block for collective `seq`'s result: copies into `out` what the daemon
  // has published beyond what `got` has, without waiting. kMore: more is to come; kAll: every byte is
  // copied; kStop: the DONE does the rest (the block moved on to a later collective, or the result's
  // segment is not mapped here yet: its SEGMENT comes with the DONE).
  enum class Step { kMore, kAll, kStop };
  Step stream_step(std::uint64_t seq, const Delivery& out, Streamed* got, std::uint64_t limit);  // copies below `limit` only
  // finish()'s first part: stream_step until kAll or kStop, the wait's time is spent or the channel aborted.
  void stream_out(std::uint64_t seq, const Delivery& out, std::chrono::steady_clock::time_point t0,
                  std::int64_t timeout_ns, std::int64_t spin_ns, Streamed* got);
  // start()'s streaming copy-in, `done` bytes of `seq` in: waits until the daemon has reduced what
  // the next bytes, up to `end`, overwrite in the input ring of `ring` bytes (false: the channel
  // aborted or the time is spent, and the copy-in stops), copying the result out meanwhile, below
  // `done`, when `back` says where (a blocking call: `got`).
  bool stream_room(std::uint64_t seq, std::uint64_t done, std::uint64_t end, std::uint64_t ring,
                   std::chrono::steady_clock::time_point t0, std::int64_t timeout_ns, std::int64_t spin_ns,
                   const Delivery* back, Streamed* got);
  std::atomic<bool> stream_{false};
  std::mutex stream_mu_;  // one streaming copy-in at a time (in_seq/in_bytes have one writer); taken before push_mu_
  StreamShared* stream_block_;  // in seg_
  DeviceCounts* counts_;        // in seg_
  std::atomic<std::uint64_t> streamed_out_{0};
  std::atomic<std::uint64_t> streamed_in_{0};
  // The timeline (set_trace): start() notes when each collective started and was pushed, deliver()
  // turns that into its trace. trace_mu_ is taken alone, or inside push_mu_ (never the other way).
  std::atomic<bool> trace_{false};
  std::mutex trace_mu_;  // guards the three below
  std::map<std::uint64_t, std::pair<double, double>> begun_;  // seq -> (start, SUBMIT pushed)
  std::vector<ChannelTrace> traces_;
  std::uint64_t traces_dropped_ = 0;
  void traced(const Header& submit, std::uint64_t seq, double done, double copied);
  int side_ = -1;        // this worker's end of the side socket
  int daemon_end_ = -1;  // the daemon's, until passed
  std::mutex results_mu_;
  std::map<std::uint32_t, std::shared_ptr<Segment>> results_;
  std::mutex why_mu_;
  std::string why_;  // a refusal of the fast path (the rings keep their own)
  std::string backlog_why_;  // the last make_room() that timed out: which rank, how many, how long
};

}  // namespace smddp
