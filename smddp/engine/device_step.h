// The GPU step (docs/gpu.md, "Nodes with several GPUs"): a node's ranks sum a collective's device
// buffers on their GPUs, through each other's staging memory, with no host in between.
//
// Each rank owns one staging allocation on its device, shared once with the node's other ranks
// (CUDA IPC: its card carries the handle), laid out as a header of 32-bit flags, each on its own
// 128-byte line, then kSlots slots of slot_bytes:
//   in_ready   the last piece whose input sits in this rank's slot;
//   done       the last piece this rank has finished reading from every rank's slots;
//   out_ready  one per slot: the last piece in that slot whose slice this rank has reduced (and,
//              across nodes, brought back). One per slot because across nodes the slices come back
//              in the order their DONEs are taken, which need not be the pieces' order: a later
//              piece's out_ready must never stand for an earlier one's. A slot's pieces come back in
//              order (piece q + kSlots is sent only once every rank's done has reached q).
// A collective's buffer goes in pieces of at most slot_bytes, numbered 1, 2, ... in call order (the
// node's ranks call the same collectives in the same order, as every collective asks), piece q in
// slot q % kSlots. Local rank r's piece q, with slice j of a piece being elements
// [m*j/G, m*(j+1)/G) of its m:
//   in lane:  wait every rank's done >= q - kSlots (nobody still reads the slot); copy the piece into
//             the slot; write in_ready = q; wait every rank's in_ready >= q; fold slice r of the G
//             slots, in local-rank order, into this rank's slot (in place: only this rank reads slice
//             r of the slots); write out_ready = q;
//   gather lane: wait every rank's out_ready >= q; copy slice j of rank j's slot into the buffer, for
//             every j (copy engines, no SM); write done = q.
// The flags are written and waited on by the GPUs' streams (stream memory operations), so nothing
// of the node's ordering goes through a host, and a call enqueues everything at once; the gather lane
// is the in lane's own successor only through the flags, so that a piece's gather never holds back
// the next piece's copy and fold (two slots: a piece's fold overlaps the last one's gather).
//
// The other collectives go through the same slots and flags (one node: nothing crosses PCIe):
//   reduce-scatter: a piece is elements [a, b) of each rank's block; the slot holds the G blocks'
//             [a, b), one after another, so that slice r of the slot is block r's: the in lane folds
//             it as an all-reduce's, and the gather lane copies this rank's own slice alone out;
//   all-gather: no fold: the gather lane copies every rank's slot (its input's piece) into its place
//             in the output (copy engines alone: no SM);
//   broadcast: only the root fills its slot; the others' gather lanes copy it out.
// Every piece writes every flag (a flag is the last piece reached, waited for as ">="), so that
// collectives of every kind follow one another on the same flags. Every gather lane waits for this
// rank's own out_ready too (the broadcast's root, which copies nothing out, included): a call's end
// (its StepWork, on the gather lane) is then after its in lane's last read of the caller's buffers,
// which are the caller's again from there.
//
// Bits: the fold is the daemon's (kernels.cu): what the host path computes for the same buffers on
// one node, bit for bit.
//
// Threads: one caller at a time (the client's collective calls are serialised per rank: the order of
// calls is the pieces' numbering); StepWork from any thread. Memory: a DeviceStep owns its staging
// allocation, its two streams, the kernels' module and the peers' mappings (closed at its end, after
// its lanes have drained); a StepWork owns its event and shares the driver.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "fold_args.h"

namespace smddp {

// A node collective's end on the device: the event recorded on the gather lane after its last
// piece.
class StepWork {
 public:
  StepWork(std::shared_ptr<cuda::Driver> driver, int device, cuda::Event done);
  ~StepWork();
  StepWork(const StepWork&) = delete;
  StepWork& operator=(const StepWork&) = delete;
  // `stream`'s later work waits for it; the driver's error, if any.
  cuda::Result order(std::uintptr_t stream);
  // kSuccess once done, kNotReady before, or its failure.
  cuda::Result query();
  // Polls until done or `timeout_ns` has passed, yielding the core for `spin_ns` and then in short
  // sleeps (stream_pause, as DeviceIn::wait): query()'s last answer.
  cuda::Result wait(std::int64_t timeout_ns, std::int64_t spin_ns);
  cuda::Driver& driver() const { return *driver_; }

 private:
  const std::shared_ptr<cuda::Driver> driver_;
  const int device_;
  const cuda::Event done_;
};

class DeviceStep {
 public:
  static constexpr std::uint32_t kSlots = 2;
  static constexpr std::uint64_t kHeader = 512;  // the flags' lines, before the slots
  static constexpr std::uint32_t kMaxRanks = SMDDP_MAX_FOLD_INPUTS;
  static constexpr std::size_t kCardBytes = 128;

  // Local rank `local_rank` of `local_size` on `device`: its staging memory allocated and zeroed, its
  // lanes and kernels loaded. nullptr with *why: the driver lacks an entry point (named), refuses
  // the kernels' PTX, or an allocation.
  static std::unique_ptr<DeviceStep> create(std::shared_ptr<cuda::Driver> driver, int device,
                                            std::uint32_t local_rank, std::uint32_t local_size,
                                            std::uint64_t slot_bytes, std::string* why);
  ~DeviceStep();
  DeviceStep(const DeviceStep&) = delete;
  DeviceStep& operator=(const DeviceStep&) = delete;

  // What the node's other ranks need to reach this rank's staging memory (kCardBytes).
  std::string card() const;
  // Every rank's card, in local-rank order (this rank's own among them): the others' staging memory
  // opened (their devices must reach this one's: the same device, or peers). False with *why (a card
  // that is not one, of another layout, or that the driver will not open).
  bool join(const std::vector<std::string>& cards, std::string* why);

  // All-reduce of `n` elements of wire dtype `dtype` at device address `buf` (in place) across the
  // node's ranks, with wire op `op` (an average divided by `divisor`), after the work already on
  // `stream` where `after` (the caller's: an event of the step's own recorded there; else the buffer
  // is ready now, as its producer said): every piece enqueued, nothing waited for here. nullptr with *why (a refused call, a
  // dtype or op that has no kernel, or a step broken by an earlier failure: every later call is
  // refused, since the node's flags are then past repair).
  std::shared_ptr<StepWork> allreduce(cuda::DevicePtr buf, std::uint64_t n, std::uint8_t dtype, std::uint8_t op,
                                      std::uint64_t divisor, bool after, std::uintptr_t stream, std::string* why);

  // Reduce-scatter of each rank's `part` x G elements at `in` across the node's ranks (the node is
  // the job: block r of the sum is local rank r's), block `rank` of the sum written to `out` (`part`
  // elements; an average divided by `divisor`). As allreduce otherwise: `in` is only read.
  std::shared_ptr<StepWork> reduce_scatter(cuda::DevicePtr in, cuda::DevicePtr out, std::uint64_t part,
                                           std::uint8_t dtype, std::uint8_t op, std::uint64_t divisor, bool after,
                                           std::uintptr_t stream, std::string* why);
  // All-gather of each rank's `n` elements at `in` into `out` (G x `n` elements, local rank j's at
  // j x n), copies alone.
  std::shared_ptr<StepWork> allgather(cuda::DevicePtr in, cuda::DevicePtr out, std::uint64_t n, std::uint8_t dtype,
                                      bool after, std::uintptr_t stream, std::string* why);
  // Broadcast of local rank `root`'s `n` elements at `buf` into every other rank's `buf`.
  std::shared_ptr<StepWork> broadcast(cuda::DevicePtr buf, std::uint64_t n, std::uint8_t dtype, std::uint32_t root,
                                      bool after, std::uintptr_t stream, std::string* why);

  // Across nodes: the same, but each piece's fold leaves this rank's slice of the node's partial (an
  // average's sum: the daemons divide) in its slot, and `send` is called right after it is enqueued,
  // with what goes to the host (the slice) and the in lane, to enqueue its copy to the host there
  // (before the next piece's work: a later piece's waits must never hold it back). The slice's
  // reduced result is the caller's to bring back into the same place (Piece: back) and to follow
  // with out_ready = the piece's number on the back lane; the gather lane waits for every rank's as
  // before. *pieces gets each piece's part. nullptr with *why as allreduce's, or `send`'s refusal
  // (the step is broken then).
  struct Piece {
    std::uint64_t number = 0;      // the piece's number (what out_ready is set to once its slice is back)
    std::uint64_t count = 0;       // its elements (an all-gather's: of each rank's input)
    cuda::DevicePtr send = 0;      // what goes to the host (0: nothing, a broadcast's other ranks)
    std::uint64_t send_bytes = 0;
    cuda::DevicePtr back = 0;      // where this rank's slice of the piece's result comes back, in its slot
    std::uint64_t back_offset = 0;  // the slice's byte offset in the piece's result
    std::uint64_t back_bytes = 0;
    cuda::DevicePtr out_ready = 0;  // this rank's out_ready flag of the piece's slot (0: nothing comes back)
  };
  using Send = std::function<bool(const Piece& piece, cuda::Stream lane, std::string* why)>;
  std::shared_ptr<StepWork> allreduce_across(cuda::DevicePtr buf, std::uint64_t n, std::uint8_t dtype,
                                             std::uint8_t op, bool after, std::uintptr_t stream, const Send& send,
                                             std::vector<Piece>* pieces, std::string* why);
  // Across nodes, an all-gather of `world` ranks (this node's local ranks among them, each node's
  // in turn): each piece of this rank's `n` elements at `in` goes to the host whole (Piece: send),
  // the daemons gather the job's, and this rank's slice of the piece's result comes back into its
  // slot (Piece: back; the result's rows [l x N, (l+1) x N) for local rank l, N = world / G), then
  // out_ready; the gather lane copies every rank's rows into their places in `out` (world x n).
  std::shared_ptr<StepWork> allgather_across(cuda::DevicePtr in, cuda::DevicePtr out, std::uint64_t n,
                                             std::uint8_t dtype, std::uint32_t world, bool after,
                                             std::uintptr_t stream, const Send& send, std::vector<Piece>* pieces,
                                             std::string* why);
  // Across nodes, a reduce-scatter of `world` ranks' `part` x world elements at `in`: each piece is
  // [a, b) of every block, the slot holding the world blocks' [a, b) one after another; the node sums
  // them on its GPUs as an all-reduce's piece, and this rank's slice of the node's partial (blocks
  // [l x N, (l+1) x N) of the piece, N = world / G) goes to the host (Piece: send); the daemons
  // return block `rank` (the job's) of the piece's result, which comes back straight into `out`
  // (Piece: back), then out_ready; the gather lane copies nothing.
  std::shared_ptr<StepWork> reduce_scatter_across(cuda::DevicePtr in, cuda::DevicePtr out, std::uint64_t part,
                                                  std::uint8_t dtype, std::uint8_t op, std::uint32_t world,
                                                  std::uint32_t rank, bool after, std::uintptr_t stream,
                                                  const Send& send, std::vector<Piece>* pieces, std::string* why);
  // Across nodes, a broadcast from the job's root (`root`: this rank is it): the root's pieces go to
  // the host (the others send nothing), and each other rank's slice of each piece comes back into
  // its slot, then out_ready (the root copies its own slice into its slot on the device); the gather
  // lane copies every rank's slice into `buf` (the root's excepted).
  std::shared_ptr<StepWork> broadcast_across(cuda::DevicePtr buf, std::uint64_t n, std::uint8_t dtype, bool root,
                                             bool after, std::uintptr_t stream, const Send& send,
                                             std::vector<Piece>* pieces, std::string* why);
  // The elements of each piece a buffer of `n` elements of `itemsize` bytes goes in (a function of
  // n alone: every rank cuts alike). A reduce-scatter's pieces: piece_counts(part, itemsize x world);
  // an all-gather's across nodes: piece_counts(n, itemsize x world / G).
  std::vector<std::uint64_t> piece_counts(std::uint64_t n, std::size_t itemsize) const;
  // The stream a slice's way back runs on (the caller's copies and out_ready writes, across nodes).
  cuda::Stream back_lane() const { return back_lane_; }

  // Waits up to `timeout_ns` for the lanes to finish and for every other rank to have finished
  // reading this rank's slots (their done flags reach this rank's last piece), then lets go of
  // everything: true. False where that did not come in time: nothing is let go of then (a lane may
  // still wait for a peer, and freeing memory a peer still reads, or synchronising a lane that never
  // ends, would be worse than leaving it to the process's end). Idempotent once true.
  bool close(std::int64_t timeout_ns);

  std::uint64_t slot_bytes() const { return slot_bytes_; }
  std::uint32_t local_rank() const { return rank_; }
  std::uint32_t local_size() const { return size_; }
  int device() const { return device_; }
  std::uint64_t pieces() const { return next_piece_ - 1; }

 private:
  enum class Kind : std::uint8_t { kAllreduce, kReduceScatter, kAllgather, kBroadcast };
  // One call: `n` is the unit the pieces cut (all-reduce, broadcast: the buffer's elements;
  // reduce-scatter: a block's; all-gather: each rank's input's).
  struct Call {
    Kind kind = Kind::kAllreduce;
    cuda::DevicePtr in = 0;
    cuda::DevicePtr out = 0;
    std::uint64_t n = 0;
    std::uint8_t dtype = 0;
    std::uint8_t op = 0;
    std::uint64_t divisor = 0;
    std::uint32_t root = 0;      // one node: the broadcast's local rank
    bool is_root = false;        // across nodes: this rank is the broadcast's
    std::uint32_t rows = 1;      // world / G: an all-gather's rows a rank brings back, a reduce-scatter's blocks
    std::uint32_t rank = 0;      // across nodes: the job's rank (a reduce-scatter's block)
    const char* what = "all-reduce";
  };
  static Call call_of(Kind kind, cuda::DevicePtr in, cuda::DevicePtr out, std::uint64_t n, std::uint8_t dtype,
                      std::uint8_t op);
  // Whether a job of `world` ranks is whole nodes of this one's size, `rank` one of them; else *why.
  bool whole_nodes(std::uint32_t world, std::uint32_t rank, const char* what, std::string* why) const;
  DeviceStep() = default;
  std::shared_ptr<StepWork> enqueue(const Call& c, bool after, std::uintptr_t stream, const Send* send,
                                    std::vector<Piece>* pieces, std::string* why);
  cuda::DevicePtr slot(std::uint32_t rank, std::uint64_t piece) const;
  cuda::DevicePtr flag(std::uint32_t rank, int which) const;
  cuda::DevicePtr out_ready(std::uint32_t rank, std::uint64_t piece) const;  // piece's slot's
  // `height` rows of `width` bytes from `src` (rows `src_pitch` apart) to `dst` (`dst_pitch` apart)
  // on `lane`: one 2-D copy, or a copy a row where a pitch is past the largest a 2-D copy takes.
  cuda::Result copy_rows(cuda::DevicePtr dst, std::uint64_t dst_pitch, cuda::DevicePtr src, std::uint64_t src_pitch,
                         std::uint64_t width, std::uint64_t height, cuda::Stream lane) const;
  bool broken(std::string* why);
  void fail(std::string why);

  std::shared_ptr<cuda::Driver> driver_;
  int device_ = 0;
  std::uint32_t rank_ = 0;
  std::uint32_t size_ = 1;
  std::uint64_t slot_bytes_ = 0;
  cuda::DevicePtr stage_ = 0;  // its own
  std::vector<cuda::DevicePtr> stages_;  // every rank's, in local-rank order (its own among them)
  std::vector<bool> opened_;             // which of them it opened (closed at its end)
  cuda::Stream in_lane_ = nullptr;
  cuda::Stream gather_lane_ = nullptr;
  cuda::Stream back_lane_ = nullptr;  // across nodes: the slices' way back (the caller enqueues there)
  cuda::Module module_ = nullptr;
  cuda::Function fold_[8] = {};  // by wire dtype code
  std::uint64_t next_piece_ = 1;
  void release();
  bool joined_ = false;
  bool closed_ = false;
  std::string failure_;
};

}  // namespace smddp
