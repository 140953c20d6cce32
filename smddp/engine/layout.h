// Shard and chunk arithmetic (docs/architecture.md, "Layouts"): where a data frame's bytes belong.
//
// Pure. `locate_*` are the checks every offset and length from the wire passes before the engine
// touches memory: a frame must be exactly one chunk of a shard (or of a node's block), or it is refused.
#pragma once

#include <cstdint>
#include <string>

namespace smddp {

struct Range {
  std::uint64_t start = 0;
  std::uint64_t end = 0;
};

// Element range of shard `shard` of `count` elements cut in `nshards` balanced shards (the first
// count % nshards one element longer). Requires nshards > 0 and shard < nshards.
Range shard_range(std::uint64_t count, std::uint32_t nshards, std::uint32_t shard);

struct ChunkAt {
  std::uint64_t index = 0;  // within its shard
  Range elems;
};

// The chunk of shard `shard` that bytes [byte_offset, +byte_length) of a reduced buffer must be
// (itemsize bytes per element, chunk_elems elements per chunk). Returns "" and sets *out, or why not.
std::string locate_reduce(std::uint64_t count, std::uint64_t itemsize, std::uint32_t nshards,
                          std::uint64_t chunk_elems, std::uint64_t shard, std::uint64_t byte_offset,
                          std::uint64_t byte_length, ChunkAt* out);

// The index of the chunk of block [start, end) (bytes, cut every chunk_bytes) that a frame's
// [byte_offset, +byte_length) must be; an empty block has one empty chunk at its start.
std::string locate_block(Range block, std::uint64_t chunk_bytes, std::uint64_t byte_offset,
                         std::uint64_t byte_length, std::uint64_t* index);

}  // namespace smddp
