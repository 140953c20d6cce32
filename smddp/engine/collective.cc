// The collective state machine: layouts, arrivals, completion and release, checked, without I/O.
#include "collective.h"

namespace smddp {
namespace {

constexpr std::uint64_t kMaxCollectiveBytes = std::uint64_t{1} << 40;
// The bookkeeping of a collective's chunks is allocated when it is created (a count and a bit per
// node for each chunk this node serves), before any data: 2**24 chunks bound it to 64 MiB + 2 MiB
// per node, whatever a peer's frame or a worker's submit says. At the daemon's smallest chunk (4 KiB)
// that is a 64 GiB collective; at its default (1 MiB) the 1 TiB bound comes first.
constexpr std::uint64_t kMaxChunks = std::uint64_t{1} << 24;

std::string num(std::uint64_t v) { return std::to_string(v); }

bool reduces(std::uint8_t kind) {
  return kind == static_cast<std::uint8_t>(Kind::kAllreduce) || kind == static_cast<std::uint8_t>(Kind::kReduceScatter);
}

bool is(std::uint8_t kind, Kind k) { return kind == static_cast<std::uint8_t>(k); }

std::uint64_t chunks_in(std::uint64_t length, std::uint64_t unit) {
  return length == 0 ? 1 : length / unit + (length % unit != 0 ? 1 : 0);
}

}  // namespace

std::string Collective::check(const Spec& s, const Topology& t) {
  const char* label = kind_label(s.kind);
  if (label == nullptr) return "collective #" + num(s.seq) + " of unknown kind " + num(s.kind);
  if (s.itemsize == 0 || t.nnodes == 0 || t.local_size == 0 || std::uint64_t{t.world} != std::uint64_t{t.nnodes} * t.local_size ||
      t.node >= t.nnodes || t.chunk_bytes == 0)
    return "collective #" + num(s.seq) + " in an impossible job layout";
  if (reduces(s.kind) && !s.has_op) return "collective #" + num(s.seq) + " (" + label + ") without a reduce op";
  if (!reduces(s.kind) && s.has_op) return "collective #" + num(s.seq) + " (" + label + ") carries a reduce op";
  if (is(s.kind, Kind::kBroadcast) && s.root >= t.world) return "broadcast root " + num(s.root) + " out of range";
  // An all-reduce's root field counts the pieces of the caller's buffer (pipelined), so that ranks
  // that cut different buffers into equal pieces still disagree on the fingerprint.
  if (!is(s.kind, Kind::kBroadcast) && !is(s.kind, Kind::kAllreduce) && s.root != 0)
    return std::string("root set on ") + label;
  if (is(s.kind, Kind::kReduceScatter) && s.count % t.world != 0)
    return "reduce_scatter of " + num(s.count) + " elements over " + num(t.world) + " ranks";
  if (is(s.kind, Kind::kBarrier) && s.count != 0) return "barrier with data";
  // count * itemsize * (world for allgather), without overflowing: each factor bounds the next.
  const std::uint64_t times = is(s.kind, Kind::kAllgather) ? t.world : 1;
  if (s.count > kMaxCollectiveBytes || s.count * s.itemsize > kMaxCollectiveBytes ||
      s.count * s.itemsize * times > kMaxCollectiveBytes)
    return "collective #" + num(s.seq) + " is larger than 1 TiB";
  // Bounds the engine's bookkeeping (kMaxChunks says why).
  if (s.count * s.itemsize * times / t.chunk_bytes > kMaxChunks)
    return "collective #" + num(s.seq) + " would be cut into more than 2**24 chunks (raise --chunk-kb)";
  return {};
}

Collective::Collective(const Spec& spec, const Topology& topo) : spec_(spec), topo_(topo) {
  const std::uint32_t n = topo.nnodes;
  const std::uint64_t nbytes = spec.count * spec.itemsize;
  submitted_by_.assign(topo.local_size, false);
  released_by_.assign(topo.local_size, false);
  arrived_.resize(n);
  arrived_count_.assign(n, 0);
  gather_ = is(spec.kind, Kind::kBroadcast) || is(spec.kind, Kind::kAllgather);
  if (gather_) {
    if (is(spec.kind, Kind::kAllgather)) {
      const std::uint64_t per_node = nbytes * topo.local_size;
      for (std::uint32_t j = 0; j < n; j++) blocks_.push_back({j * per_node, (j + 1) * per_node});
    } else {
      // Only the root's node has data; every other node sends one empty block, so each node sees
      // every other's fingerprint (a disagreement about the root is caught, never waited on).
      const std::uint32_t root_node = spec.root / topo.local_size;
      for (std::uint32_t j = 0; j < n; j++) blocks_.push_back(j == root_node ? Range{0, nbytes} : Range{nbytes, nbytes});
    }
    for (std::uint32_t j = 0; j < n; j++) expected_ += chunks_of_block(j);
    own_start_ = blocks_[topo.node].start;
    own_end_ = blocks_[topo.node].end;
    own_chunks_ = chunks_of_block(topo.node);
    return;
  }
  chunk_elems_ = topo.chunk_bytes / spec.itemsize > 0 ? topo.chunk_bytes / spec.itemsize : 1;
  // Latency-bound all-reduces (and barriers) go replicated: every node gets every node's whole
  // partial and reduces all of it in node order, one network step instead of two.
  replicated_ = n > 1 && (is(spec.kind, Kind::kAllreduce) || is(spec.kind, Kind::kBarrier)) &&
                nbytes <= topo.replicate_bytes / (n - 1);  // (n - 1) x nbytes out, not overflowing
  nshards_ = replicated_ ? 1 : n;
  const Range own = shard_range(spec.count, nshards_, replicated_ ? 0 : topo.node);
  own_start_ = own.start;
  own_end_ = own.end;
  own_chunks_ = chunks_of_shard(replicated_ ? 0 : topo.node);
  if (replicated_) {
    expected_ = own_chunks_;  // completed by our server reduces only
  } else {
    // Every chunk completes exactly once here: by our local reduce (one node, or a reduce-scatter
    // partial that left for its server), by our server reduce, or by a RESULT from its server.
    // Counting the partials too means a collective is never done while a local task still reads it.
    for (std::uint32_t j = 0; j < n; j++) expected_ += chunks_of_shard(j);
    own_in_input_ = n > 1 && topo.local_size == 1 &&
                    (is(spec.kind, Kind::kAllreduce) || is(spec.kind, Kind::kReduceScatter)) && !spec.widened;
  }
  if (n > 1) {
    has_server_ = true;
    partial_seen_.assign(own_chunks_ * n, false);
    partial_count_.assign(own_chunks_, 0);
  }
}

std::uint64_t Collective::chunks_of_shard(std::uint32_t j) const {
  const Range r = shard_range(spec_.count, nshards_, j);
  return chunks_in(r.end - r.start, chunk_elems_);
}

std::uint64_t Collective::chunks_of_block(std::uint32_t j) const {
  return chunks_in(blocks_[j].end - blocks_[j].start, topo_.chunk_bytes);
}

bool Collective::same_fingerprint(const Spec& o) const {
  return o.kind == spec_.kind && o.itemsize == spec_.itemsize && o.widened == spec_.widened &&
         o.count == spec_.count && o.has_op == spec_.has_op && o.root == spec_.root && o.dtype == spec_.dtype &&
         o.op == spec_.op;
}

std::uint64_t Collective::result_bytes() const {
  if (gather_) return is(spec_.kind, Kind::kAllgather) ? spec_.count * spec_.itemsize * topo_.world : spec_.count * spec_.itemsize;
  return spec_.count * spec_.itemsize;
}

std::string Collective::submit(std::uint32_t local_rank, const std::string& who, bool* all_in) {
  *all_in = false;
  if (local_rank >= topo_.local_size) return who + " is not a local rank of this node";
  if (submitted_by_[local_rank] || submitted_ == topo_.local_size)
    return who + " submitted collective #" + num(spec_.seq) + " twice";
  submitted_by_[local_rank] = true;
  submitted_++;
  *all_in = submitted_ == topo_.local_size;
  return {};
}

Chunk Collective::own_chunk(std::uint64_t index) const {
  const std::uint64_t unit = gather_ ? topo_.chunk_bytes : chunk_elems_;
  const std::uint32_t shard = gather_ || !replicated_ ? topo_.node : 0;
  const std::uint64_t a = own_start_ + index * unit;
  return {shard, index, a, own_end_ - a > unit ? a + unit : own_end_};
}

std::vector<Chunk> Collective::local_tasks() const {
  std::vector<Chunk> out;
  if (gather_) {
    const Range b = blocks_[topo_.node];
    for (std::uint64_t i = 0; i < own_chunks_; i++) {
      const std::uint64_t a = b.start + i * topo_.chunk_bytes;
      out.push_back({topo_.node, i, a, b.end - a > topo_.chunk_bytes ? a + topo_.chunk_bytes : b.end});
    }
    return out;
  }
  std::vector<Range> shards(nshards_);
  std::vector<std::uint64_t> counts(nshards_);
  std::uint64_t most = 0;
  for (std::uint32_t j = 0; j < nshards_; j++) {
    shards[j] = shard_range(spec_.count, nshards_, j);
    counts[j] = chunks_of_shard(j);
    most = counts[j] > most ? counts[j] : most;
  }
  for (std::uint64_t i = 0; i < most; i++) {
    for (std::uint32_t k = 0; k < nshards_; k++) {
      const std::uint32_t j = replicated_ ? 0 : (topo_.node + 1 + k) % nshards_;  // the next node's first
      if (i >= counts[j]) continue;
      const std::uint64_t a = shards[j].start + i * chunk_elems_;
      out.push_back({j, i, a, shards[j].end - a > chunk_elems_ ? a + chunk_elems_ : shards[j].end});
    }
  }
  return out;
}

std::string Collective::accepts(bool block, const char* type_name, const std::string& who) const {
  if (block != gather_)
    return who + " sent " + type_name + " for " + kind_label(spec_.kind) + " #" + num(spec_.seq);
  return {};
}

std::string Collective::locate_partial(std::uint32_t from, std::uint64_t shard, std::uint64_t offset,
                                       std::uint64_t length, const std::string& who, const std::string& me,
                                       Chunk* out) const {
  std::string why = accepts(false, "PARTIAL", who);
  if (!why.empty()) return why;
  if (shard != (replicated_ ? 0 : topo_.node)) return who + " sent a partial of shard " + num(shard) + " to " + me;
  ChunkAt c;
  why = smddp::locate_reduce(spec_.count, spec_.itemsize, nshards_, chunk_elems_, shard, offset, length, &c);
  if (!why.empty()) return who + " sent a frame of #" + num(spec_.seq) + " that is not a chunk of it: " + why;
  if (!server_live()) return who + " sent a partial of #" + num(spec_.seq) + " after it was complete";
  if (from >= topo_.nnodes || partial_seen_[c.index * topo_.nnodes + from])
    return who + " sent chunk " + num(c.index) + " of #" + num(spec_.seq) + " twice";
  *out = {static_cast<std::uint32_t>(shard), c.index, c.elems.start, c.elems.end};
  return {};
}

std::string Collective::partial_arrived(std::uint64_t index, std::uint32_t from, const std::string& who,
                                        bool* ready) {
  *ready = false;
  if (!has_server_ || index >= own_chunks_ || from >= topo_.nnodes)
    return who + " sent chunk " + num(index) + " of #" + num(spec_.seq) + ", which this node does not serve";
  const std::uint64_t at = index * topo_.nnodes + from;
  if (partial_seen_[at]) return who + " sent chunk " + num(index) + " of #" + num(spec_.seq) + " twice";
  partial_seen_[at] = true;
  *ready = ++partial_count_[index] == topo_.nnodes;
  return {};
}

std::string Collective::mark_arrived(std::uint32_t j, std::uint64_t index, const char* type_name,
                                     std::uint64_t offset, std::uint64_t length, const std::string& who) {
  std::vector<bool>& seen = arrived_[j];
  if (seen.empty()) seen.assign(gather_ ? chunks_of_block(j) : chunks_of_shard(j), false);
  if (seen[index])
    return who + " sent " + type_name + " [" + num(offset) + ", +" + num(length) + ") of #" + num(spec_.seq) +
           " twice";
  seen[index] = true;
  arrived_count_[j]++;
  return {};
}

std::string Collective::locate_result(std::uint32_t from, std::uint64_t shard, std::uint64_t offset,
                                      std::uint64_t length, const std::string& who, Chunk* out) {
  std::string why = accepts(false, "RESULT", who);
  if (!why.empty()) return why;
  if (shard != from || from >= topo_.nnodes || is(spec_.kind, Kind::kReduceScatter) || replicated_)
    return who + " sent a result of shard " + num(shard);
  ChunkAt c;
  why = smddp::locate_reduce(spec_.count, spec_.itemsize, nshards_, chunk_elems_, shard, offset, length, &c);
  if (!why.empty()) return who + " sent a frame of #" + num(spec_.seq) + " that is not a chunk of it: " + why;
  why = mark_arrived(from, c.index, "RESULT", offset, length, who);
  if (!why.empty()) return why;
  *out = {from, c.index, c.elems.start, c.elems.end};
  return {};
}

std::string Collective::locate_block(std::uint32_t from, std::uint64_t offset, std::uint64_t length,
                                     const std::string& who, Chunk* out) {
  std::string why = accepts(true, "BLOCK", who);
  if (!why.empty()) return why;
  if (from >= topo_.nnodes) return "node " + num(from) + " contributes no block to this collective";
  std::uint64_t index = 0;
  why = smddp::locate_block(blocks_[from], topo_.chunk_bytes, offset, length, &index);
  if (!why.empty()) return who + " sent a frame of #" + num(spec_.seq) + " that is not a chunk of it: " + why;
  why = mark_arrived(from, index, "BLOCK", offset, length, who);
  if (!why.empty()) return why;
  *out = {from, index, offset, offset + length};
  return {};
}

bool Collective::chunk_completed() {
  completed_++;
  if (done_ || completed_ < expected_ || submitted_ < topo_.local_size) return false;
  done_ = true;
  // Every server reduce has run and nothing is sent from the server rows (only a replicated
  // collective sends its own row): they may be reused now, not when the collective retires.
  if (!replicated_) server_freed_ = true;
  return true;
}

bool Collective::send_finished() {
  if (pending_sends_ > 0) pending_sends_--;
  return may_retire();
}

std::string Collective::release(std::uint32_t local_rank, const std::string& who, bool* retire) {
  *retire = false;
  if (!done_ || local_rank >= topo_.local_size || released_by_[local_rank])
    return who + " released collective #" + num(spec_.seq) + ", which it does not hold";
  released_by_[local_rank] = true;
  released_++;
  *retire = may_retire();
  return {};
}

bool Collective::lacks_from(std::uint32_t j) const {
  if (j >= topo_.nnodes || j == topo_.node) return false;  // no frame comes from ourselves
  if (gather_) return arrived_count_[j] < chunks_of_block(j);
  for (std::uint64_t i = 0; i < own_chunks_ && has_server_; i++)
    if (!partial_seen_[i * topo_.nnodes + j]) return true;
  if (replicated_ || is(spec_.kind, Kind::kReduceScatter)) return false;  // no RESULT comes from j
  return arrived_count_[j] < chunks_of_shard(j);
}

std::vector<std::uint32_t> Collective::late_nodes() const {
  std::vector<std::uint32_t> late;
  for (std::uint32_t j = 0; j < topo_.nnodes; j++) {
    if (gather_) {
      // Our own block counts as in once every local rank submitted (they are named separately).
      const bool have = arrived_count_[j] > 0 || (j == topo_.node && submitted_ == topo_.local_size);
      if (!have) late.push_back(j);
      continue;
    }
    if (j == topo_.node || !has_server_) continue;  // our own partial waits for our ranks
    for (std::uint64_t i = 0; i < own_chunks_; i++) {
      if (!partial_seen_[i * topo_.nnodes + j]) {
        late.push_back(j);
        break;
      }
    }
  }
  return late;
}

}  // namespace smddp
