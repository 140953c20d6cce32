// One collective as a daemon sees it: the state machine without I/O (docs/engine.md, "State without I/O").
//
// Events in (a local rank submitted, a peer's frame claims a chunk, a chunk was received, reduced or
// sent, a rank released its result); answers out (is the frame one this collective expects and which
// chunk, what work is now ready, is the collective done, may its memory go). It owns no buffers,
// does no I/O and never blocks: whoever drives it (the daemon's data plane, LocalPlane in
// local_plane.cc) moves the bytes. Every value that came from the wire is checked here before the
// driver uses it to address memory. Not thread-safe: one driver at a time (the plane's lock).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layout.h"
#include "wire.h"  // Kind and kind_label: the wire's collective kinds

namespace smddp {

// Where this daemon sits in the job; the same for every collective.
struct Topology {
  std::uint32_t node = 0;
  std::uint32_t nnodes = 1;
  std::uint32_t local_size = 1;
  std::uint32_t world = 1;
  std::uint64_t chunk_bytes = 1 << 20;     // pipelining unit
  std::uint64_t replicate_bytes = 0;       // all-reduces of (nnodes - 1) * bytes <= this go replicated
  std::uint32_t first_rank = 0;            // the global rank of local rank 0
};

// What every rank must agree on (the fingerprint), plus the sequence number.
struct Spec {
  std::uint64_t seq = 0;
  std::uint8_t kind = 0;      // Kind
  std::uint32_t itemsize = 1;
  bool widened = false;       // summed in a wider type (float16, bfloat16): never reduced in place
  std::uint64_t count = 0;    // elements per rank (the input of reduce-scatter: world x its output)
  bool has_op = false;        // a reduce op is set
  std::uint32_t root = 0;     // broadcast: the root rank; all-reduce: the caller's piece count
  std::uint8_t dtype = 0;     // the wire's dtype code (fingerprint and messages; itemsize is what counts)
  std::uint8_t op = 0;        // the wire's reduce op code, 0 when has_op is false
  // A SUBMIT's kSubmitNodeSummed: each local input holds only its rank's slice of the node's sum
  // (summed on the GPUs). Not part of the fingerprint (a peer's frames never say it): the node's own
  // ranks must agree on it (Collective::note_node_summed).
  bool node_summed = false;
};

// One unit of work or of transfer: for reductions an element range of shard `shard`, for gathers a
// byte range of node `shard`'s block. `index` counts chunks within that shard or block.
struct Chunk {
  std::uint32_t shard = 0;
  std::uint64_t index = 0;
  std::uint64_t start = 0;
  std::uint64_t end = 0;
};

class Collective {
 public:
  // Why `spec` cannot be a collective of this job ("" if it can): the checks every first sight of a
  // collective passes, whether a local rank or a peer named it. The text follows "<who>: ".
  static std::string check(const Spec& spec, const Topology& topo);

  // Requires check(spec, topo) == "".
  Collective(const Spec& spec, const Topology& topo);

  const Spec& spec() const { return spec_; }
  bool same_fingerprint(const Spec& other) const;
  bool is_gather() const { return gather_; }
  bool replicated() const { return replicated_; }
  // Every local rank's SUBMIT says alike whether the node summed it on its GPUs: the first says it
  // for all; false when `v` says otherwise. node_summed(): what they said.
  bool note_node_summed(bool v) {
    if (node_summed_ < 0) node_summed_ = v ? 1 : 0;
    return node_summed_ == (v ? 1 : 0);
  }
  bool node_summed() const { return node_summed_ == 1; }
  // One worker on this node and a type reduced in place: its input is the node partial as it is, so
  // the sharded path sends it from the worker's memory instead of reducing it into a copy.
  bool own_in_input() const { return own_in_input_; }
  // Bytes of the result every local rank reads (a gather's whole output).
  std::uint64_t result_bytes() const;
  // The element range this node serves (its shard, or the whole buffer when replicated) and how many
  // nodes' partials of it are held: server rows of own_range() elements each; 0 when none are held.
  Range own_range() const { return {own_start_, own_end_}; }
  std::uint32_t server_rows() const { return has_server_ ? topo_.nnodes : 0; }
  bool server_live() const { return has_server_ && !server_freed_; }

  // A local rank submitted its input. Returns "" or why not; *all_in tells whether it was the last.
  std::string submit(std::uint32_t local_rank, const std::string& who, bool* all_in);
  bool submitted_by(std::uint32_t local_rank) const { return local_rank < submitted_by_.size() && submitted_by_[local_rank]; }
  std::uint32_t submitted() const { return submitted_; }

  // The work that starts once every local rank submitted, in the order to run it: for a sharded
  // reduction every shard's chunks interleaved (the next node's first) so that every server starts
  // early; for a replicated one the whole buffer's chunks; for a gather the chunks of our block.
  std::vector<Chunk> local_tasks() const;

  // Chunk `index` of what this node serves (its shard, the whole buffer when replicated, or its block).
  // Requires index < own_chunks().
  Chunk own_chunk(std::uint64_t index) const;
  std::uint64_t own_chunks() const { return own_chunks_; }

  // The chunk a PARTIAL from node `from` (named `who`) carries to us (`me`), or why it is not one.
  std::string locate_partial(std::uint32_t from, std::uint64_t shard, std::uint64_t offset, std::uint64_t length,
                             const std::string& who, const std::string& me, Chunk* out) const;
  // Node `from`'s partial of our chunk `index` is in place (its frame received, or ours reduced).
  // Returns "" or why not (the same chunk twice); *ready tells whether every node's partial is in.
  std::string partial_arrived(std::uint64_t index, std::uint32_t from, const std::string& who, bool* ready);
  // The chunk of the result a RESULT from `from` carries, marked as arriving; or why it is not one.
  std::string locate_result(std::uint32_t from, std::uint64_t shard, std::uint64_t offset, std::uint64_t length,
                            const std::string& who, Chunk* out);
  // The byte range of our result a BLOCK from `from` carries, marked as arriving; or why it is not one.
  std::string locate_block(std::uint32_t from, std::uint64_t offset, std::uint64_t length, const std::string& who,
                           Chunk* out);
  // Why a frame of wire type `type_name` does not fit this collective at all ("" if it may).
  std::string accepts(bool block, const char* type_name, const std::string& who) const;

  // A chunk is complete here (reduced by its server, received as a RESULT or BLOCK, or sent away
  // for good). Returns true exactly once: when the collective just became done. A non-replicated
  // collective's server rows are free from then on (nothing is sent from them).
  bool chunk_completed();
  bool done() const { return done_; }

  // A frame of this collective was handed to a peer's link, and later left.
  void send_started() { pending_sends_++; }
  bool send_finished();  // true when the collective may now retire

  // Local rank `local_rank` copied its result out. Returns "" or why not; *retire tells whether the
  // collective may now retire (every rank released, every send left): free its memory then.
  std::string release(std::uint32_t local_rank, const std::string& who, bool* retire);
  bool may_retire() const { return done_ && released_ == topo_.local_size && pending_sends_ == 0; }

  // Whether this collective still waits for a frame from peer node `j` (a partial, result or block).
  bool lacks_from(std::uint32_t j) const;
  // Nodes (not us) whose part has not arrived yet, in node order, for stall reports.
  std::vector<std::uint32_t> late_nodes() const;

 private:
  std::uint64_t chunks_of_shard(std::uint32_t j) const;  // reduction: shard j's chunk count (>= 1)
  std::uint64_t chunks_of_block(std::uint32_t j) const;  // gather: node j's block's chunk count (>= 1)
  std::string mark_arrived(std::uint32_t j, std::uint64_t index, const char* type_name, std::uint64_t offset,
                           std::uint64_t length, const std::string& who);

  Spec spec_;
  Topology topo_;
  bool gather_ = false;
  bool replicated_ = false;
  bool own_in_input_ = false;
  std::int8_t node_summed_ = -1;  // -1: no local SUBMIT yet
  std::uint32_t nshards_ = 1;        // reduction layout: shards
  std::uint64_t chunk_elems_ = 1;    // reduction layout: elements per chunk
  std::vector<Range> blocks_;        // gather layout: node j's block, bytes
  std::uint64_t own_start_ = 0;
  std::uint64_t own_end_ = 0;
  std::uint64_t own_chunks_ = 0;     // chunks of the range this node serves
  bool has_server_ = false;
  bool server_freed_ = false;
  std::uint64_t expected_ = 0;       // completions that make it done
  std::uint64_t completed_ = 0;
  std::uint32_t submitted_ = 0;
  std::vector<bool> submitted_by_;
  std::vector<bool> partial_seen_;   // own chunk i, node j: [i * nnodes + j]
  std::vector<std::uint32_t> partial_count_;
  std::vector<std::vector<bool>> arrived_;  // RESULT/BLOCK from node j: chunk index (sized on first use)
  std::vector<std::uint64_t> arrived_count_;
  std::uint64_t pending_sends_ = 0;
  std::uint32_t released_ = 0;
  std::vector<bool> released_by_;
  bool done_ = false;
};

}  // namespace smddp
