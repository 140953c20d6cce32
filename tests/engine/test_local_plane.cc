// The local plane with real threads: four workers, each on its own thread with its own channel and
// input segment, run 3,000 all-reduces of varying sizes and types through the plane's rings (with
// their sleeps; every 25th large enough for the plane's compute threads), every result checked
// exactly, every RELEASE sent, then BYE; the plane must report every worker's BYE, no failure, and
// give back all result memory. Then a worker that scribbles on its ring's indices, and one that
// submits outside its memory, must each fail the plane with a reason, while close() still ends
// every thread. Built and run under ASan+UBSan and TSan by `make engine-sanitize`. Exit status 0:
// every check held.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "local_plane.h"
#include "plane_test.h"

namespace {

using plane_test::check;
using plane_test::header;
using plane_test::kSecond;

constexpr std::uint32_t kWorkers = 4;

// Whether the planes these tests make pop their workers' rings with one poller (the default, where
// the kernel has futex_waitv) or a thread per worker (the fallback): main runs some tests both ways.
bool one_poller = true;

smddp::PlaneConfig config(std::uint32_t n, std::int64_t push_timeout_ns = 20 * kSecond) {
  smddp::PlaneConfig cfg;
  cfg.topo.nnodes = 1;
  cfg.topo.local_size = n;
  cfg.topo.world = n;
  cfg.topo.chunk_bytes = 4096;
  for (std::uint32_t i = 0; i < n; i++) cfg.rank_names.push_back("rank " + std::to_string(i));
  cfg.me = "node 0";
  cfg.spin_ns = 0;  // every wait sleeps on the futex
  cfg.push_timeout_ns = push_timeout_ns;
  cfg.one_poller = one_poller;
  return cfg;
}

// One worker: `iters` all-reduces (int32 sums, and float64 maxima every third), each checked.
void worker(smddp::LocalPlane* plane, smddp::Arena* results, smddp::WorkerChannel* ch,
            std::shared_ptr<smddp::Segment> input, std::uint32_t rank, int iters) {
  std::uint8_t slot[smddp::kSlotBytes];
  for (int it = 1; it <= iters; it++) {
    // Mostly small (reduced by the thread whose SUBMIT completes it), every 25th large enough for the
    // compute threads (over 64 KiB).
    const std::uint64_t count = it % 25 == 0 ? 50000 : 1 + static_cast<std::uint64_t>(it * 37) % 3000;
    const bool f64 = it % 3 == 0;
    if (f64) {
      auto* x = reinterpret_cast<double*>(input->base());
      for (std::uint64_t i = 0; i < count; i++) x[i] = static_cast<double>(rank * 1000 + i + it);
    } else {
      auto* x = reinterpret_cast<std::int32_t*>(input->base());
      for (std::uint64_t i = 0; i < count; i++) x[i] = static_cast<std::int32_t>((rank + 1) * (i + it));
    }
    const auto sub = header(smddp::Msg::kSubmit, rank, static_cast<std::uint64_t>(it), input->id(), 0, count,
                            f64 ? 7 : 2, f64 ? 4 : 1, 1);
    if (ch->push(sub.data(), 10 * kSecond, 0) != smddp::RingWait::kReady) {
      check(false, "push SUBMIT");
      return;
    }
    if (ch->pop(slot, 10 * kSecond, it % 2 == 0 ? 20'000 : 0) != smddp::RingWait::kReady) {
      check(false, "no DONE for rank " + std::to_string(rank) + " #" + std::to_string(it));
      return;
    }
    smddp::Header d;
    check(smddp::decode_header(slot, smddp::kHeaderSize, &d).empty() && d.type == smddp::Msg::kDone &&
              d.seq == static_cast<std::uint64_t>(it) && d.count == count,
          "DONE names the collective");
    std::shared_ptr<smddp::Segment> seg = results->segment(d.shard);
    std::uint8_t* p = nullptr;
    check(seg && seg->range(d.offset, count * (f64 ? 8 : 4), &p).empty(), "DONE names result memory");
    if (p == nullptr) return;
    bool ok = true;
    for (std::uint64_t i = 0; i < count && ok; i++) {
      if (f64) {
        ok = reinterpret_cast<const double*>(p)[i] == static_cast<double>((kWorkers - 1) * 1000 + i + it);
      } else {
        ok = reinterpret_cast<const std::int32_t*>(p)[i] ==
             static_cast<std::int32_t>((kWorkers * (kWorkers + 1) / 2) * (i + it));
      }
    }
    check(ok, "result of #" + std::to_string(it) + " on rank " + std::to_string(rank));
    const auto rel = header(smddp::Msg::kRelease, rank, static_cast<std::uint64_t>(it), 0, 0, 0, 0, 0, 0);
    check(ch->push(rel.data(), 10 * kSecond, 0) == smddp::RingWait::kReady, "push RELEASE");
  }
  const auto bye = header(smddp::Msg::kBye, rank, 0, 0, 0, 0, 0, 0, 0);
  check(ch->push(bye.data(), 10 * kSecond, 0) == smddp::RingWait::kReady, "push BYE");
  (void)plane;
}

struct Rig {
  smddp::Arena results{"test-results", 1 << 20};
  smddp::LocalPlane plane;
  std::vector<std::unique_ptr<smddp::WorkerChannel>> channels;
  std::vector<std::shared_ptr<smddp::Segment>> inputs;

  // `with_inputs`: each worker's own input segment (id 3), ATTACHed; without, the test's arenas make theirs.
  explicit Rig(std::uint32_t n, bool with_inputs = true, std::int64_t push_timeout_ns = 20 * kSecond)
      : plane(config(n, push_timeout_ns), &results) {
    for (std::uint32_t i = 0; i < n; i++) {
      std::string why;
      channels.push_back(smddp::WorkerChannel::create("test-ch", &why));
      check(channels.back() != nullptr, "channel: " + why);
      if (with_inputs) {
        inputs.push_back(smddp::Segment::create(3, 1 << 20, "test-in", &why));
        check(inputs.back() != nullptr, "input: " + why);
      }
      // The plane uses the worker's own mapping of the channel: ThreadSanitizer tells synchronisation
      // by address, and a second mapping (as the daemon has, in its own process) would hide the
      // rings' release/acquire pairs from it. tests/unit and the job tests cover the real attach.
      // The daemon's end of the side socket goes to the plane (a duplicate: the plane owns what it is given).
      check(plane.add_worker(i, i, "rank " + std::to_string(i), channels.back()->segment(),
                             ::dup(channels.back()->daemon_end()))
                .empty(),
            "add_worker");
      channels.back()->close_daemon_end();
      if (with_inputs)
        check(channels.back()->attach(*inputs.back(), i, kSecond, 0) == smddp::RingWait::kReady, "ATTACH");
    }
  }

  std::string failure(std::int64_t timeout_ns) {
    smddp::PlaneEvent e;
    while (plane.next_event(timeout_ns, &e))
      if (e.kind == smddp::PlaneEvent::kFailed) return e.verdict.why;
    return {};
  }
};

void many_collectives() {
  Rig rig(kWorkers);
  std::vector<std::thread> threads;
  for (std::uint32_t i = 0; i < kWorkers; i++)
    threads.emplace_back(worker, &rig.plane, &rig.results, rig.channels[i].get(), rig.inputs[i], i, 750);
  for (auto& t : threads) t.join();
  for (std::uint32_t i = 0; i < kWorkers; i++) check(rig.plane.remove_worker(i), "rank said BYE");
  check(rig.failure(0).empty(), "no failure");
  check(rig.plane.all_ranks_gone(), "every rank gone");
  check(rig.plane.in_flight() == 0 && rig.results.in_use() == 0, "every result slot given back");
  check(rig.plane.counters().collectives == 750, "750 collectives counted");
  rig.plane.close();
}

void broken_rings() {
  {
    Rig rig(2);
    // Rank 1 scribbles a head far past its tail: the plane must refuse the ring, not follow it.
    auto* shared = reinterpret_cast<smddp::RingShared*>(rig.channels[1]->segment()->base());
    shared->head.store(1u << 20);
    const std::string why = rig.failure(5 * kSecond);
    check(why.find("rank 1 broke its submit ring: ring indices out of bounds") == 0, "scribbled ring: " + why);
    rig.plane.close();
  }
  {
    Rig rig(2);
    const auto sub = header(smddp::Msg::kSubmit, 0, 1, 3, (1 << 20) - 8, 4, 6, 1, 1);
    check(rig.channels[0]->push(sub.data(), kSecond, 0) == smddp::RingWait::kReady, "push");
    const std::string why = rig.failure(5 * kSecond);
    check(why.find("rank 0 submitted collective #1 outside its memory") == 0, "out of bounds: " + why);
    rig.plane.close();
  }
  {
    // Rank 0 says it streams a 1 MiB all-reduce (its stream block names it before its SUBMIT) and then
    // never copies a byte in: the reduction waits for it no longer than the push timeout, then the
    // job fails naming it; rank 1's input was whole.
    Rig rig(2, true, kSecond);
    smddp::StreamShared* b = smddp::stream_block(rig.channels[0]->segment()->base());
    b->in_bytes.store(0, std::memory_order_relaxed);
    b->in_ring.store(smddp::kStreamMinBytes, std::memory_order_relaxed);
    b->in_seq.store(1, std::memory_order_release);
    const std::uint64_t count = smddp::kStreamMinBytes / 4;
    for (std::uint32_t r = 0; r < 2; r++) {
      const auto sub = header(smddp::Msg::kSubmit, r, 1, 3, 0, count, 2, 1, 1);
      check(rig.channels[r]->push(sub.data(), kSecond, 0) == smddp::RingWait::kReady, "push");
    }
    // The copy-in's own 1 s bound fails the job (its message says so), well within the rig's 10 s wait.
    const std::string why = rig.failure(10 * kSecond);
    check(why.find("rank 0 did not copy collective #1 into shared memory within 1 s") == 0, "stalled copy-in: " + why);
    rig.plane.close();
  }
}

}  // namespace

// The SUBMIT of `rank`'s all-reduce (sum) of `count` int32, before the channel gives it its seq and slot.
smddp::Header int32_sum(std::uint32_t rank, std::uint64_t count) {
  smddp::Header h;
  h.type = smddp::Msg::kSubmit;
  h.sender = rank;
  h.count = count;
  h.dtype = 2;  // int32
  h.op = 1;     // sum
  h.kind = 1;   // all-reduce
  return h;
}

// The worker's fast path (WorkerChannel::start/finish) against the same plane: each worker thread
// copies its input in from its own memory and its result out into its own memory, with its RELEASEs
// held; every other collective of rank 0 goes the general way (pushed, and left to a background
// taker thread), so that the two kinds of takers hand each other DONEs, and the SEGMENTs before them.
// Every third collective of rank 1 is started asynchronously and collected (collect with its
// Delivery), never finished: its own background taker, or rank 1's later finish() calls, meet its
// DONE, and the taker that hands it out of pop() completes it into its own memory.
void fast_collectives() {
  constexpr int kIters = 600;
  Rig rig(kWorkers);
  std::vector<std::unique_ptr<smddp::Arena>> arenas;
  for (std::uint32_t i = 0; i < kWorkers; i++) arenas.push_back(std::make_unique<smddp::Arena>("test-fast", 1 << 20));
  // Ranks 0 and 1 keep the timeline's phases: rank 1's collected ones are traced by its taker's thread.
  rig.channels[0]->set_trace(true);
  rig.channels[1]->set_trace(true);
  std::atomic<bool> stop{false};
  std::atomic<int> general_done{0};
  std::thread watch([&] {
    smddp::PlaneEvent e;
    while (!stop.load())
      if (rig.plane.next_event(kSecond / 100, &e))
        check(e.kind != smddp::PlaneEvent::kFailed, "plane failed: " + e.verdict.why);
  });
  // Rank 1's collected collectives: seq -> (input slot, destination), and how many the taker completed.
  std::mutex collected_mu;
  std::map<std::uint64_t, std::pair<smddp::Slot, std::vector<std::int32_t>>> collected;
  std::atomic<int> collected_done{0};
  std::thread background1([&] {
    std::uint8_t slot[smddp::kSlotBytes];
    while (!stop.load()) {
      bool completed = false;
      const smddp::RingWait r = rig.channels[1]->pop(slot, kSecond / 100, 0, &completed);
      if (r == smddp::RingWait::kTimeout) continue;
      check(r == smddp::RingWait::kReady, "rank 1's taker: " + rig.channels[1]->why());
      smddp::Header d;
      check(smddp::decode_header(slot, smddp::kHeaderSize, &d).empty() && completed && d.seq % 3 == 0,
            "rank 1's taker got a DONE it did not complete: #" + std::to_string(d.seq));
      std::lock_guard<std::mutex> g(collected_mu);
      check(arenas[1]->free(collected.at(d.seq).first).empty(), "free a collected input slot");
      collected_done++;
    }
  });
  std::thread background([&] {
    std::uint8_t slot[smddp::kSlotBytes];
    while (!stop.load()) {
      const smddp::RingWait r = rig.channels[0]->pop(slot, kSecond / 100, 0);
      if (r != smddp::RingWait::kReady) continue;
      smddp::Header d;
      check(smddp::decode_header(slot, smddp::kHeaderSize, &d).empty() && d.seq % 2 == 0,
            "the background taker got a general collective's DONE");
      // Its result is not read here (the fast ones check theirs); its slot goes back.
      check(rig.channels[0]->release(0, d.seq, -1, 0, 10 * kSecond, 0) == smddp::RingWait::kReady, "release");
      general_done++;
    }
  });
  auto run = [&](std::uint32_t rank) {
    smddp::WorkerChannel* ch = rig.channels[rank].get();
    smddp::Arena& arena = *arenas[rank];
    std::vector<std::int32_t> src, dst;
    for (int it = 1; it <= kIters; it++) {
      const std::uint64_t count = 1 + static_cast<std::uint64_t>(it * 53) % 2000;
      const std::uint64_t nbytes = count * 4;
      src.assign(count, 0);
      for (std::uint64_t i = 0; i < count; i++) src[i] = static_cast<std::int32_t>((rank + 1) * (i + it));
      // Sequence numbers are the channel's: one per iteration, whichever way it goes.
      smddp::Header h = int32_sum(rank, count);
      const smddp::Source one{reinterpret_cast<const std::uint8_t*>(src.data()), nbytes};
      smddp::Slot slot;
      if (rank == 0 && it % 2 == 0) {  // the general way: the background taker collects it
        std::shared_ptr<smddp::Segment> fresh;
        std::string arena_why;
        check(ch->alloc(arena, nbytes, rank, 10 * kSecond, 0, &slot, &fresh, &arena_why) == smddp::RingWait::kReady,
              "alloc: " + arena_why + ch->why());
        h.seq = ch->reserve();
        check(h.seq == static_cast<std::uint64_t>(it), "reserve: seq " + std::to_string(h.seq));
        h.shard = slot.segment;
        h.offset = slot.offset;
        std::uint8_t frame[smddp::kHeaderSize];
        std::memcpy(arena.segment(slot.segment)->base() + slot.offset, src.data(), nbytes);
        check(smddp::encode_header(h, frame).empty(), "encode");
        check(ch->push(frame, 10 * kSecond, 0) == smddp::RingWait::kReady, "push general SUBMIT");
        continue;  // its input slot stays taken: the arena is large enough for all of them
      }
      if (rank == 1 && it % 3 == 0) {  // asynchronous, collected, never finished
        check(ch->start(arena, &one, 1, &h, &slot, 10 * kSecond, 20'000, true) == smddp::FastEnd::kDone,
              "start async: " + ch->why());
        check(h.seq == static_cast<std::uint64_t>(it), "start async: seq " + std::to_string(h.seq));
        std::vector<std::int32_t>* out = nullptr;
        {
          std::lock_guard<std::mutex> g(collected_mu);
          auto& entry = collected[h.seq];
          entry.first = slot;
          entry.second.assign(count, -1);
          out = &entry.second;
        }
        smddp::WorkerChannel::Collected how;
        how.out = smddp::Delivery{reinterpret_cast<std::uint8_t*>(out->data()), nbytes, 0, nbytes};
        how.submit = h;
        how.batch_bytes = 64 << 10;
        how.timeout_ns = 10 * kSecond;
        check(ch->collect(h.seq, how), "collect #" + std::to_string(it));
        continue;
      }
      check(ch->start(arena, &one, 1, &h, &slot, 10 * kSecond, 20'000) == smddp::FastEnd::kDone,
            "start: " + ch->why());
      check(h.seq == static_cast<std::uint64_t>(it), "start: seq " + std::to_string(h.seq));
      dst.assign(count, -1);
      const smddp::FastEnd end =
          ch->finish(arena, slot, h, smddp::Delivery{reinterpret_cast<std::uint8_t*>(dst.data()), nbytes, 0, nbytes},
                     64 << 10, 10 * kSecond, 20'000);
      check(end == smddp::FastEnd::kDone, "finish #" + std::to_string(it) + " on rank " + std::to_string(rank) +
                                               ": " + ch->why());
      bool ok = true;
      for (std::uint64_t i = 0; i < count && ok; i++)
        ok = dst[i] == static_cast<std::int32_t>((kWorkers * (kWorkers + 1) / 2) * (i + it));
      check(ok, "fast result of #" + std::to_string(it) + " on rank " + std::to_string(rank));
    }
    // A worker says BYE only with nothing in flight (as the client's shutdown does): the plane sends
    // no DONE to a worker that said goodbye.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (rank == 0 && general_done.load() < kIters / 2 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    while (rank == 1 && collected_done.load() < kIters / 3 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const auto bye = header(smddp::Msg::kBye, rank, 0, 0, 0, 0, 0, 0, 0);
    check(ch->push(bye.data(), 10 * kSecond, 0) == smddp::RingWait::kReady, "push BYE (with the held RELEASEs)");
  };
  std::vector<std::thread> threads;
  for (std::uint32_t i = 0; i < kWorkers; i++) threads.emplace_back(run, i);
  for (auto& t : threads) t.join();
  check(general_done.load() == kIters / 2, "every general collective's DONE reached the background taker");
  check(collected_done.load() == kIters / 3, "every collected collective was completed by a taker");
  for (const auto& [seq, entry] : collected) {
    bool ok = true;
    for (std::uint64_t i = 0; i < entry.second.size() && ok; i++)
      ok = entry.second[i] == static_cast<std::int32_t>((kWorkers * (kWorkers + 1) / 2) * (i + seq));
    check(ok, "collected result of #" + std::to_string(seq) + " in its own memory");
  }
  stop.store(true);
  watch.join();
  background.join();
  background1.join();
  for (std::uint32_t i = 0; i < kWorkers; i++) check(rig.plane.remove_worker(i), "rank said BYE");
  check(rig.failure(0).empty(), "no failure");
  check(rig.plane.in_flight() == 0 && rig.results.in_use() == 0, "every result slot given back");
  for (std::uint32_t i = 1; i < kWorkers; i++) check(arenas[i]->in_use() == 0, "every fast input slot given back");
  // Every fast collective of a traced channel left its phases once, in order; the general way's none.
  for (std::uint32_t rank : {0u, 1u}) {
    std::uint64_t dropped = 1;
    const std::vector<smddp::ChannelTrace> traces = rig.channels[rank]->take_traces(&dropped);
    std::set<std::uint64_t> seqs;
    bool ordered = true;
    for (const smddp::ChannelTrace& t : traces) {
      seqs.insert(t.seq);
      ordered = ordered && t.start > 0 && t.start <= t.submitted && t.submitted <= t.done && t.done <= t.copied &&
                t.count == 1 + (t.seq * 53) % 2000;
    }
    const std::size_t want = rank == 0 ? kIters / 2 : kIters;
    check(dropped == 0 && traces.size() == want && seqs.size() == want &&
              (rank == 1 || std::all_of(seqs.begin(), seqs.end(), [](std::uint64_t q) { return q % 2 == 1; })),
          "rank " + std::to_string(rank) + " traced " + std::to_string(traces.size()) + " collectives");
    check(ordered, "rank " + std::to_string(rank) + ": every trace's phases in order, with its count");
    check(rig.channels[rank]->take_traces(&dropped).empty(), "a take empties the traces");
  }
  rig.plane.close();
}

// Streaming (channel.h, the stream block): large all-reduces whose SUBMIT goes before the copy-in,
// a blocking one's round a 4 MiB input ring as the plane's reductions free it, their results copied out
// behind the reductions. Sizes from exactly kStreamMinBytes (the ring is the whole buffer) to two and
// a half rings, from one source and from two whose boundary falls inside a copy step; blocking
// (start and finish on one thread, the result in place over its source, copied out while the
// copy-in waits for room) and asynchronous (through a whole slot, finished after the next one
// started, so that the stream block moves on under it). The workers start at different times, so a reduction that did
// not wait for a copy-in, or a copy-in that did not wait for the reduction before going round the
// ring, reads or overwrites bytes another worker has not written yet: every result is checked.
void streamed_collectives() {
  constexpr int kIters = 12;
  Rig rig(kWorkers);
  std::vector<std::unique_ptr<smddp::Arena>> arenas;
  for (std::uint32_t i = 0; i < kWorkers; i++) arenas.push_back(std::make_unique<smddp::Arena>("test-stream", 8 << 20));
  std::atomic<bool> stop{false};
  std::thread watch([&] {
    smddp::PlaneEvent e;
    while (!stop.load())
      if (rig.plane.next_event(kSecond / 100, &e))
        check(e.kind != smddp::PlaneEvent::kFailed, "plane failed: " + e.verdict.why);
  });
  const std::uint64_t sizes[] = {smddp::kStreamMinBytes / 4, (5 << 20) / 4 + 3, (10 << 20) / 4 + 1001};
  auto expect = [](std::uint64_t i, int it) { return static_cast<std::int32_t>(10 * (i + it)); };  // 1+2+3+4
  auto run = [&](std::uint32_t rank) {
    smddp::WorkerChannel* ch = rig.channels[rank].get();
    ch->set_stream(true);
    smddp::Arena& arena = *arenas[rank];
    std::vector<std::int32_t> a, b, pending;
    smddp::Header ph;
    smddp::Slot pslot;
    smddp::WorkerChannel::Streamed pgot;
    int pit = 0;
    for (int it = 1; it <= kIters; it++) {
      std::this_thread::sleep_for(std::chrono::microseconds(300 * ((rank + it) % kWorkers)));
      const std::uint64_t count = sizes[it % 3];
      const std::uint64_t nbytes = count * 4;
      a.assign(count, 0);
      for (std::uint64_t i = 0; i < count; i++) a[i] = static_cast<std::int32_t>((rank + 1) * (i + it));
      smddp::Header h = int32_sum(rank, count);
      // Two sources on even iterations, split off a 4-byte boundary inside a 256 KiB step.
      const std::uint64_t cut = it % 2 == 0 ? (count / 3) * 4 : nbytes;
      const auto* base = reinterpret_cast<const std::uint8_t*>(a.data());
      const smddp::Source two[2] = {{base, cut}, {base + cut, nbytes - cut}};
      const std::size_t n = cut == nbytes ? 1 : 2;
      smddp::Slot slot;
      if (it % 4 == 3) {  // asynchronous: finished after the next one has started
        pending = a;
        const smddp::Source mine[2] = {{reinterpret_cast<const std::uint8_t*>(pending.data()), cut},
                                       {reinterpret_cast<const std::uint8_t*>(pending.data()) + cut, nbytes - cut}};
        const smddp::Delivery back{reinterpret_cast<std::uint8_t*>(pending.data()), nbytes, 0, nbytes};
        pgot = {};
        check(ch->start(arena, mine, n, &h, &slot, 10 * kSecond, 20'000, true, &back, &pgot) == smddp::FastEnd::kDone,
              "start async streamed: " + ch->why());
        check(slot.nbytes == nbytes, "an asynchronous streamed input's slot is whole (its start never waits)");
        ph = h;
        pslot = slot;
        pit = it;
        continue;
      }
      // Blocking, in place: its result overwrites its source as the copy-in goes.
      const smddp::Delivery back{reinterpret_cast<std::uint8_t*>(a.data()), nbytes, 0, nbytes};
      smddp::WorkerChannel::Streamed got;
      check(ch->start(arena, two, n, &h, &slot, 10 * kSecond, 20'000, false, &back, &got) == smddp::FastEnd::kDone,
            "start streamed: " + ch->why());
      check(slot.nbytes == smddp::stream_ring_bytes(nbytes), "a streamed input's slot is its ring");
      check(ch->finish(arena, slot, h, back, 64 << 10, 10 * kSecond, 20'000, nullptr, &got) == smddp::FastEnd::kDone,
            "finish streamed #" + std::to_string(it) + " on rank " + std::to_string(rank) + ": " + ch->why());
      bool ok = true;
      for (std::uint64_t i = 0; i < count && ok; i++) ok = a[i] == expect(i, it);
      check(ok, "streamed result of #" + std::to_string(it) + " on rank " + std::to_string(rank));
      if (pit != 0) {
        const std::uint64_t pbytes = ph.count * 4;
        const smddp::Delivery back2{reinterpret_cast<std::uint8_t*>(pending.data()), pbytes, 0, pbytes};
        check(ch->finish(arena, pslot, ph, back2, 64 << 10, 10 * kSecond, 20'000, nullptr, &pgot) ==
                  smddp::FastEnd::kDone,
              "finish async streamed #" + std::to_string(pit) + ": " + ch->why());
        ok = true;
        for (std::uint64_t i = 0; i < ph.count && ok; i++) ok = pending[i] == expect(i, pit);
        check(ok, "async streamed result of #" + std::to_string(pit) + " on rank " + std::to_string(rank));
        pit = 0;
      }
    }
    check(pit == 0, "every asynchronous one finished");
    const auto bye = header(smddp::Msg::kBye, rank, 0, 0, 0, 0, 0, 0, 0);
    check(ch->push(bye.data(), 10 * kSecond, 0) == smddp::RingWait::kReady, "push BYE");
  };
  std::vector<std::thread> threads;
  for (std::uint32_t i = 0; i < kWorkers; i++) threads.emplace_back(run, i);
  for (auto& t : threads) t.join();
  stop.store(true);
  watch.join();
  for (std::uint32_t i = 0; i < kWorkers; i++) {
    check(rig.plane.remove_worker(i), "rank said BYE");
    check(arenas[i]->in_use() == 0, "every streamed input ring given back");
    // Every byte went in streaming, and results came out before their DONE (not those of a fresh
    // result segment, whose SEGMENT comes with its DONE, nor the rest of one whose block moved on).
    std::uint64_t total = 0;
    for (int it = 1; it <= kIters; it++) total += sizes[it % 3] * 4;
    check(rig.channels[i]->streamed_in() == total, "rank " + std::to_string(i) + " streamed every byte in");
    check(rig.channels[i]->streamed_out() > total / 4,
          "rank " + std::to_string(i) + " copied " + std::to_string(rig.channels[i]->streamed_out()) + " of " +
              std::to_string(total) + " result bytes out before their DONE");
  }
  check(rig.failure(0).empty(), "no failure");
  check(rig.plane.in_flight() == 0 && rig.results.in_use() == 0, "every result slot given back");
  rig.plane.close();
}

// Two threads share each worker's channel and arena, one going the general way (alloc, reserve,
// push, three at a time given last first; their DONEs popped by the background taker), one the fast way (start, finish), while the arena grows a small
// segment at a time (the general thread keeps its input slots): the channel hands out sequence
// numbers in ring order whichever thread asks, a fresh segment's ATTACH goes ahead of every SUBMIT
// that names it (the plane fails a SUBMIT naming a segment it was not given), and a SUBMIT given
// (or a fast start) while a reserved SUBMIT before it is not on the ring yet waits in the channel
// and goes right after it. Every
// collective has one shape and every rank's data depends only on the rank, so that any seq may be
// either thread's; every result is checked.
void shared_channel() {
  constexpr int kEach = 150;
  constexpr int kBatch = 3;  // the general thread reserves this many, then gives them last first
  constexpr std::uint64_t kCount = 300;
  constexpr std::uint64_t kBytes = kCount * 4;
  Rig rig(kWorkers, false);
  std::vector<std::unique_ptr<smddp::Arena>> arenas;
  for (std::uint32_t i = 0; i < kWorkers; i++) arenas.push_back(std::make_unique<smddp::Arena>("test-shared", 4096));
  std::vector<std::vector<smddp::Slot>> kept(kWorkers);
  auto shape = [](std::uint32_t rank) { return int32_sum(rank, kCount); };
  auto right = [](const std::int32_t* x) {
    for (std::uint64_t i = 0; i < kCount; i++)
      if (x[i] != static_cast<std::int32_t>((kWorkers * (kWorkers + 1) / 2) * (i + 1))) return false;
    return true;
  };
  auto general = [&](std::uint32_t rank) {
    smddp::WorkerChannel* ch = rig.channels[rank].get();
    smddp::Arena& arena = *arenas[rank];
    for (int it = 0; it < kEach; it += kBatch) {
      // Every other batch is held, as the client's device collectives are (reserve_fast, give, and a
      // finish that locates the result without copying or RELEASEing it).
      const bool held = (it / kBatch) % 2 == 1;
      std::vector<std::array<std::uint8_t, smddp::kHeaderSize>> frames(kBatch);
      std::vector<smddp::Header> heads(kBatch);
      std::set<std::uint64_t> mine;
      for (int b = 0; b < kBatch; b++) {
        smddp::Header h = shape(rank);
        smddp::Slot slot;
        std::shared_ptr<smddp::Segment> fresh;
        std::string arena_why;
        if (ch->alloc(arena, kBytes, rank, 10 * kSecond, 0, &slot, &fresh, &arena_why) != smddp::RingWait::kReady) {
          check(false, "alloc: " + arena_why + ch->why());
          return;
        }
        auto* x = reinterpret_cast<std::int32_t*>(arena.segment(slot.segment)->base() + slot.offset);
        for (std::uint64_t i = 0; i < kCount; i++) x[i] = static_cast<std::int32_t>((rank + 1) * (i + 1));
        kept[rank].push_back(slot);
        h.seq = held ? ch->reserve_fast() : ch->reserve();
        h.shard = slot.segment;
        h.offset = slot.offset;
        mine.insert(h.seq);
        heads[b] = h;
        check(smddp::encode_header(h, frames[b].data()).empty(), "encode");
      }
      // Given last first: the channel puts each on the ring as it is given, out of sequence order
      // within the window the plane takes them in (it fails a rank whose SUBMIT is past it, or sent
      // twice), the fast thread's starts meanwhile too (those past the window wait in the channel).
      for (int b = kBatch - 1; b >= 0; b--) {
        const smddp::RingWait r = held ? ch->give(heads[b], 10 * kSecond, 0)
                                       : ch->push(frames[b].data(), 10 * kSecond, 0);
        check(r == smddp::RingWait::kReady, "push general SUBMIT: " + ch->why());
        if (b > 0) std::this_thread::yield();
      }
      if (held) {
        check(ch->give(heads[0], kSecond, 0) == smddp::RingWait::kCorrupt, "a SUBMIT given twice is refused");
        for (int b = 0; b < kBatch; b++) {
          smddp::Delivery out;
          out.result_bytes = kBytes;
          out.hold = true;
          smddp::Located at;
          // No input slot: this thread keeps them (the arena grows a segment at a time).
          check(ch->finish(arena, smddp::Slot{smddp::kNoSegment, 0, 0}, heads[b], out, 64 << 10, 10 * kSecond,
                           20'000, &at) == smddp::FastEnd::kDone,
                "held finish: " + ch->why());
          std::shared_ptr<smddp::Segment> seg = ch->result(at.segment);
          std::uint8_t* p = nullptr;
          check(at.held && seg && seg->range(at.offset, kBytes, &p).empty() && right(reinterpret_cast<std::int32_t*>(p)),
                "held result of #" + std::to_string(heads[b].seq) + " on rank " + std::to_string(rank));
          check(ch->release(rank, heads[b].seq, -1, 64 << 10, 10 * kSecond, 0) == smddp::RingWait::kReady, "release");
        }
        continue;
      }
      for (int b = 0; b < kBatch; b++) {
        std::uint8_t d[smddp::kSlotBytes];
        check(ch->pop(d, 10 * kSecond, 20'000) == smddp::RingWait::kReady, "pop: " + ch->why());
        smddp::Header done;
        check(smddp::decode_header(d, smddp::kHeaderSize, &done).empty() && mine.erase(done.seq) == 1,
              "the general thread's DONEs are its own");
        std::shared_ptr<smddp::Segment> seg = ch->result(done.shard);
        std::uint8_t* p = nullptr;
        check(seg && seg->range(done.offset, kBytes, &p).empty() && right(reinterpret_cast<std::int32_t*>(p)),
              "general result of #" + std::to_string(done.seq) + " on rank " + std::to_string(rank));
        check(ch->release(rank, done.seq, static_cast<std::int64_t>(kBytes), 64 << 10, 10 * kSecond, 0) ==
                  smddp::RingWait::kReady,
              "release");
      }
    }
  };
  auto fast = [&](std::uint32_t rank) {
    smddp::WorkerChannel* ch = rig.channels[rank].get();
    smddp::Arena& arena = *arenas[rank];
    std::vector<std::int32_t> src(kCount), dst(kCount);
    for (std::uint64_t i = 0; i < kCount; i++) src[i] = static_cast<std::int32_t>((rank + 1) * (i + 1));
    const smddp::Source one{reinterpret_cast<const std::uint8_t*>(src.data()), kBytes};
    for (int it = 0; it < kEach; it++) {
      smddp::Header h = shape(rank);
      smddp::Slot slot;
      const smddp::FastEnd end = ch->start(arena, &one, 1, &h, &slot, 10 * kSecond, 20'000);
      check(end == smddp::FastEnd::kDone, "start: " + ch->why());
      dst.assign(kCount, -1);
      check(ch->finish(arena, slot, h, smddp::Delivery{reinterpret_cast<std::uint8_t*>(dst.data()), kBytes, 0, kBytes},
                       64 << 10, 10 * kSecond, 20'000) == smddp::FastEnd::kDone,
            "finish: " + ch->why());
      check(right(dst.data()), "fast result of #" + std::to_string(h.seq) + " on rank " + std::to_string(rank));
    }
  };
  std::vector<std::thread> threads;
  for (std::uint32_t i = 0; i < kWorkers; i++) {
    threads.emplace_back(general, i);
    threads.emplace_back(fast, i);
  }
  for (auto& t : threads) t.join();
  for (std::uint32_t i = 0; i < kWorkers; i++) {
    check(arenas[i]->segments().size() > 10, "the arena grew a segment at a time while both threads used it");
    const auto bye = header(smddp::Msg::kBye, i, 0, 0, 0, 0, 0, 0, 0);
    check(rig.channels[i]->push(bye.data(), 10 * kSecond, 0) == smddp::RingWait::kReady, "push BYE");
  }
  for (std::uint32_t i = 0; i < kWorkers; i++) check(rig.plane.remove_worker(i), "rank said BYE");
  check(rig.failure(0).empty(), "no failure");
  check(rig.plane.in_flight() == 0 && rig.results.in_use() == 0, "every result slot given back");
  for (std::uint32_t i = 0; i < kWorkers; i++) check(arenas[i]->in_use() == kept[i].size() * 1216, "fast slots freed");
  std::uint64_t queued = 0;
  for (std::uint32_t i = 0; i < kWorkers; i++) queued += rig.channels[i]->queued_starts();
  std::printf("shared_channel: %llu fast starts waited in the channel, past the window\n",
              static_cast<unsigned long long>(queued));
  rig.plane.close();
}

// More collectives in flight than the done ring holds (make_room): every rank has two threads on its
// channel, each starting 400 asynchronous all-reduces without waiting for any, then finishing its
// own in reverse order. Nobody takes a DONE until the starts do: past kMaxInFlight, each start takes
// DONEs off the ring itself (parking them for their finish), the two threads of a channel taking
// turns. Every collective of the job has the same count and every rank sends (rank + 1) in every
// element, so whichever thread's collective a sequence number is, its result is 10 everywhere.
void backlog() {
  constexpr int kEach = 400;
  constexpr std::uint64_t kCount = 100;
  Rig rig(kWorkers);
  std::vector<std::unique_ptr<smddp::Arena>> arenas;
  for (std::uint32_t i = 0; i < kWorkers; i++) arenas.push_back(std::make_unique<smddp::Arena>("test-backlog", 1 << 20));
  std::atomic<int> finished{0};
  auto run = [&](std::uint32_t rank) {
    smddp::WorkerChannel* ch = rig.channels[rank].get();
    const std::vector<std::int32_t> src(kCount, static_cast<std::int32_t>(rank + 1));
    const smddp::Source one{reinterpret_cast<const std::uint8_t*>(src.data()), kCount * 4};
    std::vector<std::pair<smddp::Header, smddp::Slot>> started;
    for (int it = 0; it < kEach; it++) {
      smddp::Header h = int32_sum(rank, kCount);
      smddp::Slot slot;
      const smddp::FastEnd end = ch->start(*arenas[rank], &one, 1, &h, &slot, 10 * kSecond, 20'000, true);
      check(end == smddp::FastEnd::kDone, "start #" + std::to_string(it) + " on rank " + std::to_string(rank) +
                                               ": " + ch->why() + ch->backlog_why());
      if (end != smddp::FastEnd::kDone) return;
      started.emplace_back(h, slot);
    }
    std::vector<std::int32_t> dst(kCount);
    for (auto it = started.rbegin(); it != started.rend(); ++it) {
      std::fill(dst.begin(), dst.end(), -1);
      const smddp::FastEnd end =
          ch->finish(*arenas[rank], it->second, it->first,
                     smddp::Delivery{reinterpret_cast<std::uint8_t*>(dst.data()), kCount * 4, 0, kCount * 4}, 64 << 10,
                     10 * kSecond, 20'000);
      check(end == smddp::FastEnd::kDone && std::all_of(dst.begin(), dst.end(), [](std::int32_t v) { return v == 10; }),
            "backlog result of #" + std::to_string(it->first.seq) + " on rank " + std::to_string(rank));
      finished++;
    }
  };
  std::vector<std::thread> threads;
  for (std::uint32_t i = 0; i < kWorkers; i++) {
    threads.emplace_back(run, i);
    threads.emplace_back(run, i);
  }
  for (auto& t : threads) t.join();
  check(finished.load() == 2 * kWorkers * kEach, "every collective finished");
  for (std::uint32_t i = 0; i < kWorkers; i++) {
    const auto bye = header(smddp::Msg::kBye, i, 0, 0, 0, 0, 0, 0, 0);
    check(rig.channels[i]->push(bye.data(), 10 * kSecond, 0) == smddp::RingWait::kReady, "push BYE");
  }
  for (std::uint32_t i = 0; i < kWorkers; i++) check(rig.plane.remove_worker(i), "rank said BYE");
  check(rig.failure(0).empty(), "no failure");
  check(rig.plane.in_flight() == 0 && rig.results.in_use() == 0, "every result slot given back");
  for (std::uint32_t i = 0; i < kWorkers; i++) check(arenas[i]->in_use() == 0, "every input slot given back");
  rig.plane.close();
}

// A worker that hangs up while the collective it streams into is short of its bytes (killed mid
// copy-in): the thread reducing that collective (a compute thread here; the one that pops the rings
// where there are none) stops waiting for it at once, so that neither remove_worker (the daemon's
// first step when a worker's connection ends, before it fails the job naming it), every other
// worker's ring, nor the plane's close is held for the push timeout (20 s here).
void gone_mid_stream() {
  Rig rig(2);
  constexpr std::uint64_t kCount = (1 << 20) / 4;  // the whole 1 MiB input segment: it streams
  for (std::uint32_t r = 0; r < 2; r++) {
    smddp::StreamShared* b = smddp::stream_block(rig.channels[r]->segment()->base());
    b->in_seq.store(smddp::kStreamBusy);
    b->in_bytes.store(r == 0 ? smddp::kStreamAll : 4096);  // rank 1 stops 4 KiB in
    b->in_ring.store(kCount * 4);
    b->in_seq.store(1);
  }
  for (std::uint32_t r = 0; r < 2; r++) {
    const auto sub = header(smddp::Msg::kSubmit, r, 1, 3, 0, kCount, 2, 1, 1);
    check(rig.channels[r]->push(sub.data(), 10 * kSecond, 0) == smddp::RingWait::kReady, "push SUBMIT");
  }
  // Both SUBMITs taken (nobody late): the collective is reducing, and waits for rank 1's bytes.
  auto started = [&rig] {
    const auto w = rig.plane.waiting();
    return w.size() == 1 && w[0].late.empty();
  };
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!started() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  check(started() && rig.plane.in_flight() == 1, "the collective started");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // (its reduction now waiting)
  const auto t0 = std::chrono::steady_clock::now();
  check(!rig.plane.remove_worker(1), "rank 1 left without BYE");
  check(!rig.plane.remove_worker(0), "rank 0 left without BYE");
  rig.plane.close();  // (the daemon's teardown, once it has failed the job)
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Let go at once, not after the 20 s push timeout a worker's ring would wait out (half of it leaves a
  // loaded or sanitized host its seconds).
  check(took < 10.0, "the ports and the plane let go in " + std::to_string(took) + " s, not after the push timeout");
  check(rig.results.in_use() == 0, "the abandoned collective's result slot given back at close");
}

int main() {
  check(smddp::have_futex_wait_any(), "this kernel has futex_waitv (5.16 or later): the one poller is tested");
  many_collectives();
  fast_collectives();
  streamed_collectives();
  shared_channel();
  backlog();
  broken_rings();
  gone_mid_stream();
  one_poller = false;  // the fallback: a thread per worker
  many_collectives();
  fast_collectives();
  broken_rings();
  gone_mid_stream();
  if (plane_test::failures.load() != 0) return 1;
  std::printf("test_local_plane: every check held\n");
  return 0;
}
