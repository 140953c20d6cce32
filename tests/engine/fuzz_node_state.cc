// Fuzz driver for the daemon's table of collectives (smddp/engine/node_state.*): any job layout and
// any sequence of events with any values (submits, peers' first sights, releases, sends, BYEs,
// ranks gone early) is answered without a crash, and the table stays consistent: a collective is
// created once while it is in the table, found again as the same object, each rank's sequence
// numbers advance by one on every accepted submit, the table holds exactly what was created and
// not yet dropped, and a node-summed submit is accepted only for an all-reduce of several nodes.
#include <cstdio>
#include <map>
#include <set>
#include <memory>

#include "fuzz.h"
#include "node_state.h"

namespace {

bool fail(const char* what, std::uint64_t seed) {
  std::fprintf(stderr, "fuzz_node_state: %s (seed %#llx)\n", what, static_cast<unsigned long long>(seed));
  return false;
}

smddp::Spec random_spec(fuzz::Rng& r, std::uint64_t seq) {
  smddp::Spec s;
  s.seq = seq;
  s.kind = static_cast<std::uint8_t>(r.next() % 7);
  s.dtype = static_cast<std::uint8_t>(r.next() % 9);
  const std::uint32_t sizes[] = {1, 2, 4, 8};
  s.itemsize = sizes[r.next() % 4];
  s.widened = r.next() % 2 == 0;
  s.count = r.pick(1 << 12);
  s.op = static_cast<std::uint8_t>(r.next() % 6);
  s.has_op = s.op != 0;
  s.root = static_cast<std::uint32_t>(r.pick(8));
  s.node_summed = r.next() % 4 == 0;  // (a SUBMIT's kSubmitNodeSummed; a peer's never says it)
  return s;
}

bool round(fuzz::Rng& r, std::uint64_t seed) {
  smddp::Topology t;
  t.nnodes = static_cast<std::uint32_t>(1 + r.next() % 4);
  t.local_size = static_cast<std::uint32_t>(1 + r.next() % 4);
  t.world = t.nnodes * t.local_size;
  t.node = static_cast<std::uint32_t>(r.next() % t.nnodes);
  t.chunk_bytes = 64 + r.next() % 4096;
  t.replicate_bytes = r.pick(1 << 14);
  smddp::NodeState table(t, {"node 0", "node 1"}, {"rank 0"});  // fewer names than nodes and ranks: padded
  std::map<std::uint64_t, std::shared_ptr<smddp::Collective>> live;  // what the table should hold
  // Each rank's numbers as the table should take them: every one once, within the window above the
  // lowest it has not submitted (next), none after its BYE.
  std::vector<std::uint64_t> next(t.local_size, 1);
  std::vector<std::set<std::uint64_t>> ahead(t.local_size);
  std::vector<bool> bye(t.local_size, false);
  for (int step = 0; step < 96; step++) {
    const std::uint32_t local = static_cast<std::uint32_t>(r.pick(t.local_size + 1));
    // Mostly sequence numbers near the ones in use, so that collectives meet again.
    const std::uint64_t seq = r.next() % 8 == 0 ? r.next() : 1 + r.next() % 6;
    std::shared_ptr<smddp::Collective> c;
    bool created = false, flag = false;
    smddp::Verdict v;
    switch (r.next() % 8) {
      case 0:
      case 1: {
        const smddp::Spec s = random_spec(r, local < t.local_size && r.next() % 2 ? next[local] : seq);
        const bool in_window = local < t.local_size && !bye[local] && s.seq >= next[local] &&
                               s.seq - next[local] < smddp::kSubmitWindow && !ahead[local].count(s.seq);
        v = table.submit(local, s, &c, &created, &flag);
        if (in_window) {  // (taken as submitted before anything else is checked)
          ahead[local].insert(s.seq);
          while (ahead[local].count(next[local])) ahead[local].erase(next[local]++);
        }
        if (v.ok() && !in_window) return fail("a submit outside its window, or twice, was accepted", seed);
        if (v.ok() && s.node_summed &&
            ((s.kind != static_cast<std::uint8_t>(smddp::Kind::kAllreduce) &&
              s.kind != static_cast<std::uint8_t>(smddp::Kind::kReduceScatter)) ||
             t.nnodes < 2))
          return fail("a node-summed submit other than a several-node all-reduce or reduce-scatter was accepted",
                      seed);
        if (!v.ok() && in_window && v.why.find("twice") != std::string::npos)
          return fail("a submit within its window was refused as a second one", seed);
        break;
      }
      case 2:
        v = table.op_for(random_spec(r, seq), "node 1", &c, &created);
        break;
      case 3:
        v = table.release(local, seq, &flag);
        if (v.ok() && flag) live.erase(seq);
        break;
      case 4:
        if (live.count(seq)) live[seq]->send_started();
        if (table.send_finished(seq)) live.erase(seq);
        break;
      case 5:
        v = table.rank_said_bye(local);
        if (local < t.local_size) bye[local] = true;
        break;
      case 6:
        v = table.peer_said_bye(static_cast<std::uint32_t>(r.pick(t.nnodes + 1)));
        break;
      default:
        v = table.rank_left_early(local, r.next() % 2 == 0, r.next() % 2 ? "" : "gone", &flag);
    }
    if (created) {
      if (live.count(c->spec().seq)) return fail("a collective created twice while in the table", seed);
      live[c->spec().seq] = c;
    } else if (c && (!live.count(c->spec().seq) || live[c->spec().seq] != c)) {
      return fail("a collective found that the table did not create", seed);
    }
    if (!v.ok() && v.why.empty()) return fail("a refusal without a reason", seed);
    if (table.size() != live.size()) return fail("the table holds other collectives than it created", seed);
    for (const auto& [s, coll] : live)
      if (table.find(s) != coll) return fail("a collective in the table is not the one created", seed);
    (void)smddp::describe(random_spec(r, seq));
  }
  return true;
}

}  // namespace

SMDDP_FUZZ_MAIN("fuzz_node_state", 0x7ab1e, round)
