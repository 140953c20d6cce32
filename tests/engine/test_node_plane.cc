// The data plane across nodes with real threads and sockets: three planes (three daemons' engines in
// one process), two workers each on their own threads, linked by socketpairs through each plane's TCP
// fabric. 400 collectives per worker: int32 sums and float64 maxima of sizes that go replicated, sharded
// in one chunk and sharded in many chunks on the compute threads, all-gathers and broadcasts, every
// result checked exactly on every worker; then BYE on every ring and between the planes, which must
// end with no failure, every peer's BYE heard, and all result and server memory given back. Then a
// peer that sends garbage and one that claims a chunk outside the collective must each fail the plane
// with a reason naming that peer. Built and run under ASan+UBSan and TSan by `make engine-sanitize`.
// Exit status 0: every check held.
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "local_plane.h"
#include "plane_test.h"

namespace {

using plane_test::check;
using plane_test::header;
using plane_test::kSecond;

constexpr std::uint32_t kNodes = 3;
constexpr std::uint32_t kPerNode = 2;
constexpr std::uint32_t kWorld = kNodes * kPerNode;
constexpr int kIters = 400;

smddp::PlaneConfig config(std::uint32_t node) {
  smddp::PlaneConfig cfg;
  cfg.topo.node = node;
  cfg.topo.nnodes = kNodes;
  cfg.topo.local_size = kPerNode;
  cfg.topo.world = kWorld;
  cfg.topo.first_rank = node * kPerNode;
  cfg.topo.chunk_bytes = 16 << 10;
  cfg.topo.replicate_bytes = 8 << 10;
  for (std::uint32_t i = 0; i < kPerNode; i++) cfg.rank_names.push_back("rank " + std::to_string(node * kPerNode + i));
  for (std::uint32_t j = 0; j < kNodes; j++) cfg.node_names.push_back("node " + std::to_string(j));
  cfg.me = "node " + std::to_string(node);
  cfg.spin_ns = 0;  // every wait sleeps
  cfg.push_timeout_ns = 20 * kSecond;
  cfg.heartbeat_ns = 0;
  return cfg;
}

struct Node {
  smddp::Arena results;
  smddp::Arena scratch;
  smddp::LocalPlane plane;
  std::vector<std::unique_ptr<smddp::WorkerChannel>> channels;
  std::vector<std::shared_ptr<smddp::Segment>> inputs;

  explicit Node(std::uint32_t node)
      : results("test-results", 1 << 20), scratch("test-scratch", 1 << 20), plane(config(node), &results, &scratch) {
    for (std::uint32_t i = 0; i < kPerNode; i++) {
      std::string why;
      channels.push_back(smddp::WorkerChannel::create("test-ch", &why));
      check(channels.back() != nullptr, "channel: " + why);
      inputs.push_back(smddp::Segment::create(3, 1 << 20, "test-in", &why));
      check(inputs.back() != nullptr, "input: " + why);
      check(plane.add_worker(i, node * kPerNode + i, "rank " + std::to_string(node * kPerNode + i),
                             channels.back()->segment(), ::dup(channels.back()->daemon_end()))
                .empty(),
            "add_worker");
      channels.back()->close_daemon_end();
      check(channels.back()->attach(*inputs.back(), node * kPerNode + i, 1'000'000'000, 0) == smddp::RingWait::kReady,
            "ATTACH");
    }
  }
};

// Every pair of planes gets a connected socketpair, one end each.
void link(std::vector<std::unique_ptr<Node>>& nodes) {
  for (std::uint32_t a = 0; a < kNodes; a++)
    for (std::uint32_t b = a + 1; b < kNodes; b++) {
      int fds[2];
      check(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0, "socketpair");
      check(nodes[a]->plane.add_peer(b, fds[0]).empty(), "add_peer a");
      check(nodes[b]->plane.add_peer(a, fds[1]).empty(), "add_peer b");
    }
}

// What rank `rank` contributes to collective `it`, element i.
std::int32_t int_value(std::uint32_t rank, std::uint64_t i, int it) {
  return static_cast<std::int32_t>((rank + 1) * (i + static_cast<std::uint64_t>(it)));
}
double f64_value(std::uint32_t rank, std::uint64_t i, int it) { return static_cast<double>(rank * 1000 + i + it); }

void worker(smddp::Arena* results, smddp::WorkerChannel* ch, std::shared_ptr<smddp::Segment> input,
            std::uint32_t rank) {
  std::uint8_t slot[smddp::kSlotBytes];
  for (int it = 1; it <= kIters; it++) {
    // kind: 1 all-reduce (mostly), 3 all-gather every 7th, 2 broadcast from rank it % world every 11th.
    const std::uint8_t kind = it % 11 == 0 ? 2 : it % 7 == 0 ? 3 : 1;
    // Sizes: replicated (<= 8 KiB / 2 peers), sharded in one chunk, and every 9th over 64 KiB in chunks.
    const std::uint64_t count = it % 9 == 0 ? 40000 : it % 2 == 0 ? 1 + static_cast<std::uint64_t>(it) % 700
                                                                    : 1500 + static_cast<std::uint64_t>(it * 37) % 3000;
    const bool f64 = kind == 1 && it % 3 == 0;
    const std::uint32_t root = static_cast<std::uint32_t>(it) % kWorld;
    if (f64) {
      auto* x = reinterpret_cast<double*>(input->base());
      for (std::uint64_t i = 0; i < count; i++) x[i] = f64_value(rank, i, it);
    } else {
      auto* x = reinterpret_cast<std::int32_t*>(input->base());
      for (std::uint64_t i = 0; i < count; i++) x[i] = int_value(rank, i, it);
    }
    const std::uint8_t op = kind == 1 ? (f64 ? 4 : 1) : 0;
    const auto sub = header(smddp::Msg::kSubmit, rank, static_cast<std::uint64_t>(it), input->id(), 0, count,
                            f64 ? 7 : 2, op, kind, kind == 2 ? root : 0);
    if (ch->push(sub.data(), 10 * kSecond, 0) != smddp::RingWait::kReady) {
      check(false, "push SUBMIT");
      return;
    }
    if (ch->pop(slot, 20 * kSecond, 0) != smddp::RingWait::kReady) {
      check(false, "no DONE for rank " + std::to_string(rank) + " #" + std::to_string(it));
      return;
    }
    smddp::Header d;
    check(smddp::decode_header(slot, smddp::kHeaderSize, &d).empty() && d.type == smddp::Msg::kDone &&
              d.seq == static_cast<std::uint64_t>(it) && d.count == count,
          "DONE names the collective");
    const std::uint64_t out_count = kind == 3 ? count * kWorld : count;
    std::shared_ptr<smddp::Segment> seg = results->segment(d.shard);
    std::uint8_t* p = nullptr;
    check(seg && seg->range(d.offset, out_count * (f64 ? 8 : 4), &p).empty(), "DONE names result memory");
    if (p == nullptr) return;
    bool ok = true;
    for (std::uint64_t i = 0; i < out_count && ok; i++) {
      if (f64) {
        ok = reinterpret_cast<const double*>(p)[i] == f64_value(kWorld - 1, i, it);
      } else if (kind == 1) {
        std::int32_t want = 0;
        for (std::uint32_t r = 0; r < kWorld; r++) want += int_value(r, i, it);
        ok = reinterpret_cast<const std::int32_t*>(p)[i] == want;
      } else if (kind == 2) {
        ok = reinterpret_cast<const std::int32_t*>(p)[i] == int_value(root, i, it);
      } else {
        ok = reinterpret_cast<const std::int32_t*>(p)[i] ==
             int_value(static_cast<std::uint32_t>(i / count), i % count, it);
      }
    }
    check(ok, "result of #" + std::to_string(it) + " (kind " + std::to_string(kind) + ", count " +
                  std::to_string(count) + ") on rank " + std::to_string(rank));
    const auto rel = header(smddp::Msg::kRelease, rank, static_cast<std::uint64_t>(it), 0, 0, 0, 0, 0, 0);
    check(ch->push(rel.data(), 10 * kSecond, 0) == smddp::RingWait::kReady, "push RELEASE");
  }
  const auto bye = header(smddp::Msg::kBye, rank, 0, 0, 0, 0, 0, 0, 0);
  check(ch->push(bye.data(), 10 * kSecond, 0) == smddp::RingWait::kReady, "push BYE");
}

// Events until `want` peers' BYEs came or a failure: the failure's text, or "".
std::string until_byes(smddp::LocalPlane& plane, std::uint32_t want) {
  smddp::PlaneEvent e;
  std::uint32_t byes = 0;
  while (byes < want && plane.next_event(20 * kSecond, &e)) {
    if (e.kind == smddp::PlaneEvent::kFailed) return e.verdict.why;
    if (e.kind == smddp::PlaneEvent::kPeer && e.header.type == smddp::Msg::kBye) byes++;
  }
  return byes == want ? "" : "only " + std::to_string(byes) + " BYEs came";
}

void many_collectives() {
  std::vector<std::unique_ptr<Node>> nodes;
  for (std::uint32_t j = 0; j < kNodes; j++) nodes.push_back(std::make_unique<Node>(j));
  link(nodes);
  std::vector<std::thread> threads;
  for (std::uint32_t j = 0; j < kNodes; j++)
    for (std::uint32_t i = 0; i < kPerNode; i++)
      threads.emplace_back(worker, &nodes[j]->results, nodes[j]->channels[i].get(), nodes[j]->inputs[i],
                           j * kPerNode + i);
  for (auto& t : threads) t.join();
  for (std::uint32_t j = 0; j < kNodes; j++) {
    for (std::uint32_t i = 0; i < kPerNode; i++) check(nodes[j]->plane.remove_worker(i), "rank said BYE");
    const auto bye = header(smddp::Msg::kBye, j, 0, 0, 0, 0, 0, 0, 0);
    for (std::uint32_t k = 0; k < kNodes; k++)
      if (k != j) check(nodes[j]->plane.send_control(k, bye.data(), "").empty(), "BYE to a peer");
  }
  for (std::uint32_t j = 0; j < kNodes; j++) {
    const std::string why = until_byes(nodes[j]->plane, kNodes - 1);
    check(why.empty(), "node " + std::to_string(j) + ": " + why);
    check(nodes[j]->plane.flush(5 * kSecond), "control frames left");
    check(nodes[j]->plane.counters().collectives == kIters, "every collective counted");
    for (const smddp::PeerCounters& c : nodes[j]->plane.peer_counters())
      check(c.bytes_in > 0 && c.bytes_out > 0 && c.queued == 0, "peer counters");
  }
  for (auto& n : nodes) {
    n->plane.close();
    check(n->plane.in_flight() == 0 && n->results.in_use() == 0 && n->scratch.in_use() == 0,
          "every result and server slot given back");
  }
}

// Node 0's plane with a test-driven end of its link to node 1 (node 2 is never linked).
std::string peer_sends(const std::vector<std::uint8_t>& bytes) {
  Node n(0);
  int fds[2];
  check(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0, "socketpair");
  check(n.plane.add_peer(1, fds[0]).empty(), "add_peer");
  check(::write(fds[1], bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()), "write");
  smddp::PlaneEvent e;
  std::string why = "no failure";
  while (n.plane.next_event(5 * kSecond, &e))
    if (e.kind == smddp::PlaneEvent::kFailed) {
      why = e.verdict.why;
      break;
    }
  ::close(fds[1]);
  n.plane.close();
  return why;
}

void bad_peers() {
  std::vector<std::uint8_t> garbage(smddp::kHeaderSize, 0xA5);
  std::string why = peer_sends(garbage);
  check(why.find("node 0: node 1 sent a bad frame header") == 0, "garbage: " + why);
  // A PARTIAL of an all-reduce of 1000 int32 (sharded: node 0 serves elements 0-333) claiming a range
  // outside node 0's shard.
  const auto partial = header(smddp::Msg::kPartial, 1, 1, 0, 4000, 1000, 2, 1, 1, 1, 8);
  std::vector<std::uint8_t> bytes(partial);
  bytes.resize(bytes.size() + 8, 0);
  why = peer_sends(bytes);
  check(why.find("node 1") != std::string::npos, "out-of-shard partial names the peer: " + why);
  // A frame claiming to come from node 2 on node 1's link.
  const auto forged = header(smddp::Msg::kBlock, 2, 1, 2, 0, 4, 2, 0, 3, 1, 0);
  why = peer_sends(forged);
  check(why.find("node 1 sent a frame claiming to be from node 2") == 0, "forged sender: " + why);
}

}  // namespace

int main() {
  many_collectives();
  bad_peers();
  if (plane_test::failures.load() != 0) return 1;
  std::printf("test_node_plane: every check held\n");
  return 0;
}
