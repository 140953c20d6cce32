// Fuzz driver for the collective state machine (smddp/engine/collective.*): any job layout and
// collective are checked or refused without a crash, and any sequence of events with any values
// (frames from the wire, submits, releases) leaves every located chunk inside the memory it names
// and completes a collective at most once.
#include <cstdio>

#include "collective.h"
#include "fuzz.h"

namespace {

bool fail(const char* what, std::uint64_t seed) {
  std::fprintf(stderr, "fuzz_collective: %s (seed %#llx)\n", what, static_cast<unsigned long long>(seed));
  return false;
}

bool round(fuzz::Rng& r, std::uint64_t seed) {
  smddp::Topology t;
  t.nnodes = static_cast<std::uint32_t>(1 + r.next() % 6);
  t.local_size = static_cast<std::uint32_t>(1 + r.next() % 4);
  t.world = t.nnodes * t.local_size;
  t.node = static_cast<std::uint32_t>(r.next() % t.nnodes);
  t.chunk_bytes = 1 + r.pick(1 << 16);
  t.replicate_bytes = r.pick(1 << 20);
  if (r.next() % 16 == 0) t.world = static_cast<std::uint32_t>(r.next());  // an impossible layout
  smddp::Spec s;
  s.seq = r.next();
  s.kind = static_cast<std::uint8_t>(r.next() % 7);
  const std::uint32_t sizes[] = {1, 2, 4, 8};
  s.itemsize = sizes[r.next() % 4];
  s.widened = r.next() % 2 == 0;
  s.count = r.pick(1 << 18);
  s.has_op = r.next() % 2 == 0;
  s.root = static_cast<std::uint32_t>(r.pick(8));
  if (!smddp::Collective::check(s, t).empty()) return true;
  // Keep the bookkeeping small here (it is a bit per chunk and node, by design).
  if (s.count * s.itemsize * t.world / t.chunk_bytes > (1 << 16)) return true;
  smddp::Collective c(s, t);
  const smddp::Range own = c.own_range();
  const std::uint64_t elems = c.is_gather() ? c.result_bytes() : s.count;
  int done = 0;
  bool was_done = false;
  for (int step = 0; step < 64; step++) {
    const std::uint32_t from = static_cast<std::uint32_t>(r.pick(t.nnodes + 1));
    const std::uint64_t shard = r.pick(t.nnodes + 1), off = r.pick(1 << 20), len = r.pick(1 << 16);
    smddp::Chunk ch;
    bool flag = false;
    switch (r.next() % 9) {
      case 0:
        (void)c.submit(static_cast<std::uint32_t>(r.pick(t.local_size + 1)), "rank", &flag);
        break;
      case 1:
        if (c.locate_partial(from, shard, off, len, "node", "me", &ch).empty() &&
            (ch.start < own.start || ch.end > own.end || ch.index >= c.own_chunks() ||
             (ch.end - ch.start) * s.itemsize != len))
          return fail("a partial located outside the range this node serves", seed);
        break;
      case 2:
        if (c.locate_result(from, shard, off, len, "node", &ch).empty() && (ch.end > elems || ch.start > ch.end))
          return fail("a result located outside the buffer", seed);
        break;
      case 3:
        if (c.locate_block(from, off, len, "node", &ch).empty() && (ch.end > c.result_bytes() || ch.start > ch.end))
          return fail("a block located outside the result", seed);
        break;
      case 4:
        if (c.own_chunks() > 0) {
          const std::uint64_t i = r.pick(c.own_chunks() + 1);
          (void)c.partial_arrived(i, from, "node", &flag);
          if (i < c.own_chunks()) {
            const smddp::Chunk o = c.own_chunk(i);
            if (o.start < own.start || o.end > own.end) return fail("an own chunk outside the own range", seed);
          }
        }
        break;
      case 5:
        done += c.chunk_completed() ? 1 : 0;
        break;
      case 6:
        if (r.next() % 2) c.send_started();
        else (void)c.send_finished();
        break;
      case 7:
        (void)c.release(static_cast<std::uint32_t>(r.pick(t.local_size + 1)), "rank", &flag);
        break;
      default:
        (void)c.lacks_from(from);
        (void)c.late_nodes();
        if (r.next() % 8 == 0) (void)c.local_tasks();
    }
    if (done > 1) return fail("a collective completed twice", seed);
    if (was_done && !c.done()) return fail("a done collective became undone", seed);
    was_done = c.done();
    if (c.may_retire() && !c.done()) return fail("retirement before completion", seed);
  }
  return true;
}

}  // namespace

SMDDP_FUZZ_MAIN("fuzz_collective", 0xc011, round)
