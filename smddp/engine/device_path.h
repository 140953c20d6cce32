// The engine's device path: a device collective's steps that wait on the GPU, with no Python and no
// thread of the client's.
//
// - copy_in (a DeviceIn): a device collective's data copied into its input slot, on the stream the
//   client names (in line on the caller's, or its device's copy-in lane after the caller's event),
//   the event after it the engine's own, the input segment page-locked here once (portable);
// - give_when: a held SUBMIT goes the moment its copy-in's event is reached (DeviceWatch), in
//   whatever order the copies land (the channel puts them on the ring in sequence order);
// - DeviceOut, the channel's HeldSink for a device record: the moment its DONE is taken, on the
//   taker's thread (the wait, or the client's DONE thread), the result's copy back is enqueued on
//   the collective's stream (after the event it must wait for), the event its consumers wait on is
//   recorded after it, and its RELEASE goes from the watch thread once that event is reached, so the
//   daemon never reuses a result slot a copy still reads;
// - the input and result segments are page-locked here, each once (portable; a result segment
//   read-only), so that the copies are DMA, and let go at stop() once nothing copies to or from them.
// A copy that fails on the device, a copy back that cannot be enqueued, or a RELEASE that cannot go
// is kept as the path's failure (failure()): the client fails the job with it.
//
// Threads: every call from any thread; the watches' work on their threads. Engine code only: it never
// touches a Python object (the binding holds what keeps a copy's destination alive, by its token,
// and lets go of the tokens take_landed() gives back). Memory: a DevicePath owns the driver, the
// watches and the page-locked segments' registrations (holding each segment, so it stays mapped);
// the channel is the caller's and outlives it. A DeviceOut owns its `done` event, a DeviceIn its
// `copied` event and a hold on its segment (mapped while the copy may write it); both share the
// driver (their ends destroy their events through it, whenever those come: after the path's too).
// The path outlives a DeviceOut's work (the binding's records hold the path's owner), and keeps each
// DeviceIn until it has seen its copy land (settle() waits for those too).
//
// A DeviceOut owns the event it made for `done` and shares `before` (a DeviceMark) with whoever else
// waits for it (the collective's copy-in, its other pieces); the caller keeps the destinations alive
// until the copies have landed.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "channel.h"
#include "cuda_driver.h"
#include "device_watch.h"

namespace smddp {

class DevicePath;

// A point of a caller's stream (DevicePath::mark): the event the engine recorded there at a
// collective's call, which its copies in and back wait for (the caller's work on its buffers queued
// before it). Owns the event (destroyed at its end, through the shared driver, whenever that comes).
class DeviceMark {
 public:
  DeviceMark(std::shared_ptr<cuda::Driver> driver, int device, cuda::Event event);
  ~DeviceMark();
  DeviceMark(const DeviceMark&) = delete;
  DeviceMark& operator=(const DeviceMark&) = delete;
  cuda::Event event() const { return event_; }
  int device() const { return device_; }

 private:
  const std::shared_ptr<cuda::Driver> driver_;
  const int device_;
  const cuda::Event event_;
};

// One device collective's way back to the device.
class DeviceOut : public HeldSink, public std::enable_shared_from_this<DeviceOut> {
 public:
  // `nbytes` of the result from `offset` go to device address `dst`.
  struct Part {
    cuda::DevicePtr dst = 0;
    std::uint64_t offset = 0;
    std::uint64_t nbytes = 0;
  };
  // A 32-bit device word written on the copies' stream after them (addr 0: none): the GPU step's
  // out_ready, which its node's gather lanes wait for (device_step.h).
  struct Then {
    cuda::DevicePtr addr = 0;
    std::uint32_t value = 0;
  };
  // The copies run on `stream` of `device`, after `before` (nullptr: nothing; held until the copies
  // are enqueued), and an event of its own is recorded after them; the caller keeps the destinations
  // alive until the copies have landed (`token` names what it keeps alive until then).
  DeviceOut(DevicePath* path, int device, std::uintptr_t stream, std::shared_ptr<DeviceMark> before,
            std::vector<Part> parts, std::uint64_t token, Then then);
  ~DeviceOut() override;
  DeviceOut(const DeviceOut&) = delete;
  DeviceOut& operator=(const DeviceOut&) = delete;

  void arrived(const Header& submit, const std::uint8_t* result, const Located& at,
               const std::shared_ptr<Segment>& seg, std::string* why) override;
  // Its caller was told it failed (a wait that timed out): nothing is copied from now on, and its
  // RELEASE goes as soon as its DONE is taken.
  void drop() { dropped_.store(true, std::memory_order_release); }

  // After arrived(): `stream`'s later work waits for the copy back (nothing to do when the copies ran
  // on that stream, or nothing was copied); the driver's error, if any.
  cuda::Result order(std::uintptr_t stream);
  // kSuccess once the copy back has landed (or nothing was copied), kNotReady before, or its failure.
  cuda::Result query();
  // Blocks until the copy back has landed; kSuccess or its failure.
  cuda::Result synchronize();
  int device() const { return device_; }

 private:
  friend class DevicePath;
  DevicePath* path_;  // (alive while it copies and RELEASEs: its record holds the path's owner)
  const std::shared_ptr<cuda::Driver> driver_;  // (for its end, which may come after the path's)
  const int device_;
  const std::uintptr_t stream_;
  const std::shared_ptr<DeviceMark> before_;
  const std::vector<Part> parts_;
  const std::uint64_t token_;
  const Then then_;
  std::atomic<bool> dropped_{false};
  // Written once by arrived() (the DONE's taker), before its collective completes; read after that.
  // Its own (destroyed with it).
  std::atomic<cuda::Event> done_{nullptr};
};

// Event helpers the device path and the GPU step share. destroy_event: an event the engine owns,
// destroyed on whichever thread lets go of its owner last, with `device`'s context current.
void destroy_event(cuda::Driver& d, int device, cuda::Event ev);
// A new event recorded on `stream` (the current context's) into *ev; on failure none is left and
// *call names the driver call that failed.
cuda::Result record_new_event(const cuda::Api& api, cuda::Stream stream, cuda::Event* ev, const char** call);
// Polls `ev` until it is reached or `timeout_ns` has passed, yielding the core for `spin_ns` and then
// in short sleeps (stream_pause), so that the caller keeps its timeout: the last query's answer.
cuda::Result poll_event(cuda::Driver& d, cuda::Event ev, std::int64_t timeout_ns, std::int64_t spin_ns);

// One device collective's copy into its input slot, enqueued by DevicePath::copy_in.
class DeviceIn {
 public:
  // (the driver is shared: a DeviceIn may end after its path, its Python owner let go of last)
  DeviceIn(std::shared_ptr<cuda::Driver> driver, int device, cuda::Event copied, std::shared_ptr<Segment> seg);
  ~DeviceIn();
  DeviceIn(const DeviceIn&) = delete;
  DeviceIn& operator=(const DeviceIn&) = delete;

  // kSuccess once the copy has landed, kNotReady before, or its failure.
  cuda::Result query();
  // Polls until the copy has landed or `timeout_ns` has passed, yielding the core for `spin_ns` and
  // then in short sleeps (so that the caller keeps its timeout): query()'s last answer.
  cuda::Result wait(std::int64_t timeout_ns, std::int64_t spin_ns);
  cuda::Event event() const { return copied_; }
  int device() const { return device_; }
  cuda::Driver& driver() const { return *driver_; }

 private:
  friend class DevicePath;
  std::atomic<bool> watched_{false};  // give_when's watch has it (pending() counts that watch instead)
  const std::shared_ptr<cuda::Driver> driver_;
  const int device_;
  const cuda::Event copied_;
  const std::shared_ptr<Segment> seg_;
};

class DevicePath {
 public:
  // The driver `library` loaded (Driver::load); the RELEASEs go on `channel` with the job's
  // `batch_bytes`, `timeout_ns` and `spin_ns`; the watches spin `watch_spin_ns`. nullptr with *why.
  static std::unique_ptr<DevicePath> load(const std::string& library, WorkerChannel* channel,
                                          std::uint64_t batch_bytes, std::int64_t timeout_ns, std::int64_t spin_ns,
                                          std::int64_t watch_spin_ns, std::string* why);
  ~DevicePath();  // stop(false)
  DevicePath(const DevicePath&) = delete;
  DevicePath& operator=(const DevicePath&) = delete;

  cuda::Driver& driver() { return *driver_; }
  // The driver, for what must reach it after the path has gone (a DeviceIn's or DeviceOut's end).
  const std::shared_ptr<cuda::Driver>& shared_driver() const { return driver_; }

  // An event recorded now on `stream` of `device` (the caller's, at a collective's call): what its
  // copies wait for. nullptr with *why (the driver's refusal).
  std::shared_ptr<DeviceMark> mark(int device, std::uintptr_t stream, std::string* why);
  // `device`'s lanes, the engine's own non-blocking streams for a native front end's collectives
  // (capi.h's start_device): into *in (copies to the host) and *back (copies back), made on first
  // use and destroyed at the path's end (the driver lets a stream's last work finish first). False
  // with *why (the driver's refusal, or a stopped path).
  bool lanes(int device, std::uintptr_t* in, std::uintptr_t* back, std::string* why);
  // Whether `stream` of `device` is capturing a CUDA graph (active, or invalidated: either way nothing
  // of a collective's may go on it) into *yes; kSuccess or the driver's refusal. The default and
  // legacy streams are never asked (they cannot capture).
  cuda::Result capturing(int device, std::uintptr_t stream, bool* yes);

  // Enqueues the copy of `nbytes` from device address `src` into `seg` at `offset` (checked against
  // the segment), on `stream` of `device` after `before` (nullptr: nothing), and an event of its own
  // recorded after it; `seg` page-locked first (once; one that cannot be is copied into as it is,
  // the driver then blocking this thread until the copy is done, and noted). nullptr with *why (the
  // driver's refusal, or a stopped path): nothing is left to land then but what the driver took.
  // `seg` nullptr with `nbytes` 0: no copy, only the event (the point of `stream` a SUBMIT that sends
  // nothing waits for: a GPU step broadcast's other ranks, device_step.h).
  std::shared_ptr<DeviceIn> copy_in(int device, std::uintptr_t stream, const DeviceMark* before,
                                    const std::shared_ptr<Segment>& seg, std::uint64_t offset,
                                    cuda::DevicePtr src, std::uint64_t nbytes, std::string* why);

  // Gives `submit` (a reserve_fast() number's) once `in`'s copy has landed; its ring wait takes
  // `timeout_ns` and `spin_ns`. False once stopped (nothing will give it).
  bool give_when(const Header& submit, std::shared_ptr<DeviceIn> in, std::int64_t timeout_ns,
                 std::int64_t spin_ns);

  // The first failure (kind 1: the device's, a copy; kind 2: the daemon's ring), or kind 0.
  std::pair<int, std::string> failure();
  // Tokens of copies back that have landed (or were dropped) since the last call.
  std::vector<std::uint64_t> take_landed();
  // What the path would say in the log (a segment it could not page-lock), since the last call.
  std::vector<std::string> take_notes();
  // Watches not yet ended and copies in not yet seen landed: copies in and back in flight.
  std::size_t pending();
  // Waits up to `timeout_ns` for pending() to reach 0; whether it did.
  bool settle(std::int64_t timeout_ns);
  // Ends the watches (those pending end unseen: nothing is given or RELEASEd from now on); `unpin`:
  // and lets go of the page-locked segments (only once nothing copies from them). Idempotent.
  void stop(bool unpin);

 private:
  friend class DeviceOut;
  friend class DeviceIn;
  DevicePath() = default;
  DeviceWatch* watch_for(int device);
  void fail(int kind, std::string why);
  // (mu_ held) The copies in seen landed (or failed) leave ins_, into *gone: the caller lets go of
  // them once the lock is let go (their ends destroy their events).
  void drop_landed_locked(std::vector<std::shared_ptr<DeviceIn>>* gone);
  // `seg` page-locked (each once; one that cannot be is copied to or from as it is, noted): an input
  // segment (the device writes it) or a result segment (read-only).
  void pin(const std::shared_ptr<Segment>& seg, int device, bool input);
  // `out`'s copy back reached (or failed, or the watch was stopped: r).
  void copied(const std::shared_ptr<DeviceOut>& out, const Header& submit, cuda::Result r);
  void release(const Header& submit);
  void landed(std::uint64_t token);

  std::shared_ptr<cuda::Driver> driver_;
  WorkerChannel* channel_ = nullptr;
  std::uint64_t batch_bytes_ = 0;
  std::int64_t timeout_ns_ = 0;
  std::int64_t spin_ns_ = 0;
  std::int64_t watch_spin_ns_ = 0;
  std::mutex mu_;  // everything below
  std::map<int, std::unique_ptr<DeviceWatch>> watches_;
  int failure_kind_ = 0;
  std::string failure_;
  bool stopped_ = false;
  std::vector<std::uint64_t> landed_;
  std::vector<std::string> notes_;
  struct Pinned {
    std::shared_ptr<Segment> seg;  // kept mapped while registered
    int device = 0;                // whose context registered it
    bool registered = false;       // false: it could not be (copied from as it is)
  };
  std::map<std::pair<bool, std::uint32_t>, Pinned> pinned_;  // (input?, segment id) -> its registration
  std::vector<std::shared_ptr<DeviceIn>> ins_;               // copies in not yet seen landed
  std::map<int, std::pair<cuda::Stream, cuda::Stream>> lanes_;  // device -> (in, back): lanes()
  std::mutex pin_mu_;                       // one registration at a time (taken before mu_, never inside it)
};

}  // namespace smddp
