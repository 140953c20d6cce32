// The engine's C function table (capi.h) over a client's channel: host collectives started, waited
// for and completed with no Python, for native front ends (the C++ c10d backend).
//
// A work is one collective: one SUBMIT, or an all-reduce's pieces (the job's pipeline cut, as the
// Python calls make it, so that every rank cuts alike whichever front end it calls through). Each
// piece is a fast collective of the channel (WorkerChannel::start, asynchronous) and completes on
// the channel's one path: finish() in a wait, or, once a done callback is set (collect), whichever
// taker meets its DONE (the client's DONE thread), which delivers it and tells this table through
// the collected piece's hook (WorkerChannel::Collected::native) on that thread. The last piece in
// completes the work and calls its callback.
//
// Memory: NativeWorks is shared by the table's capsule and every work (a work holds it until it is
// released and complete); it holds the channel and arena by pointer, which the binding keeps alive
// as long as the capsule (module.cc). A work is freed when both references (the caller's, from
// start() to release(), and the engine's, until it completes or fails) are let go. The caller's
// buffers are the caller's; after a failure a piece still out is collected with no destination,
// so that its DONE, if one comes, is taken and RELEASEd and nothing is written.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "arena.h"
#include "capi.h"
#include "channel.h"
#include "device_path.h"

namespace smddp {

// What every start of the table shares, as the client's bind() gave the channel.
struct NativeConfig {
  std::uint32_t rank = 0;
  std::uint32_t world = 1;
  std::uint64_t batch_bytes = 0;    // the RELEASE batch
  std::int64_t timeout_ns = 0;      // the job's timeout: a wait's without one, a RELEASE's ring wait
  std::int64_t spin_ns = 0;         // how long a wait spins before it sleeps
  std::uint64_t piece_bytes = 0;    // an all-reduce of more goes in pieces (0: whole)
};

class NativeWorks;

}  // namespace smddp

// One collective started through the table (capi.h's opaque smddp_work).
struct smddp_work {
  struct Piece {
    std::uint64_t first = 0;  // its first element in the caller's buffers (an all-reduce's pieces)
    smddp::Header submit;
    smddp::Slot slot;
    smddp::Delivery out;
    bool started = false;  // its SUBMIT went, or (a device work's) was handed to the engine to give
    bool done = false;     // delivered (its slot freed), or given up on after the work failed
    // A device work's: its copy into its slot, and its way back (out.sink: the copy back).
    std::shared_ptr<smddp::DeviceIn> in;
    std::shared_ptr<smddp::DeviceOut> back;
  };
  std::shared_ptr<smddp::NativeWorks> owner;
  std::vector<Piece> pieces;
  int device = -1;  // a device work's CUDA device (start_device); -1: a host work
  std::atomic<int> refs{2};  // the caller's and the engine's
  std::mutex mu;             // guards what follows
  std::condition_variable cv;
  std::mutex wait_mu;        // one wait drives finish() at a time; others wait on cv
  int state = SMDDP_PENDING;
  std::size_t left = 0;      // pieces not done
  std::string why;           // FAILED: why, as smddp's error says it
  std::string error_class;   // FAILED: the smddp.errors class that error is
  smddp_done_fn fn = nullptr;
  void* arg = nullptr;
  bool collected = false;    // on_done asked the channel for its pieces
};

namespace smddp {

class NativeWorks : public std::enable_shared_from_this<NativeWorks> {
 public:
  NativeWorks(WorkerChannel* ch, Arena* arena, const NativeConfig& cfg);
  NativeWorks(const NativeWorks&) = delete;
  NativeWorks& operator=(const NativeWorks&) = delete;

  // The table (its ctx is this object), valid while this lives.
  const smddp_capi* table() const { return &table_; }
  const NativeConfig& config() const { return cfg_; }

  // The client failed, or is shut down: every work not complete fails with `why` (an error of
  // smddp.errors class `error_class`), its callback called, nothing more written into its
  // destination; start() answers CLOSED with `why` from now on.
  void fail_all(const std::string& error_class, const std::string& why);
  // Works started and not complete.
  std::size_t pending();
  // The failure a start or a wait met that fails the whole client (the daemon lost, a ring or frame
  // it broke), once, for the client to take (its DONE thread polls): (error class, why), or empty.
  std::pair<std::string, std::string> take_failure();

  // The client's device path (its DeviceEngine's, which the binding keeps alive as long as this
  // table): start_device runs on it from now on. Once; `path` outlives every work.
  void use_device(DevicePath* path);

  // The table's functions (capi.h), through their C entry points.
  int start(const smddp_collective& c, smddp_work** out, std::string* why);
  int start_device(const smddp_collective& c, const smddp_device_call& d, smddp_work** out, std::string* why);
  int device_order(smddp_work* w, std::uintptr_t stream, std::string* why);
  int device_query(smddp_work* w);
  int wait(smddp_work* w, double timeout_s);
  int status(smddp_work* w);
  int on_done(smddp_work* w, smddp_done_fn fn, void* arg);
  static void release(smddp_work* w);
  int abandon(smddp_work* w, const std::string& error_class, const std::string& why);

 private:
  // Piece `i` of `w` delivered (or, `why` set, refused by the channel): its slot freed where the
  // channel did not, and the work completed with its last.
  void piece_done(smddp_work* w, std::size_t i, bool free_slot, const std::string& error_class, const std::string& why);
  // Piece `p`'s DONE to whichever taker meets it, delivered to `out` and told to `hook` (the
  // channel's collect, with this table's RELEASE batch and timeout).
  void collect(const smddp_work::Piece& p, const Delivery& out,
               std::function<void(const char*, const std::string&)> hook);
  // A piece of `w` could not start: the work fails (the client too where `client`), or, the first,
  // goes unstarted (*why: the text). Returns what start() answers.
  int not_started(smddp_work* w, std::size_t i, const std::string& error_class, const std::string& text,
                  bool client, bool closed, std::string* why);
  // `w` is live from its first piece: a failure of the client from now on fails it too.
  void went_live(smddp_work* w);
  // A piece's input slot back to the arena, unless it has none.
  void free_slot(const Slot& slot);
  // `w` fails (unless complete): its pieces still out collected with no destination.
  void fail(smddp_work* w, const std::string& error_class, const std::string& why);
  // The client-wide failure noted for take_failure (the first one).
  void note_failure(const std::string& error_class, const std::string& why);
  // Calls `w`'s callback (outside every lock) and lets go of the engine's reference.
  static void finished(smddp_work* w, smddp_done_fn fn, void* arg, int state);
  static void unref(smddp_work* w);

  WorkerChannel* ch_;
  Arena* arena_;
  NativeConfig cfg_;
  smddp_capi table_{};
  std::mutex mu_;  // guards what follows
  DevicePath* path_ = nullptr;  // use_device's
  std::set<smddp_work*> live_;  // started, not complete (each holds the engine's reference)
  bool closed_ = false;
  std::string closed_class_;
  std::string closed_why_;
  std::string failure_class_;
  std::string failure_why_;
  bool failure_taken_ = false;
};

}  // namespace smddp
