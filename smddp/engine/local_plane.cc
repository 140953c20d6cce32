// The daemon's data plane: the op table's rules and records, the kernels, what the worker ports, the
// exchange and the executor are asked to do, DONE.
#include "local_plane.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <set>
#include <stdexcept>
#include <utility>

#include "fdpass.h"
#include "reduce.h"

namespace smddp {
namespace {

using Clock = std::chrono::steady_clock;

// How long one pop of a link thread waits before it looks at its stop flag again: remove_worker
// returns within about this much.
constexpr std::int64_t kPopSliceNs = 20'000'000;
// Traces kept between two takes; past this the newest are not kept (the counters stay).
constexpr std::size_t kMaxTraces = 1 << 16;

// Collectives larger than this are reduced by the compute threads, smaller ones by the thread that
// made the work ready (handing them to another thread would cost more than reducing them).
constexpr std::uint64_t kInlineBytes = 64 << 10;

std::uint64_t s_bytes(const Spec& s) { return s.count * s.itemsize; }

std::string num(std::uint64_t v) { return std::to_string(v); }

bool is_kind(const Spec& s, Kind k) { return s.kind == static_cast<std::uint8_t>(k); }

// The fingerprint a SUBMIT or a peer's data frame carries; false when its dtype and count are impossible.
bool spec_of(const Header& h, Spec* spec) {
  const std::size_t isz = dtype_size(h.dtype);  // decode_header checked the code
  if (isz == 0 || h.count > kMaxU63 / isz) return false;
  spec->seq = h.seq;
  spec->kind = h.kind;
  spec->dtype = h.dtype;
  spec->itemsize = static_cast<std::uint32_t>(isz);
  spec->widened = dtype_info(h.dtype)->widened;  // known: dtype_size found it
  spec->count = h.count;
  spec->op = h.op;
  spec->has_op = h.op != 0;
  spec->root = h.aux;
  spec->node_summed = h.type == Msg::kSubmit && (h.flags & kSubmitNodeSummed) != 0;
  return true;
}

// Slice `i` of `k` of a node-summed collective's `m` elements: [m*i/k, m*(i+1)/k) (in 128 bits:
// m*i may pass 2**64), as the workers cut it (smddp/engine/device_step.h).
std::pair<std::uint64_t, std::uint64_t> slice_range(std::uint64_t m, std::uint64_t i, std::uint64_t k) {
  return {static_cast<std::uint64_t>(static_cast<unsigned __int128>(m) * i / k),
          static_cast<std::uint64_t>(static_cast<unsigned __int128>(m) * (i + 1) / k)};
}

}  // namespace

const char* phase_name(Phase p) {
  static const char* const kNames[kPhases] = {"wait for local ranks", "local reduce", "server reduce",
                                              "send", "receive", "local copy"};
  return p < kPhases ? kNames[p] : "?";
}

struct LocalPlane::Op {
  std::shared_ptr<Collective> c;
  Spec spec;
  std::vector<const std::uint8_t*> inputs;     // by local rank; nullptr: no data
  std::vector<std::shared_ptr<Segment>> held;  // the input segments, mapped while the op lives
  Slot result;
  std::shared_ptr<Segment> result_seg;
  std::uint8_t* out = nullptr;
  // Several nodes: every node's partial of the range this node serves, one row each, node order.
  bool has_server = false;
  Slot server;
  std::shared_ptr<Segment> server_seg;
  std::uint8_t* rows = nullptr;
  std::uint64_t row_bytes = 0;
  Clock::time_point t0;
  double wall0 = 0;
  std::array<std::pair<double, double>, kPhases> spans{};  // first start, last end; 0: never
  // Streaming (channel.h, the stream block): one node, an all-reduce of kStreamMinBytes or more.
  // `streaming[i]`, local rank i's stream block when its copy-in was still under way at its SUBMIT
  // (null: its input was whole), whose input is then a ring of `ring[i]` bytes; `publish`, its result
  // goes on every worker's block as its chunks complete in order (`finished`, by index; `prefix`, the
  // chunks complete from the first), all under the table's lock but `streaming` and `ring`, set
  // before the op starts and only read after.
  std::vector<StreamShared*> streaming;
  std::vector<std::uint64_t> ring;
  bool streams = false;
  bool publish = false;
  std::vector<bool> finished;
  std::uint64_t prefix = 0;
};

namespace {

// One node's chunks only cut its reductions among the compute threads: a power of two, at most
// kStreamChunkMax, so that a streaming all-reduce's chunks never wrap round its input ring.
PlaneConfig one_node_chunks(PlaneConfig cfg) {
  if (cfg.topo.nnodes == 1) {
    std::uint64_t c = 1;
    while (c * 2 <= cfg.topo.chunk_bytes && c * 2 <= kStreamChunkMax) c *= 2;
    cfg.topo.chunk_bytes = c;
  }
  return cfg;
}

}  // namespace

LocalPlane::LocalPlane(PlaneConfig cfg, Arena* results, Arena* scratch)
    : cfg_(one_node_chunks(std::move(cfg))),
      results_(results),
      scratch_(scratch),
      table_(cfg_.topo, cfg_.node_names.size() == cfg_.topo.nnodes ? cfg_.node_names : std::vector<std::string>{cfg_.me},
             cfg_.rank_names),
      executor_(cfg_.threads, &failed_) {
  ports_.resize(cfg_.topo.local_size);
  polling_ = cfg_.one_poller && cfg_.topo.local_size + 1 <= kWaitAnyMax && have_futex_wait_any();
  if (polling_) {
    polled_.reset(new std::atomic<WorkerPort*>[cfg_.topo.local_size]);
    for (std::uint32_t i = 0; i < cfg_.topo.local_size; i++) polled_[i].store(nullptr, std::memory_order_relaxed);
  }
  const std::uint32_t nn = cfg_.topo.nnodes;
  if (nn > 1) {
    if (scratch_ == nullptr || cfg_.node_names.size() != nn || cfg_.topo.node >= nn)
      throw std::invalid_argument("a plane of several nodes needs its scratch arena and a name per node");
    receiving_.resize(nn);
    ExchangeConfig x;
    x.node = cfg_.topo.node;
    x.node_names = cfg_.node_names;
    x.me = cfg_.me;
    x.spin_ns = cfg_.spin_ns;
    x.heartbeat_ns = cfg_.heartbeat_ns;
    x.fabric = cfg_.fabric;
    x.ofi_library = cfg_.ofi_library;
    x.ofi_provider = cfg_.ofi_provider;
    // Throws why not; the executor's threads (a member) stop as the constructor unwinds.
    exchange_ = std::make_unique<Exchange>(std::move(x), static_cast<Exchange::Owner*>(this), results_, scratch_);
  }
}

LocalPlane::~LocalPlane() { close(); }

std::string LocalPlane::add_worker(std::uint32_t local, std::uint32_t rank, const std::string& name,
                                   std::shared_ptr<Segment> channel, int side) {
  auto refuse = [side](std::string why) {
    ::close(side);
    return why;
  };
  if (local >= ports_.size()) return refuse("local rank " + num(local) + " out of range");
  if (!channel || channel->size() < channel_bytes() || !channel->writable())
    return refuse(name + ": its channel is not a writable segment of " + num(channel_bytes()) + " bytes");
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return refuse("the plane is closed");
  if (ports_[local]) return refuse(name + " joined twice");
  ports_[local] = std::make_unique<WorkerPort>(local, rank, name, std::move(channel), side);
  WorkerPort* port = ports_[local].get();
  if (polling_) {
    polled_[local].store(port, std::memory_order_release);
    if (!poller_.joinable()) poller_ = std::thread([this] { poll(); });
    ring_poller();
  } else {
    port->thread = std::thread([this, port] { run(port); });
  }
  return {};
}

bool LocalPlane::remove_worker(std::uint32_t local) {
  WorkerPort* port = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (local >= ports_.size() || !ports_[local]) return false;
    port = ports_[local].get();
  }
  if (polling_) {
    port->stop.store(true, std::memory_order_release);
    ring_poller();
    std::unique_lock<std::mutex> g(retire_mu_);
    retire_cv_.wait(g, [port] { return port->retired.load(); });
  } else {
    port->join();
  }
  return port->said_bye.load();
}

void LocalPlane::ring_poller() {
  poll_bell_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake(&poll_bell_, 1);
}

void LocalPlane::retire_port(WorkerPort* port) {
  std::lock_guard<std::mutex> g(retire_mu_);
  port->retired.store(true);
  retire_cv_.notify_all();
}

void LocalPlane::poll() {
  alignas(8) std::uint8_t slot[kSlotBytes];
  const std::uint32_t n = cfg_.topo.local_size;
  std::vector<std::atomic<std::uint32_t>*> words;
  std::vector<std::uint32_t> rung;
  std::vector<WorkerPort*> asleep;
  Clock::time_point idle = Clock::now();
  for (;;) {
    const bool closing = poll_stop_.load(std::memory_order_acquire);
    bool busy = false, live = false;
    for (std::uint32_t i = 0; i < n; i++) {
      WorkerPort* p = polled_[i].load(std::memory_order_acquire);
      if (p == nullptr || p->retired.load(std::memory_order_relaxed)) continue;
      // Once told to stop, whatever its worker had published is still handled, then it is retired.
      const bool stopping = closing || p->stop.load(std::memory_order_acquire);
      const RingWait r = p->submit.pop(slot, 0, 0);
      if (r == RingWait::kReady) {
        handle(p, slot);
        busy = live = true;
      } else if (r == RingWait::kCorrupt) {
        fail(Verdict{Fault::kProtocol, p->name + " broke its submit ring: " + p->submit.why()});
        retire_port(p);
      } else if (stopping) {
        retire_port(p);
      } else {
        live = true;
      }
    }
    if (closing && !live) return;
    if (busy) {
      idle = Clock::now();
      continue;
    }
    const std::int64_t waited = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - idle).count();
    if (waited < cfg_.spin_ns) {
      std::this_thread::yield();  // the workers this one waits for may need the core
      continue;
    }
    // Asleep on every live ring's bell and our own, counted among each ring's sleepers first.
    words.assign(1, &poll_bell_);
    rung.assign(1, poll_bell_.load(std::memory_order_seq_cst));
    asleep.clear();
    bool ready = poll_stop_.load(std::memory_order_seq_cst);
    for (std::uint32_t i = 0; i < n; i++) {
      WorkerPort* p = polled_[i].load(std::memory_order_acquire);
      if (p == nullptr || p->retired.load(std::memory_order_relaxed)) continue;
      rung.push_back(p->submit.sleep_begin());
      words.push_back(p->submit.data_bell());
      asleep.push_back(p);
      if (!p->submit.empty() || p->stop.load(std::memory_order_seq_cst)) ready = true;
    }
    if (!ready) futex_wait_any(words.data(), rung.data(), words.size(), kPopSliceNs);
    for (WorkerPort* p : asleep) p->submit.sleep_end();
  }
}

void LocalPlane::run(WorkerPort* link) {
  alignas(8) std::uint8_t slot[kSlotBytes];
  for (;;) {
    // Once told to stop, whatever the worker had published is still handled (its last RELEASEs and
    // BYE come before its connection ends), then the thread ends.
    const bool stopping = link->stop.load(std::memory_order_acquire);
    const RingWait r = link->submit.pop(slot, stopping ? 0 : kPopSliceNs, stopping ? 0 : cfg_.spin_ns);
    if (r == RingWait::kReady) {
      handle(link, slot);
    } else if (r == RingWait::kCorrupt) {
      fail(Verdict{Fault::kProtocol, link->name + " broke its submit ring: " + link->submit.why()});
      return;
    } else if (stopping) {
      return;
    }
  }
}

void LocalPlane::handle(WorkerPort* link, const std::uint8_t* slot) {
  Header h;
  const std::string why = decode_header(slot, kHeaderSize, &h);
  if (!why.empty()) return fail(Verdict{Fault::kProtocol, link->name + " wrote a descriptor that is not a frame: " + why});
  if (h.sender != link->rank)
    return fail(Verdict{Fault::kProtocol, link->name + " wrote a frame claiming to be rank " + num(h.sender)});
  switch (h.type) {
    case Msg::kAttach: return on_attach(link, h);
    case Msg::kSubmit: return on_submit(link, h);
    case Msg::kRelease: return on_release(link, h);
    case Msg::kBye: return on_bye(link);
    default:
      return fail(Verdict{Fault::kProtocol, link->name + " wrote " + msg_name(static_cast<std::uint8_t>(h.type)) +
                                                ", which workers may not write on their ring"});
  }
}

void LocalPlane::on_attach(WorkerPort* link, const Header& h) {
  // Its fd was sent on the side socket before this descriptor was pushed: it is there now, or never.
  int fd = -1;
  std::string w = recv_fd(link->side, h.shard, h.offset, &fd);
  std::shared_ptr<Segment> seg;
  if (w.empty()) seg = Segment::attach(h.shard, fd, h.offset, false, &w);
  if (!seg) return fail(Verdict{Fault::kProtocol, link->name + " wrote ATTACH of " + w});
  if (failed_) return;
  if (!link->segments.emplace(h.shard, std::move(seg)).second)  // the thread that pops its ring alone
    return fail(Verdict{Fault::kProtocol, link->name + ": segment " + num(h.shard) + " attached twice"});
}

std::uint64_t LocalPlane::slice_bytes(const Spec& spec, std::uint32_t local) const {
  const auto [s, e] = slice_range(spec.count, local, cfg_.topo.local_size);
  return (e - s) * spec.itemsize;
}

void LocalPlane::on_submit(WorkerPort* link, const Header& h) {
  Spec spec;
  if (!spec_of(h, &spec))
    return fail(Verdict{Fault::kProtocol, link->name + " submitted collective #" + num(h.seq) + " of an impossible size"});
  const std::uint64_t nbytes = s_bytes(spec);
  std::shared_ptr<Segment> seg;
  const std::uint8_t* data = nullptr;
  StreamShared* streaming = nullptr;
  std::uint64_t wraps = 0;  // a streaming input's ring, when it is smaller than the input (0: whole)
  if (h.shard != kNoSegment) {
    // Its ATTACH came before it on the same ring (the thread that pops it keeps the segments).
    auto it = link->segments.find(h.shard);
    if (it == link->segments.end())
      return fail(Verdict{Fault::kProtocol, link->name + " named segment " + num(h.shard) + ", which it never attached"});
    seg = it->second;
    // Its copy-in still under way (the worker wrote its number before pushing it): each chunk waits
    // for it, and its slot is its input ring.
    std::uint64_t ring = nbytes;
    StreamShared* b = link->stream;
    if (cfg_.topo.nnodes == 1 && streams(spec.kind, nbytes) && b->in_seq.load(std::memory_order_acquire) == h.seq) {
      // Its ring, read between two looks at in_seq (the worker sets it busy before it rewrites the
      // block). Moved on meanwhile: its copy-in ended, so its slot was whole (a ring's copy-in cannot
      // end before its collective has started here, after this SUBMIT).
      const std::uint64_t r = b->in_ring.load(std::memory_order_acquire);
      if (b->in_seq.load(std::memory_order_relaxed) == h.seq) {
        streaming = b;
        ring = r;
      }
      if (ring != nbytes && ring != stream_ring_bytes(nbytes))
        return fail(Verdict{Fault::kProtocol, link->name + " streams collective #" + num(h.seq) + " through a ring of " +
                                                  num(ring) + " bytes, neither its size nor the stream ring's"});
    }
    if (ring != nbytes) wraps = ring;
    // Summed on the node's GPUs: the slot holds this rank's slice alone (slice_bytes).
    const std::uint64_t span = spec.node_summed ? slice_bytes(spec, link->local) : ring;
    std::uint8_t* p = nullptr;
    const std::string w = seg->range(h.offset, span, &p);
    if (!w.empty())
      return fail(Verdict{Fault::kProtocol,
                          link->name + " submitted collective #" + num(h.seq) + " outside its memory: " + w});
    data = p;
  } else if (nbytes != 0 && !(is_kind(spec, Kind::kBroadcast) && h.aux != link->rank)) {
    return fail(Verdict{Fault::kProtocol, link->name + " submitted collective #" + num(h.seq) + " without data"});
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (failed_) return;
  std::shared_ptr<Collective> c;
  bool created = false, all_in = false;
  const Verdict v = table_.submit(link->local, spec, &c, &created, &all_in);
  if (!v.ok()) return fail_locked(v);
  std::shared_ptr<Op> op;
  if (created) {
    std::string w;
    op = new_op_locked(spec, c, &w);
    if (!op) return fail_locked(Verdict{Fault::kProtocol, w});
  } else {
    auto it = ops_.find(h.seq);
    if (it == ops_.end())
      return fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": collective #" + num(h.seq) + " has no record"});
    op = it->second;
  }
  op->inputs[link->local] = data;
  op->held[link->local] = std::move(seg);
  op->streaming[link->local] = streaming;
  op->ring[link->local] = wraps;
  if (streaming != nullptr) op->streams = true;
  if (cfg_.trace) phase_locked(*op, kWaitLocal, op->wall0, wall());
  if (!all_in) return;
  start_locked(op, [&] {
    std::vector<Task> tasks;
    for (const Chunk& t : op->c->local_tasks()) tasks.push_back(Task{op, t, false});
    return tasks;
  }(), &lock);
}

std::shared_ptr<LocalPlane::Op> LocalPlane::new_op_locked(const Spec& spec, std::shared_ptr<Collective> c,
                                                         std::string* why) {
  auto op = std::make_shared<Op>();
  op->c = std::move(c);
  op->spec = spec;
  op->inputs.assign(cfg_.topo.local_size, nullptr);
  op->held.resize(cfg_.topo.local_size);
  op->streaming.assign(cfg_.topo.local_size, nullptr);
  op->ring.assign(cfg_.topo.local_size, 0);
  op->publish = cfg_.topo.nnodes == 1 && streams(spec.kind, s_bytes(spec));
  if (op->publish) op->finished.assign(op->c->own_chunks(), false);
  op->t0 = Clock::now();
  op->wall0 = wall();
  std::shared_ptr<Segment> fresh;
  const std::uint64_t total = op->c->result_bytes();
  std::string w = results_->alloc(total, &op->result, &fresh);
  if (w.empty()) {
    op->result_seg = results_->segment(op->result.segment);
    w = op->result_seg ? op->result_seg->range(op->result.offset, total, &op->out) : "its segment is gone";
  }
  if (!w.empty()) {
    *why = cfg_.me + ": no result memory for collective #" + num(spec.seq) + ": " + w;
    return nullptr;
  }
  if (fresh) lend_locked(*fresh);  // its SEGMENT goes to each worker with the first DONE in it
  if (op->c->server_rows() > 0) {
    const Range r = op->c->own_range();
    op->row_bytes = (r.end - r.start) * spec.itemsize;
    const std::uint64_t bytes = op->row_bytes * op->c->server_rows();
    std::shared_ptr<Segment> unused;  // server rows are never shared: nobody is told of their segments
    w = scratch_ ? scratch_->alloc(bytes, &op->server, &unused) : "no scratch arena";
    if (unused) lend_locked(*unused);
    if (w.empty()) {
      op->server_seg = scratch_->segment(op->server.segment);
      w = op->server_seg ? op->server_seg->range(op->server.offset, bytes, &op->rows) : "its segment is gone";
    }
    if (!w.empty()) {
      (void)results_->free(op->result);
      *why = cfg_.me + ": no server memory for collective #" + num(spec.seq) + ": " + w;
      return nullptr;
    }
    op->has_server = true;
  }
  ops_[spec.seq] = op;
  return op;
}

void LocalPlane::start_locked(const std::shared_ptr<Op>& op, std::vector<Task> tasks,
                              std::unique_lock<std::mutex>* lock) {
  if (op->publish) publish_locked(*op);
  lock->unlock();
  if (!executor_.empty() && tasks.size() > 1 && s_bytes(op->spec) > kInlineBytes) {
    // Large, in several chunks: the compute threads share them, and this thread goes back to its
    // ring or link. (A single chunk gains nothing from a hand-off but its wake-up.)
    std::vector<Executor::Task> local, server;
    for (Task& t : tasks) (t.server ? server : local).push_back([this, t] { run_task(t); });
    if (!server.empty()) executor_.post(std::move(server), true);
    if (!local.empty()) executor_.post(std::move(local), false);
    return;
  }
  // Small: this thread runs the work now (a hand-off would cost more than the work).
  for (const Task& t : tasks)
    if (!run_task(t)) return;
}

bool LocalPlane::run_task(const Task& t) { return t.server ? run_server(t.op, t.chunk) : run_local(t.op, t.chunk); }

bool LocalPlane::fold(const Op& op, const std::vector<const void*>& in, std::uint64_t n, std::uint8_t* out,
                      bool partial) {
  if (n == 0) return true;
  const Spec& s = op.spec;
  const std::size_t k = in.size();
  const auto sum = static_cast<std::uint8_t>(ReduceOp::kSum), avg = static_cast<std::uint8_t>(ReduceOp::kAvg);
  std::uint8_t rop = s.has_op ? s.op : sum;  // a barrier reduces nothing
  // A node's partial of an average is a sum: the server divides once.
  const bool divide = rop == avg && !partial;
  if (rop == avg && partial) rop = sum;
  const Clock::time_point r0 = Clock::now();
  const std::string w = reduce_wire(s.dtype, rop, in.data(), k, n, out, divide ? cfg_.topo.world : 0);
  if (!w.empty()) {
    fail(Verdict{Fault::kProtocol, cfg_.me + ": collective #" + num(s.seq) + ": " + w});
    return false;
  }
  // Atomics, not the plane's lock: every chunk of every compute thread passes here.
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - r0).count();
  reduced_bytes_.fetch_add(std::uint64_t{k} * n * s.itemsize, std::memory_order_relaxed);
  reduce_ns_.fetch_add(static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
  return true;
}

bool LocalPlane::local_fold(const Op& op, const std::vector<const void*>& in, std::uint64_t first, std::uint64_t n,
                            std::uint8_t* out, bool partial) {
  if (!op.c->node_summed()) return fold(op, in, n, out, partial);
  // Summed on the node's GPUs (kSubmitNodeSummed): each element of [first, first + n) is taken from
  // the rank whose slice holds it; rank i's slot holds its slice [s, e) alone, from its start
  // (slice_range; on_submit checked the slot against it). NodeState allows it only across nodes,
  // where `out` is a node partial.
  const std::uint64_t isz = op.spec.itemsize;
  for (std::uint32_t i = 0; i < cfg_.topo.local_size; i++) {
    const auto [s, e] = slice_range(op.spec.count, i, cfg_.topo.local_size);
    const std::uint64_t lo = first > s ? first : s, hi = first + n < e ? first + n : e;
    if (lo < hi) std::memmove(out + (lo - first) * isz, op.inputs[i] + (lo - s) * isz, (hi - lo) * isz);
  }
  return true;
}

bool LocalPlane::run_local(const std::shared_ptr<Op>& op, const Chunk& t) {
  Op& o = *op;
  const Spec& s = o.spec;
  const std::uint32_t k = cfg_.topo.local_size;
  const std::uint32_t me = cfg_.topo.node;
  const bool several = cfg_.topo.nnodes > 1;
  if (o.c->is_gather()) {
    const std::uint64_t a = t.start, b = t.end;
    const double w0 = cfg_.trace ? wall() : 0;
    if (b <= a) {
      // An empty block still travels: it carries our fingerprint.
    } else if (is_kind(s, Kind::kBroadcast)) {
      const std::uint32_t root = s.root - cfg_.topo.first_rank;
      if (root >= k || o.inputs[root] == nullptr) {
        fail(Verdict{Fault::kProtocol, cfg_.me + ": broadcast #" + num(s.seq) + " has no root input"});
        return false;
      }
      std::memcpy(o.out + a, o.inputs[root] + a, b - a);
    } else {
      const std::uint64_t per = s.count * s.itemsize;
      const std::uint64_t block = o.c->own_range().start;
      for (std::uint32_t r = 0; r < k; r++) {
        const std::uint64_t s0 = block + r * per;
        const std::uint64_t lo = a > s0 ? a : s0, hi = b < s0 + per ? b : s0 + per;
        if (lo < hi) std::memcpy(o.out + lo, o.inputs[r] + (lo - s0), hi - lo);
      }
    }
    if (cfg_.trace) phase(o, kLocalCopy, w0, wall());
    if (several && !send_all(op, Msg::kBlock, me, a, o.out + a, b - a)) return false;
    return chunk_done(op);
  }
  const std::uint64_t isz = s.itemsize;
  const std::uint64_t n = t.end - t.start, off = t.start * isz, len = n * isz;
  std::vector<const void*> in(k);
  for (std::uint32_t i = 0; i < k; i++) {
    // A streaming input's ring holds this chunk at its offset round the ring (a chunk never wraps:
    // one node's chunks are a power of two dividing the ring, LocalPlane's constructor).
    const std::uint64_t at = o.ring[i] != 0 ? off % o.ring[i] : off;
    in[i] = o.inputs[i] == nullptr ? nullptr : o.inputs[i] + at;
  }
  const double w0 = cfg_.trace ? wall() : 0;
  if (!several) {
    if (o.streams && !inputs_in(o, off + len)) return false;
    if (!local_fold(o, in, t.start, n, o.out + off, false)) return false;
    if (cfg_.trace) phase(o, kLocalReduce, w0, wall());
    return chunk_done(op, &t);
  }
  if (o.c->replicated()) {
    // Our partial is our own server input and goes to every peer from there; that row stays until
    // the collective retires, after these sends have left.
    std::uint8_t* dest = o.rows + me * o.row_bytes + off;
    if (!local_fold(o, in, t.start, n, dest, true)) return false;
    if (cfg_.trace) phase(o, kLocalReduce, w0, wall());
    if (!send_all(op, Msg::kPartial, 0, off, dest, len)) return false;
    partial_in(op, t.index, me);
    return true;
  }
  if (t.shard == me) {
    if (!o.c->own_in_input()) {
      const std::uint64_t lo = (t.start - o.c->own_range().start) * isz;
      if (!local_fold(o, in, t.start, n, o.rows + me * o.row_bytes + lo, true)) return false;
      if (cfg_.trace) phase(o, kLocalReduce, w0, wall());
    }
    partial_in(op, t.index, me);
    return true;
  }
  if (is_kind(s, Kind::kAllreduce) && o.c->own_in_input()) {
    // One local input is its own partial: it goes out from the worker's slot, which the worker
    // reuses only after DONE, i.e. after this chunk's RESULT came back from a server that had
    // received all of it. (A reduce_scatter gets no RESULT for this chunk: it sends a copy.)
    return send_data(op, t.shard, Msg::kPartial, t.shard, off, o.inputs[0] + off, len);
  }
  // The partial goes out from the result region: the result of this chunk only comes back after the
  // server has it, so nothing overwrites it before the send is done.
  if (!local_fold(o, in, t.start, n, o.out + off, true)) return false;
  if (cfg_.trace) phase(o, kLocalReduce, w0, wall());
  if (!send_data(op, t.shard, Msg::kPartial, t.shard, off, o.out + off, len)) return false;
  if (is_kind(s, Kind::kReduceScatter)) return chunk_done(op);  // no RESULT comes back for another's shard
  return true;
}

bool LocalPlane::run_server(const std::shared_ptr<Op>& op, const Chunk& t) {
  Op& o = *op;
  const std::uint32_t nn = cfg_.topo.nnodes;
  const std::uint64_t isz = o.spec.itemsize;
  const std::uint64_t n = t.end - t.start, lo = (t.start - o.c->own_range().start) * isz;
  std::vector<const void*> in(nn);
  for (std::uint32_t j = 0; j < nn; j++) in[j] = o.rows + j * o.row_bytes + lo;
  if (o.c->own_in_input()) in[cfg_.topo.node] = o.inputs[0] + t.start * isz;
  std::uint8_t* res = o.out + t.start * isz;
  const double w0 = cfg_.trace ? wall() : 0;
  if (!fold(o, in, n, res, false)) return false;
  if (cfg_.trace) phase(o, kServerReduce, w0, wall());
  if (!is_kind(o.spec, Kind::kReduceScatter) && !o.c->replicated() &&
      !send_all(op, Msg::kResult, cfg_.topo.node, t.start * isz, res, n * isz))
    return false;
  return chunk_done(op);
}

void LocalPlane::partial_in(const std::shared_ptr<Op>& op, std::uint64_t index, std::uint32_t from) {
  std::unique_lock<std::mutex> lock(mu_);
  if (failed_) return;
  bool ready = false;
  const std::string& who = from == cfg_.topo.node ? cfg_.me : cfg_.node_names[from];
  const std::string w = op->c->partial_arrived(index, from, who, &ready);
  if (!w.empty()) return fail_locked(Verdict{Fault::kProtocol, w});
  if (!ready) return;
  const Chunk chunk = op->c->own_chunk(index);
  lock.unlock();
  if (!executor_.empty() && s_bytes(op->spec) > kInlineBytes) {
    executor_.post({[this, op, chunk] { run_server(op, chunk); }}, true);
    return;
  }
  run_server(op, chunk);
}

bool LocalPlane::inputs_in(const Op& o, std::uint64_t end) {
  const Clock::time_point t0 = Clock::now();
  for (;;) {
    std::uint32_t late = cfg_.topo.local_size;
    for (std::uint32_t i = 0; i < o.streaming.size() && late == cfg_.topo.local_size; i++)
      if (o.streaming[i] != nullptr && !stream_in_ready(*o.streaming[i], o.spec.seq, end)) late = i;
    if (late == cfg_.topo.local_size) return true;
    if (failed_.load()) return false;
    // Its worker hung up (remove_worker) with its copy-in short: the daemon fails the job for that,
    // naming it and how it ended, once this thread lets go (the poller retires the port after this
    // returns; remove_worker waits for it). Waiting on for bytes that never come would hold every
    // other worker's ring, and that failure, for the whole push timeout.
    if (ports_[late]->stop.load(std::memory_order_acquire)) return false;
    const std::int64_t waited = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    if (waited >= cfg_.push_timeout_ns) {
      // (ports_[late] was set before its SUBMIT, which came before this op started.)
      fail(Verdict{Fault::kPeerLost, ports_[late]->name + " did not copy collective #" + num(o.spec.seq) +
                                         " into shared memory within " +
                                         num(static_cast<std::uint64_t>(cfg_.push_timeout_ns / 1'000'000'000)) + " s"});
      return false;
    }
    stream_pause(t0, cfg_.spin_ns);
  }
}

void LocalPlane::publish_locked(Op& op) {
  for (auto& port : ports_) {
    if (!port) continue;
    // A sequence lock: busy first, then the new slot, then its number (channel.h, the stream block).
    StreamShared& b = *port->stream;
    // (Release stores, no fence: a reader that sees one of them sees busy after it.)
    b.out_seq.store(kStreamBusy, std::memory_order_relaxed);
    b.out_segment.store(op.result.segment, std::memory_order_release);
    b.out_offset.store(op.result.offset, std::memory_order_release);
    b.out_bytes.store(0, std::memory_order_release);
    b.out_seq.store(op.spec.seq, std::memory_order_release);
    port->published = op.spec.seq;
  }
  // A streaming worker learns how far its ring is free from here on (0 before ack_seq moves).
  for (std::uint32_t i = 0; i < op.streaming.size(); i++) {
    if (op.streaming[i] == nullptr) continue;
    op.streaming[i]->ack_bytes.store(0, std::memory_order_relaxed);
    op.streaming[i]->ack_seq.store(op.spec.seq, std::memory_order_release);
    ports_[i]->acking = op.spec.seq;  // (its port is there: its SUBMIT came through it)
  }
}

void LocalPlane::advance_locked(Op& op, const Chunk& t) {
  if (t.index >= op.finished.size() || op.finished[t.index]) return;  // (the state machine located it once)
  op.finished[t.index] = true;
  const std::uint64_t before = op.prefix;
  while (op.prefix < op.finished.size() && op.finished[op.prefix]) op.prefix++;
  if (op.prefix == before) return;
  const std::uint64_t bytes = op.prefix == op.finished.size()
                                  ? s_bytes(op.spec)
                                  : op.c->own_chunk(op.prefix).start * op.spec.itemsize;
  // Released after the chunk's bytes were written (by this thread, or by another before it took the
  // lock), and after its inputs were read: a streaming worker may write over them now.
  for (auto& port : ports_)
    if (port && port->published == op.spec.seq) port->stream->out_bytes.store(bytes, std::memory_order_release);
  // Only while the block's ack still speaks of this collective: an earlier one still reducing after
  // this worker's next one took the block over must not free the new one's ring.
  for (std::uint32_t i = 0; i < op.streaming.size(); i++)
    if (op.streaming[i] != nullptr && ports_[i]->acking == op.spec.seq)
      op.streaming[i]->ack_bytes.store(bytes, std::memory_order_release);
}

bool LocalPlane::chunk_done(const std::shared_ptr<Op>& op, const Chunk* t) {
  std::unique_lock<std::mutex> lock(mu_);
  if (failed_) return false;
  if (t != nullptr && op->publish) advance_locked(*op, *t);
  if (!op->c->chunk_completed()) return true;
  if (op->has_server && !op->c->server_live()) {
    // Every server reduction ran and nothing is sent from the rows (only a replicated collective
    // sends its own row): reuse the space now, so that the next collectives land on touched pages.
    const std::string w = scratch_->free(op->server);
    op->has_server = false;
    op->rows = nullptr;
    op->server_seg.reset();
    if (!w.empty()) {
      fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": " + w});
      return false;
    }
  }
  complete_locked(op, &lock);
  return true;
}

bool LocalPlane::send_all(const std::shared_ptr<Op>& op, Msg type, std::uint32_t shard, std::uint64_t offset,
                          const std::uint8_t* payload, std::uint64_t length) {
  for (std::uint32_t j = 0; j < cfg_.topo.nnodes; j++)
    if (j != cfg_.topo.node && !send_data(op, j, type, shard, offset, payload, length)) return false;
  return true;
}

bool LocalPlane::send_data(const std::shared_ptr<Op>& op, std::uint32_t node, Msg type, std::uint32_t shard,
                           std::uint64_t offset, const std::uint8_t* payload, std::uint64_t length) {
  const Spec& s = op->spec;
  Header h;
  h.type = type;
  h.sender = cfg_.topo.node;
  h.seq = s.seq;
  h.shard = shard;
  h.offset = offset;
  h.length = length;
  h.aux = s.root;
  h.count = s.count;
  h.dtype = s.dtype;
  h.op = s.op;
  h.kind = s.kind;
  std::uint8_t frame[kHeaderSize];
  std::string w = encode_header(h, frame);
  if (!w.empty()) {
    fail(Verdict{Fault::kProtocol, cfg_.me + ": " + w});
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) return false;
    op->c->send_started();  // counted before it can leave: its data_sent finds it counted
  }
  // The fabric outside the table's lock: a send may wait for the fabric's own lock, or copy.
  bool left = false;
  w = exchange_->send_data(node, frame, payload, length, s.seq, &left);
  if (!w.empty()) {
    fail(Verdict{Fault::kPeerLost, cfg_.me + " cannot send to " + cfg_.node_names[node] + ": " + w});
    return false;
  }
  if (!cfg_.trace && !left) return true;
  std::lock_guard<std::mutex> lock(mu_);
  if (cfg_.trace) {
    const double now = wall();
    phase_locked(*op, kSend, now, now);
  }
  // Gone at once: as data_sent. (It cannot retire the collective here: a frame is always sent before
  // the chunk it belongs to completes, so the caller's memory stays.)
  if (left && table_.send_finished(s.seq)) retire_locked(s.seq);
  return true;
}

void LocalPlane::phase_locked(Op& op, Phase p, double t0, double t1) {
  auto& span = op.spans[p];
  if (span.first == 0 && span.second == 0) {
    span = {t0, t1};
  } else {
    span.first = std::min(span.first, t0);
    span.second = std::max(span.second, t1);
  }
}

void LocalPlane::phase(Op& op, Phase p, double t0, double t1) {
  std::lock_guard<std::mutex> lock(mu_);
  phase_locked(op, p, t0, t1);
}

void LocalPlane::complete_locked(const std::shared_ptr<Op>& op, std::unique_lock<std::mutex>* lock) {
  const Spec& s = op->spec;
  collectives_.fetch_add(1, std::memory_order_relaxed);
  {
    const std::uint64_t nbytes = s.count * s.itemsize;
    const double seconds = std::chrono::duration<double>(Clock::now() - op->t0).count();
    const auto size_class = static_cast<std::uint8_t>(
        std::lower_bound(cfg_.size_limits.begin(), cfg_.size_limits.end(), nbytes) - cfg_.size_limits.begin());
    const auto bucket = static_cast<std::uint8_t>(
        std::lower_bound(cfg_.latency_buckets.begin(), cfg_.latency_buckets.end(), seconds) -
        cfg_.latency_buckets.begin());
    const std::uint32_t key = std::uint32_t{s.kind} << 24 | std::uint32_t{s.dtype} << 16 |
                              std::uint32_t{size_class} << 8 | bucket;
    Completion& row = completions_[key];
    row.kind = s.kind;
    row.dtype = s.dtype;
    row.size_class = size_class;
    row.bucket = bucket;
    row.count++;
    row.seconds += seconds;
  }
  Header h;
  h.type = Msg::kDone;
  h.sender = cfg_.topo.node;
  h.seq = s.seq;
  h.shard = op->result.segment;
  h.offset = op->result.offset;
  h.aux = s.root;
  h.count = s.count;
  h.dtype = s.dtype;
  h.op = s.op;
  h.kind = s.kind;
  std::uint8_t frame[kHeaderSize];
  const std::string w = encode_header(h, frame);
  if (!w.empty()) return fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": " + w});
  const std::shared_ptr<Segment> result = op->result_seg;
  const std::uint32_t rid = op->result.segment;
  std::vector<WorkerPort*> to;
  for (auto& port : ports_)
    if (port && !port->said_bye.load() && !port->stop.load()) to.push_back(port.get());
  lock->unlock();  // a full ring may make a push wait: never with the table's lock held
  for (WorkerPort* port : to) {
    const Verdict v = port->push_done(frame, rid, *result, cfg_.topo.node, cfg_.push_timeout_ns);
    if (!v.ok()) return fail(v);
  }
}

void LocalPlane::on_release(WorkerPort* link, const Header& h) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return;
  bool retire = false;
  const Verdict v = table_.release(link->local, h.seq, &retire);
  if (!v.ok()) return fail_locked(v);
  if (retire) retire_locked(h.seq);
}

void LocalPlane::retire_locked(std::uint64_t seq) {
  auto it = ops_.find(seq);
  if (it == ops_.end()) return;
  Op& op = *it->second;
  std::string w = results_->free(op.result);
  if (op.has_server) {
    const std::string w2 = scratch_->free(op.server);
    if (w.empty()) w = w2;
    op.has_server = false;
  }
  if (cfg_.trace && traces_.size() < kMaxTraces) {
    Trace t{seq, describe(op.spec), {}};
    for (std::uint8_t p = 0; p < kPhases; p++)
      if (op.spans[p].first != 0 || op.spans[p].second != 0) t.phases.push_back({static_cast<Phase>(p), op.spans[p]});
    traces_.push_back(std::move(t));
  }
  ops_.erase(it);
  if (!w.empty()) fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": " + w});
}

void LocalPlane::on_bye(WorkerPort* link) {
  link->said_bye.store(true);
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return;
  const Verdict v = table_.rank_said_bye(link->local);
  if (!v.ok()) fail_locked(v);
}

// ------------------------------------------------------------------------------------ peers

std::string LocalPlane::add_peer(std::uint32_t node, int fd) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_ || !exchange_) {
      ::close(fd);
      return closed_ ? "the plane is closed" : "no peer node " + num(node) + " in this job";
    }
  }
  return exchange_->add_peer(node, fd);
}

std::string LocalPlane::send_control(std::uint32_t node, const std::uint8_t header[kHeaderSize], std::string payload) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return "the plane is closed";
  }
  if (!exchange_) return "no peer node " + num(node) + " in this job";
  return exchange_->send_control(node, header, std::move(payload));
}

bool LocalPlane::flush(std::int64_t timeout_ns) { return exchange_ ? exchange_->flush(timeout_ns) : true; }

void LocalPlane::refuse(Receiving* r, const Verdict& v) {
  // The job fails, and the frame is read and dropped: the link stays up, so that the failure's ERROR
  // reaches this peer too.
  fail(v);
  r->discard = true;
}

void LocalPlane::data_header(std::uint32_t peer, const Header& h, std::uint8_t** dest) {
  *dest = nullptr;
  Receiving& r = receiving_[peer];
  r.op.reset();
  r.discard = false;
  const std::string& who = cfg_.node_names[peer];
  std::string w;
  Spec spec;
  if (h.sender != peer) w = who + " sent a frame claiming to be from node " + num(h.sender);
  else if (!spec_of(h, &spec)) w = who + " sent collective #" + num(h.seq) + " of an impossible size";
  if (!w.empty()) return refuse(&r, Verdict{Fault::kProtocol, w});
  std::unique_lock<std::mutex> lock(mu_);
  if (failed_ || closed_) {
    // The job is over: read the payload and drop it, keeping the link up for our ERROR and BYE.
    r.discard = true;
    return;
  }
  std::shared_ptr<Collective> c;
  bool created = false;
  const Verdict v = table_.op_for(spec, who, &c, &created);
  std::shared_ptr<Op> op;
  if (v.ok()) {
    if (created) {
      op = new_op_locked(spec, c, &w);
    } else {
      auto it = ops_.find(h.seq);
      if (it != ops_.end()) op = it->second;
      else w = cfg_.me + ": collective #" + num(h.seq) + " has no record";
    }
  }
  Chunk ch;
  std::uint8_t* to = nullptr;
  if (op) {
    const std::uint64_t isz = spec.itemsize;
    if (h.type == Msg::kBlock) {
      w = op->c->locate_block(peer, h.offset, h.length, who, &ch);
      to = op->out + ch.start;
    } else if (h.type == Msg::kPartial) {
      w = op->c->locate_partial(peer, h.shard, h.offset, h.length, who, cfg_.me, &ch);
      if (w.empty() && !op->has_server) w = cfg_.me + ": collective #" + num(h.seq) + " has no server rows";
      if (w.empty()) to = op->rows + peer * op->row_bytes + (ch.start - op->c->own_range().start) * isz;
    } else {
      w = op->c->locate_result(peer, h.shard, h.offset, h.length, who, &ch);
      to = op->out + ch.start * isz;
    }
  }
  if (!v.ok() || !op || !w.empty()) {
    fail_locked(!v.ok() ? v : Verdict{Fault::kProtocol, w});
    r.discard = true;
    return;
  }
  r.op = std::move(op);
  r.chunk = ch;
  if (h.length != 0) *dest = to;
  if (cfg_.trace) {
    const double now = wall();
    phase_locked(*r.op, kReceive, now, now);
  }
}

void LocalPlane::data_frame(std::uint32_t peer, const Header& h) {
  Receiving& r = receiving_[peer];
  if (r.discard || !r.op) return;
  std::shared_ptr<Op> op = std::move(r.op);  // leaves r.op empty
  const Chunk ch = r.chunk;
  if (cfg_.trace) {
    const double now = wall();
    phase(*op, kReceive, now, now);
  }
  if (h.type == Msg::kPartial) partial_in(op, ch.index, peer);
  else chunk_done(op);
}

void LocalPlane::data_sent(std::uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cfg_.trace) {
    auto it = ops_.find(seq);
    if (it != ops_.end()) {
      const double now = wall();
      phase_locked(*it->second, kSend, now, now);
    }
  }
  if (table_.send_finished(seq)) retire_locked(seq);
}

void LocalPlane::control_frame(std::uint32_t peer, const Header& h, std::string payload) {
  std::lock_guard<std::mutex> lock(mu_);
  // Its BYE follows all its frames: a collective not done here never gets what it lacks.
  if (h.type == Msg::kBye && !failed_) {
    const Verdict v = table_.peer_said_bye(peer);
    if (!v.ok()) fail_locked(v);
  }
  push_event_locked(PlaneEvent{PlaneEvent::kPeer, {}, peer, h, std::move(payload)});
}

void LocalPlane::exchange_failed(const Verdict& v) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;  // a link that ends while the plane closes is no failure
  fail_locked(v);
}

void LocalPlane::lend_locked(const Segment& seg) {
  if (!exchange_) return;
  const std::string w = exchange_->lend(seg);
  if (!w.empty()) fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": cannot register memory with the fabric: " + w});
}

std::string LocalPlane::fabric_describe() { return exchange_ ? exchange_->describe() : std::string(); }

FabricCounters LocalPlane::fabric_counters() { return exchange_ ? exchange_->counters() : FabricCounters{}; }

std::vector<PeerCounters> LocalPlane::peer_counters() {
  return exchange_ ? exchange_->peer_counters() : std::vector<PeerCounters>{};
}

std::vector<WorkerDeviceCounts> LocalPlane::device_counts() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<WorkerDeviceCounts> out;
  for (const auto& port : ports_) {
    if (!port) continue;
    // (the worker writes them, each on its own: relaxed reads of four counters, no snapshot promised)
    const DeviceCounts& c = *smddp::device_counts(port->channel->base());
    const std::uint32_t reduce = c.node_reduce.load(std::memory_order_relaxed);
    out.push_back(WorkerDeviceCounts{port->rank, c.d2h_bytes.load(std::memory_order_relaxed),
                                     c.h2d_bytes.load(std::memory_order_relaxed),
                                     c.d2h_copies.load(std::memory_order_relaxed),
                                     c.h2d_copies.load(std::memory_order_relaxed), reduce <= 3 ? reduce : 0});
  }
  return out;
}

std::vector<Trace> LocalPlane::take_traces() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Trace> out;
  out.swap(traces_);
  return out;
}

// ------------------------------------------------------------------------------------ the rest

void LocalPlane::push_event_locked(PlaneEvent e) {
  events_.push_back(std::move(e));
  event_cv_.notify_all();
}

void LocalPlane::fail_locked(const Verdict& v) {
  if (failed_) return;
  failed_ = true;
  push_event_locked(PlaneEvent{PlaneEvent::kFailed, v, 0, {}, {}});
}

void LocalPlane::fail(const Verdict& v) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_locked(v);
}

void LocalPlane::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  failed_ = true;
}

Verdict LocalPlane::rank_left_early(std::uint32_t local, bool joined, const std::string& reason, bool* recorded) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.rank_left_early(local, joined, reason, recorded);
}

bool LocalPlane::left_early(std::uint32_t local) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.left_early(local);
}

bool LocalPlane::all_ranks_gone() {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.all_ranks_gone();
}

void LocalPlane::name_rank(std::uint32_t local, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  table_.name_rank(local, name);
}

std::size_t LocalPlane::in_flight() {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_.size();
}

std::pair<std::size_t, std::size_t> LocalPlane::queued_tasks() { return executor_.queued(); }

std::vector<LocalPlane::Waiting> LocalPlane::waiting() {
  std::lock_guard<std::mutex> lock(mu_);
  const Clock::time_point now = Clock::now();
  std::vector<Waiting> out;
  for (const auto& [seq, op] : ops_) {
    if (op->c->done()) continue;
    Waiting w{seq, std::chrono::duration<double>(now - op->t0).count(), describe(op->spec), {}, {}};
    for (std::uint32_t i = 0; i < cfg_.topo.local_size; i++)
      if (!op->c->submitted_by(i)) w.late.push_back(i);
    if (cfg_.topo.nnodes > 1) w.late_nodes = op->c->late_nodes();
    out.push_back(std::move(w));
  }
  return out;
}

bool LocalPlane::next_event(std::int64_t timeout_ns, PlaneEvent* out) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!event_cv_.wait_for(lock, std::chrono::nanoseconds(timeout_ns), [this] { return !events_.empty() || closed_; }))
    return false;
  if (events_.empty()) return false;
  *out = std::move(events_.front());
  events_.pop_front();
  return true;
}

std::vector<Completion> LocalPlane::take_completions() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Completion> out;
  out.reserve(completions_.size());
  for (const auto& [key, row] : completions_) out.push_back(row);
  completions_.clear();
  return out;
}

PlaneCounters LocalPlane::counters() {
  PlaneCounters c;
  c.collectives = collectives_.load(std::memory_order_relaxed);
  c.reduced_bytes = reduced_bytes_.load(std::memory_order_relaxed);
  c.reduce_seconds = static_cast<double>(reduce_ns_.load(std::memory_order_relaxed)) * 1e-9;
  return c;
}

void LocalPlane::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    event_cv_.notify_all();
  }
  if (poller_.joinable()) {
    poll_stop_.store(true, std::memory_order_seq_cst);
    ring_poller();
    poller_.join();
  }
  for (auto& port : ports_)
    if (port) port->join();
  executor_.close();
  // The exchange goes before any op's memory: frames queued on its fabric point into that memory.
  if (exchange_) exchange_->close();
  std::lock_guard<std::mutex> lock(mu_);
  for (Receiving& r : receiving_) r.op.reset();
  for (auto& [seq, op] : ops_) {
    (void)results_->free(op->result);
    if (op->has_server) (void)scratch_->free(op->server);
  }
  ops_.clear();
}

}  // namespace smddp
