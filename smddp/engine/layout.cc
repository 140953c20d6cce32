// Shard and chunk arithmetic, in unsigned 64-bit with every product and sum checked not to wrap.
#include "layout.h"

namespace smddp {
namespace {

std::string num(std::uint64_t v) { return std::to_string(v); }

std::string frame(std::uint64_t off, std::uint64_t len) { return "frame [" + num(off) + ", +" + num(len) + ")"; }

}  // namespace

Range shard_range(std::uint64_t count, std::uint32_t nshards, std::uint32_t shard) {
  const std::uint64_t base = count / nshards, rem = count % nshards;
  const std::uint64_t j = shard;
  const std::uint64_t start = j * base + (j < rem ? j : rem);
  return {start, start + base + (j < rem ? 1 : 0)};
}

std::string locate_reduce(std::uint64_t count, std::uint64_t itemsize, std::uint32_t nshards,
                          std::uint64_t chunk_elems, std::uint64_t shard, std::uint64_t byte_offset,
                          std::uint64_t byte_length, ChunkAt* out) {
  if (nshards == 0 || itemsize == 0 || chunk_elems == 0) return "layout without shards, elements or chunks";
  if (shard >= nshards) return "shard " + num(shard) + " out of range [0, " + num(nshards) + ")";
  if (byte_offset % itemsize != 0 || byte_length % itemsize != 0)
    return "offset " + num(byte_offset) + "/length " + num(byte_length) + " not aligned to elements";
  const Range s = shard_range(count, nshards, static_cast<std::uint32_t>(shard));
  const std::uint64_t first = byte_offset / itemsize;
  // An empty shard has one empty chunk at its start; otherwise a chunk starts inside the shard.
  if (!((s.start <= first && first < s.end) || (first == s.start && s.start == s.end)))
    return "offset " + num(byte_offset) + " outside shard " + num(shard);
  const std::uint64_t index = (first - s.start) / chunk_elems;
  const std::uint64_t a = s.start + index * chunk_elems;  // <= first: no wrap
  const std::uint64_t b = (s.end - a > chunk_elems) ? a + chunk_elems : s.end;
  if (a != first || byte_length / itemsize != b - a)
    return frame(byte_offset, byte_length) + " does not match chunk " + num(index) + " of shard " + num(shard);
  out->index = index;
  out->elems = {a, b};
  return {};
}

std::string locate_block(Range block, std::uint64_t chunk_bytes, std::uint64_t byte_offset,
                         std::uint64_t byte_length, std::uint64_t* index) {
  if (chunk_bytes == 0) return "layout without chunks";
  if (block.end <= block.start) {
    if (byte_offset == block.start && byte_length == 0) {
      *index = 0;
      return {};
    }
  } else if (block.start <= byte_offset && byte_offset < block.end && (byte_offset - block.start) % chunk_bytes == 0) {
    const std::uint64_t left = block.end - byte_offset;
    if (byte_length == (left < chunk_bytes ? left : chunk_bytes)) {
      *index = (byte_offset - block.start) / chunk_bytes;
      return {};
    }
  }
  return frame(byte_offset, byte_length) + " is not a chunk of the block";
}

}  // namespace smddp
