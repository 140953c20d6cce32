// The daemon's data plane: a thread per worker ring, the table's rules, the kernels, the shard
// exchange with the other daemons over the fabric, DONE.
#include "local_plane.h"

#include <sched.h>
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
// Completions (and traces) kept between two takes; past this the oldest go (the counters stay).
constexpr std::size_t kMaxCompletions = 1 << 16;
// How long close() waits for the peers to acknowledge what was sent to them.
constexpr int kDrainMs = 2000;
// The progress thread's longest sleep in the fabric: close() and heartbeats are never later than this.
constexpr int kProgressSliceMs = 50;

// Collectives larger than this are reduced by the compute threads, smaller ones by the thread that
// made the work ready (handing them to another thread would cost more than reducing them).
constexpr std::uint64_t kInlineBytes = 64 << 10;
// Send cookies: a data frame's is its collective's sequence number (below 2**63), a control frame's
// has the top bit set.
constexpr std::uint64_t kControlBit = std::uint64_t{1} << 63;

std::uint64_t s_bytes(const Spec& s) { return s.count * s.itemsize; }

std::string num(std::uint64_t v) { return std::to_string(v); }

double wall() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

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
  return true;
}

}  // namespace

const char* phase_name(Phase p) {
  static const char* const kNames[kPhases] = {"wait for local ranks", "local reduce", "server reduce",
                                              "send", "receive", "local copy"};
  return p < kPhases ? kNames[p] : "?";
}

struct LocalPlane::Link {
  Link(std::uint32_t l, std::uint32_t r, std::string n, std::shared_ptr<Segment> ch, int s)
      : local(l),
        rank(r),
        name(std::move(n)),
        channel(std::move(ch)),
        side(s),
        submit(channel->base(), kChannelSlots, false),
        done(channel->base() + done_ring_offset(), kChannelSlots, false) {}
  ~Link() { ::close(side); }
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;
  std::uint32_t local;
  std::uint32_t rank;
  std::string name;
  std::shared_ptr<Segment> channel;
  int side;         // the side socket: ATTACH fds read by this link's thread, SEGMENT fds sent under done_mu
  RingView submit;  // popped by this link's thread only
  RingView done;    // pushed under done_mu
  std::mutex done_mu;
  std::set<std::uint32_t> told;  // result segments whose SEGMENT went on the done ring (under done_mu)
  std::map<std::uint32_t, std::shared_ptr<Segment>> segments;  // under the plane's mutex
  std::atomic<bool> stop{false};
  bool said_bye = false;  // under the plane's mutex
  std::thread thread;
  std::mutex join_mu;  // remove_worker and close may both join it, from two threads: one at a time

  void join() {
    stop.store(true, std::memory_order_release);
    std::lock_guard<std::mutex> g(join_mu);
    if (thread.joinable()) thread.join();
  }
};

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
};

// A peer daemon as the plane sees it (under the plane's mutex).
struct LocalPlane::Peer {
  std::string name;
  bool added = false;  // its link is in the fabric
  bool down = false;
  bool bye = false;  // its BYE came: every frame of it came before
  std::uint64_t bytes_in = 0;
  std::uint64_t bytes_out = 0;
  std::uint64_t queued = 0;
  struct Held {
    std::array<std::uint8_t, kHeaderSize> header;
    const std::uint8_t* payload;
    std::uint64_t length;
    std::uint64_t cookie;
  };
  std::vector<Held> before;  // frames queued before its link was handed over, in order
  // The frame being received (progress thread): where its payload goes.
  std::shared_ptr<Op> op;
  Chunk chunk;
  std::string control;
  bool discard = false;
};

LocalPlane::LocalPlane(PlaneConfig cfg, Arena* results, Arena* scratch)
    : cfg_(std::move(cfg)),
      results_(results),
      scratch_(scratch),
      table_(cfg_.topo, cfg_.node_names.size() == cfg_.topo.nnodes ? cfg_.node_names : std::vector<std::string>{cfg_.me},
             cfg_.rank_names) {
  links_.resize(cfg_.topo.local_size);
  const std::uint32_t nn = cfg_.topo.nnodes;
  if (nn > 1) {
    if (scratch_ == nullptr || cfg_.node_names.size() != nn || cfg_.topo.node >= nn)
      throw std::invalid_argument("a plane of several nodes needs its scratch arena and a name per node");
    peers_.resize(nn);
    for (std::uint32_t j = 0; j < nn; j++) {
      if (j == cfg_.topo.node) continue;
      peers_[j] = std::make_unique<Peer>();
      peers_[j]->name = cfg_.node_names[j];
    }
    std::string why;
    if (cfg_.fabric == "ofi") {
      OfiOptions o;
      o.library = cfg_.ofi_library;
      o.provider = cfg_.ofi_provider;
      o.idle_ms = cfg_.heartbeat_ns / 1'000'000;
      o.peers = nn - 1;
      fabric_ = make_ofi_fabric(this, o, &why);
    } else if (cfg_.fabric == "tcp") {
      fabric_ = make_tcp_fabric(this, cfg_.heartbeat_ns / 1'000'000, &why);
    } else {
      why = "no fabric named '" + cfg_.fabric + "' (tcp or ofi)";
    }
    if (!fabric_) throw std::runtime_error("cannot start the fabric: " + why);
    // Frames go out of and come into the two arenas: their segments are lent to the fabric once
    // (registered, where it registers memory); those created later are lent as they come.
    for (Arena* a : {results_, scratch_})
      for (const auto& seg : a->segments()) {
        why = fabric_->register_memory(seg->base(), seg->size());
        if (!why.empty()) throw std::runtime_error("cannot register memory with the fabric: " + why);
      }
  }
  try {
    for (std::uint32_t i = 0; i < cfg_.threads; i++) pool_.emplace_back([this] { compute(); });
    if (fabric_) progress_ = std::thread([this] { progress_loop(); });
  } catch (...) {  // no destructor runs for a constructor that throws: stop what started
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : pool_) t.join();
    throw;
  }
}

LocalPlane::~LocalPlane() { close(); }

std::string LocalPlane::add_worker(std::uint32_t local, std::uint32_t rank, const std::string& name,
                                   std::shared_ptr<Segment> channel, int side) {
  auto refuse = [side](std::string why) {
    ::close(side);
    return why;
  };
  if (local >= links_.size()) return refuse("local rank " + num(local) + " out of range");
  if (!channel || channel->size() < channel_bytes() || !channel->writable())
    return refuse(name + ": its channel is not a writable segment of " + num(channel_bytes()) + " bytes");
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return refuse("the plane is closed");
  if (links_[local]) return refuse(name + " joined twice");
  links_[local] = std::make_unique<Link>(local, rank, name, std::move(channel), side);
  Link* link = links_[local].get();
  link->thread = std::thread([this, link] { run(link); });
  return {};
}

bool LocalPlane::remove_worker(std::uint32_t local) {
  Link* link = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (local >= links_.size() || !links_[local]) return false;
    link = links_[local].get();
  }
  link->join();
  std::lock_guard<std::mutex> lock(mu_);
  return link->said_bye;
}

void LocalPlane::run(Link* link) {
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

void LocalPlane::handle(Link* link, const std::uint8_t* slot) {
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

void LocalPlane::on_attach(Link* link, const Header& h) {
  // Its fd was sent on the side socket before this descriptor was pushed: it is there now, or never.
  int fd = -1;
  std::string w = recv_fd(link->side, h.shard, h.offset, &fd);
  std::shared_ptr<Segment> seg;
  if (w.empty()) seg = Segment::attach(h.shard, fd, h.offset, false, &w);
  if (!seg) return fail(Verdict{Fault::kProtocol, link->name + " wrote ATTACH of " + w});
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return;
  if (!link->segments.emplace(h.shard, std::move(seg)).second)
    return fail_locked(Verdict{Fault::kProtocol, link->name + ": segment " + num(h.shard) + " attached twice"});
}

void LocalPlane::on_submit(Link* link, const Header& h) {
  Spec spec;
  if (!spec_of(h, &spec))
    return fail(Verdict{Fault::kProtocol, link->name + " submitted collective #" + num(h.seq) + " of an impossible size"});
  const std::uint64_t nbytes = s_bytes(spec);
  std::unique_lock<std::mutex> lock(mu_);
  if (failed_) return;
  std::shared_ptr<Segment> seg;
  const std::uint8_t* data = nullptr;
  if (h.shard != kNoSegment) {
    // Its ATTACH came before it on the same ring.
    auto it = link->segments.find(h.shard);
    if (it == link->segments.end())
      return fail_locked(
          Verdict{Fault::kProtocol, link->name + " named segment " + num(h.shard) + ", which it never attached"});
    seg = it->second;
    std::uint8_t* p = nullptr;
    const std::string w = seg->range(h.offset, nbytes, &p);
    if (!w.empty())
      return fail_locked(Verdict{Fault::kProtocol,
                                 link->name + " submitted collective #" + num(h.seq) + " outside its memory: " + w});
    data = p;
  } else if (nbytes != 0 && !(is_kind(spec, Kind::kBroadcast) && h.aux != link->rank)) {
    return fail_locked(Verdict{Fault::kProtocol, link->name + " submitted collective #" + num(h.seq) + " without data"});
  }
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
  if (!pool_.empty() && tasks.size() > 1 && s_bytes(op->spec) > kInlineBytes) {
    // Large, in several chunks: the compute threads share them, and this thread goes back to its
    // ring or link. (A single chunk gains nothing from a hand-off but its wake-up.)
    for (Task& t : tasks) (t.server ? server_queue_ : queue_).push_back(std::move(t));
    work_cv_.notify_all();
    return;
  }
  lock->unlock();
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
  for (std::uint32_t i = 0; i < k; i++) in[i] = o.inputs[i] == nullptr ? nullptr : o.inputs[i] + off;
  const double w0 = cfg_.trace ? wall() : 0;
  if (!several) {
    if (!fold(o, in, n, o.out + off, false)) return false;
    if (cfg_.trace) phase(o, kLocalReduce, w0, wall());
    return chunk_done(op);
  }
  if (o.c->replicated()) {
    // Our partial is our own server input and goes to every peer from there; that row stays until
    // the collective retires, after these sends have left.
    std::uint8_t* dest = o.rows + me * o.row_bytes + off;
    if (!fold(o, in, n, dest, true)) return false;
    if (cfg_.trace) phase(o, kLocalReduce, w0, wall());
    if (!send_all(op, Msg::kPartial, 0, off, dest, len)) return false;
    partial_in(op, t.index, me);
    return true;
  }
  if (t.shard == me) {
    if (!o.c->own_in_input()) {
      const std::uint64_t lo = (t.start - o.c->own_range().start) * isz;
      if (!fold(o, in, n, o.rows + me * o.row_bytes + lo, true)) return false;
      if (cfg_.trace) phase(o, kLocalReduce, w0, wall());
    }
    partial_in(op, t.index, me);
    return true;
  }
  if (is_kind(s, Kind::kAllreduce) && o.c->own_in_input()) {
    // One local input is its own partial: it goes out from the worker's slot, which the worker
    // reuses only after DONE, i.e. after this chunk's RESULT came back from a server that had
    // received all of it. (A reduce_scatter gets no RESULT for this chunk: it sends a copy.)
    std::unique_lock<std::mutex> lock(mu_);
    return send_data_locked(op, t.shard, Msg::kPartial, t.shard, off, o.inputs[0] + off, len);
  }
  // The partial goes out from the result region: the result of this chunk only comes back after the
  // server has it, so nothing overwrites it before the send is done.
  if (!fold(o, in, n, o.out + off, true)) return false;
  if (cfg_.trace) phase(o, kLocalReduce, w0, wall());
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!send_data_locked(op, t.shard, Msg::kPartial, t.shard, off, o.out + off, len)) return false;
  }
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
  const std::string& who = from == cfg_.topo.node ? cfg_.me : peers_[from]->name;
  const std::string w = op->c->partial_arrived(index, from, who, &ready);
  if (!w.empty()) return fail_locked(Verdict{Fault::kProtocol, w});
  if (!ready) return;
  const Chunk chunk = op->c->own_chunk(index);
  if (!pool_.empty() && s_bytes(op->spec) > kInlineBytes) {
    server_queue_.push_back(Task{op, chunk, true});
    work_cv_.notify_one();
    return;
  }
  lock.unlock();
  run_server(op, chunk);
}

bool LocalPlane::chunk_done(const std::shared_ptr<Op>& op) {
  std::unique_lock<std::mutex> lock(mu_);
  if (failed_) return false;
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
  std::unique_lock<std::mutex> lock(mu_);
  for (std::uint32_t j = 0; j < cfg_.topo.nnodes; j++)
    if (j != cfg_.topo.node && !send_data_locked(op, j, type, shard, offset, payload, length)) return false;
  return true;
}

bool LocalPlane::send_data_locked(const std::shared_ptr<Op>& op, std::uint32_t node, Msg type, std::uint32_t shard,
                                  std::uint64_t offset, const std::uint8_t* payload, std::uint64_t length) {
  if (failed_) return false;
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
    fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": " + w});
    return false;
  }
  op->c->send_started();
  bool left = false;
  w = send_locked(node, frame, payload, length, s.seq, &left);
  if (!w.empty()) {
    fail_locked(Verdict{Fault::kPeerLost, cfg_.me + " cannot send to " + peers_[node]->name + ": " + w});
    return false;
  }
  if (cfg_.trace) {
    const double now = wall();
    phase_locked(*op, kSend, now, now);
  }
  // Gone at once: as on_sent. (It cannot retire the collective here: a frame is always sent before
  // the chunk it belongs to completes, so the caller's memory stays.)
  if (left && table_.send_finished(s.seq)) retire_locked(s.seq);
  return true;
}

std::string LocalPlane::send_locked(std::uint32_t node, const std::uint8_t* header, const std::uint8_t* payload,
                                    std::uint64_t length, std::uint64_t cookie, bool* left) {
  *left = false;
  Peer* p = node < peers_.size() ? peers_[node].get() : nullptr;
  if (p == nullptr) return "no peer node " + num(node) + " in this job";
  if (p->down) return "its link is down";
  p->queued++;
  if (!(cookie & kControlBit)) p->bytes_out += kHeaderSize + length;  // data frames, as status counts them
  if (!p->added) {  // not handed over yet: these go first when it is
    Peer::Held held{};
    std::memcpy(held.header.data(), header, kHeaderSize);
    held.payload = payload;
    held.length = length;
    held.cookie = cookie;
    p->before.push_back(held);
    return {};
  }
  const std::string w = fabric_->send(node, header, payload, length, cookie, left);
  if (*left) p->queued--;
  return w;
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

void LocalPlane::compute() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [this] { return closed_ || !queue_.empty() || !server_queue_.empty(); });
    std::deque<Task>& q = server_queue_.empty() ? queue_ : server_queue_;  // server work first
    if (q.empty()) return;  // closed
    Task task = std::move(q.front());
    q.pop_front();
    if (failed_) continue;  // a failed job's work is dropped
    lock.unlock();
    run_task(task);
    lock.lock();
  }
}

void LocalPlane::complete_locked(const std::shared_ptr<Op>& op, std::unique_lock<std::mutex>* lock) {
  const Spec& s = op->spec;
  collectives_.fetch_add(1, std::memory_order_relaxed);
  if (completions_.size() < kMaxCompletions)
    completions_.push_back(Completion{s.kind, s.dtype, s.count * s.itemsize,
                                      std::chrono::duration<double>(Clock::now() - op->t0).count()});
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
  std::vector<Link*> to;
  for (auto& l : links_)
    if (l && !l->said_bye && !l->stop.load()) to.push_back(l.get());
  lock->unlock();  // a full ring may make a push wait: never with the plane's lock held
  for (Link* l : to) {
    RingWait r = RingWait::kReady;
    {
      std::lock_guard<std::mutex> g(l->done_mu);
      if (!l->told.count(rid)) {
        // The first DONE in this result segment for this worker: its SEGMENT just ahead of it on
        // the same ring, its fd on the side socket before that.
        Header sh;
        sh.type = Msg::kSegment;
        sh.sender = cfg_.topo.node;
        sh.shard = rid;
        sh.offset = result->size();
        std::uint8_t seg_frame[kHeaderSize];
        const std::string sw = encode_header(sh, seg_frame);
        if (!sw.empty()) return fail(Verdict{Fault::kProtocol, cfg_.me + ": " + sw});
        bool gone = false;
        const std::string sent = send_fd(l->side, rid, sh.offset, result->fd(), &gone);
        // A worker whose end has closed is gone: its connection's end says so and names it.
        if (gone) continue;
        if (!sent.empty())
          return fail(Verdict{Fault::kPeerLost, l->name + " did not take its result segments: " + sent});
        r = l->done.push(seg_frame, kHeaderSize, cfg_.push_timeout_ns, 0);
        if (r == RingWait::kReady) l->told.insert(rid);
      }
      if (r == RingWait::kReady) r = l->done.push(frame, kHeaderSize, cfg_.push_timeout_ns, 0);
    }
    if (r == RingWait::kTimeout)
      return fail(Verdict{Fault::kPeerLost, l->name + " did not take its results for " +
                                                num(static_cast<std::uint64_t>(cfg_.push_timeout_ns / 1'000'000'000)) +
                                                " s (its done ring stayed full)"});
    if (r == RingWait::kCorrupt) return fail(Verdict{Fault::kProtocol, l->name + " broke its done ring: " + l->done.why()});
  }
}

void LocalPlane::on_release(Link* link, const Header& h) {
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
  if (cfg_.trace && traces_.size() < kMaxCompletions) {
    Trace t{seq, describe(op.spec), {}};
    for (std::uint8_t p = 0; p < kPhases; p++)
      if (op.spans[p].first != 0 || op.spans[p].second != 0) t.phases.push_back({static_cast<Phase>(p), op.spans[p]});
    traces_.push_back(std::move(t));
  }
  ops_.erase(it);
  if (!w.empty()) fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": " + w});
}

void LocalPlane::on_bye(Link* link) {
  std::lock_guard<std::mutex> lock(mu_);
  link->said_bye = true;
  if (failed_) return;
  const Verdict v = table_.rank_said_bye(link->local);
  if (!v.ok()) fail_locked(v);
}

// ------------------------------------------------------------------------------------ peers

std::string LocalPlane::add_peer(std::uint32_t node, int fd) {
  std::lock_guard<std::mutex> lock(mu_);
  Peer* p = !closed_ && fabric_ && node < peers_.size() ? peers_[node].get() : nullptr;
  std::string w;
  if (closed_) w = "the plane is closed";
  else if (p == nullptr) w = "no peer node " + num(node) + " in this job";
  else if (p->added || p->down) w = p->name + " connected twice";
  else w = fabric_->add_peer(node, fd);
  if (!w.empty()) {
    ::close(fd);
    return w;
  }
  p->added = true;
  for (const Peer::Held& f : p->before) {
    w = fabric_->send(node, f.header.data(), f.payload, f.length, f.cookie);
    if (!w.empty()) {
      fail_locked(Verdict{Fault::kPeerLost, cfg_.me + " cannot send to " + p->name + ": " + w});
      break;
    }
  }
  p->before.clear();
  return {};
}

std::string LocalPlane::send_control(std::uint32_t node, const std::uint8_t header[kHeaderSize], std::string payload) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return "the plane is closed";
  if (!fabric_ || node >= peers_.size() || !peers_[node]) return "no peer node " + num(node) + " in this job";
  const std::uint64_t cookie = kControlBit | ++next_control_;
  auto it = control_out_.emplace(cookie, std::make_pair(node, std::move(payload))).first;
  // The map's node, and so the string's bytes, stay where they are until on_sent erases it.
  const std::string& bytes = it->second.second;
  bool left = false;
  const std::string w =
      send_locked(node, header, reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size(), cookie, &left);
  if (!w.empty() || left) control_out_.erase(it);
  if (left) flush_cv_.notify_all();
  return w;
}

bool LocalPlane::flush(std::int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(mu_);
  return flush_cv_.wait_for(lock, std::chrono::nanoseconds(timeout_ns), [this] { return control_out_.empty(); });
}

void LocalPlane::beat() {
  Header h;
  h.type = Msg::kHeartbeat;
  h.sender = cfg_.topo.node;
  std::uint8_t frame[kHeaderSize];
  if (!encode_header(h, frame).empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (std::uint32_t j = 0; j < peers_.size(); j++) {
    Peer* p = peers_[j].get();
    if (p == nullptr || !p->added || p->down || p->bye) continue;
    const std::uint64_t cookie = kControlBit | ++next_control_;
    auto it = control_out_.emplace(cookie, std::make_pair(j, std::string())).first;
    bool left = false;
    if (!send_locked(j, frame, nullptr, 0, cookie, &left).empty() || left) control_out_.erase(it);
  }
}

void LocalPlane::progress_loop() {
  const std::int64_t period_ns = cfg_.heartbeat_ns / 4;
  Clock::time_point busy = Clock::now();
  Clock::time_point next_beat = busy + std::chrono::nanoseconds(period_ns);
  while (!progress_stop_.load(std::memory_order_acquire)) {
    Clock::time_point now = Clock::now();
    // After activity, poll the fabric without waiting for spin_ns (yielding the core between polls, as
    // the rings' waits do: on an oversubscribed machine the peers' and workers' threads run meanwhile),
    // then sleep in it.
    int wait_ms = 0;
    if (std::chrono::duration_cast<std::chrono::nanoseconds>(now - busy).count() >= cfg_.spin_ns) {
      wait_ms = kProgressSliceMs;
      if (period_ns > 0) {
        const auto to_beat = std::chrono::duration_cast<std::chrono::milliseconds>(next_beat - now).count();
        wait_ms = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(wait_ms, to_beat)));
      }
    }
    if (fabric_->progress(wait_ms) > 0)
      busy = Clock::now();
    else if (wait_ms == 0)
      sched_yield();
    if (period_ns > 0 && (now = Clock::now()) >= next_beat) {
      beat();
      next_beat = now + std::chrono::nanoseconds(period_ns);
    }
  }
}

std::string LocalPlane::refuse_locked(Peer* p, const Verdict& v) {
  // The job fails, and the frame is read and dropped: the link stays up, so that the failure's
  // ERROR reaches this peer too (a link closed with bytes unread is reset, and what was queued on
  // it lost). Only a header the fabric cannot decode closes a link: nothing after it can be framed.
  fail_locked(v);
  p->discard = true;
  return {};
}

std::string LocalPlane::on_header(std::uint32_t peer, const Header& h, std::uint8_t** dest) {
  *dest = nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  Peer* p = peer < peers_.size() ? peers_[peer].get() : nullptr;
  if (p == nullptr) return "a link to no peer";  // never: the fabric only has links add_peer gave it
  const std::string& who = p->name;
  p->op.reset();
  p->control.clear();
  p->discard = false;
  switch (h.type) {
    case Msg::kHeartbeat:
    case Msg::kStatus:
    case Msg::kBye:
      return {};
    case Msg::kReport:
    case Msg::kError:  // decode_header bounded their lengths
      p->control.resize(h.length);
      if (h.length != 0) *dest = reinterpret_cast<std::uint8_t*>(&p->control[0]);
      return {};
    case Msg::kPartial:
    case Msg::kResult:
    case Msg::kBlock:
      break;
    default:
      return refuse_locked(p, Verdict{Fault::kProtocol,
                                      who + " sent " + msg_name(static_cast<std::uint8_t>(h.type)) +
                                          ", which daemons may not send"});
  }
  std::string w;
  Spec spec;
  if (h.sender != peer) w = who + " sent a frame claiming to be from node " + num(h.sender);
  else if (!spec_of(h, &spec)) w = who + " sent collective #" + num(h.seq) + " of an impossible size";
  if (!w.empty()) return refuse_locked(p, Verdict{Fault::kProtocol, w});
  if (failed_ || closed_) {
    // The job is over: read the payload and drop it, keeping the link up for our ERROR and BYE.
    p->discard = true;
    return {};
  }
  std::shared_ptr<Collective> c;
  bool created = false;
  const Verdict v = table_.op_for(spec, who, &c, &created);
  if (!v.ok()) return refuse_locked(p, v);
  std::shared_ptr<Op> op;
  if (created) {
    op = new_op_locked(spec, c, &w);
  } else {
    auto it = ops_.find(h.seq);
    if (it != ops_.end()) op = it->second;
    else w = cfg_.me + ": collective #" + num(h.seq) + " has no record";
  }
  if (!op) return refuse_locked(p, Verdict{Fault::kProtocol, w});
  Chunk ch;
  const std::uint64_t isz = spec.itemsize;
  std::uint8_t* to = nullptr;
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
  if (!w.empty()) return refuse_locked(p, Verdict{Fault::kProtocol, w});
  p->op = std::move(op);
  p->chunk = ch;
  if (h.length != 0) *dest = to;
  if (cfg_.trace) {
    const double now = wall();
    phase_locked(*p->op, kReceive, now, now);
  }
  return {};
}

void LocalPlane::on_frame(std::uint32_t peer, const Header& h) {
  std::shared_ptr<Op> op;
  Chunk ch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer* p = peers_[peer].get();
    switch (h.type) {
      case Msg::kHeartbeat:
        return;
      case Msg::kBye:
        // Its BYE follows all its frames: a collective not done here never gets what it lacks.
        p->bye = true;
        if (!failed_) {
          const Verdict v = table_.peer_said_bye(peer);
          if (!v.ok()) fail_locked(v);
        }
        [[fallthrough]];
      case Msg::kStatus:
      case Msg::kReport:
      case Msg::kError: {
        PlaneEvent e{PlaneEvent::kPeer, {}, peer, h, std::move(p->control)};
        p->control.clear();
        push_event_locked(std::move(e));
        return;
      }
      default:
        break;
    }
    p->bytes_in += kHeaderSize + h.length;  // data frames, as status counts them
    if (p->discard || !p->op) return;
    op = std::move(p->op);
    ch = p->chunk;
    if (cfg_.trace) {
      const double now = wall();
      phase_locked(*op, kReceive, now, now);
    }
  }
  if (h.type == Msg::kPartial) partial_in(op, ch.index, peer);
  else chunk_done(op);
}

void LocalPlane::on_sent(std::uint32_t peer, std::uint64_t cookie) {
  std::lock_guard<std::mutex> lock(mu_);
  Peer* p = peers_[peer].get();
  if (p->queued > 0) p->queued--;
  if (cookie & kControlBit) {
    control_out_.erase(cookie);
    flush_cv_.notify_all();
    return;
  }
  if (cfg_.trace) {
    auto it = ops_.find(cookie);
    if (it != ops_.end()) {
      const double now = wall();
      phase_locked(*it->second, kSend, now, now);
    }
  }
  if (table_.send_finished(cookie)) retire_locked(cookie);
}

void LocalPlane::on_link_down(std::uint32_t peer, const std::string& why, LinkEnd end) {
  std::lock_guard<std::mutex> lock(mu_);
  Peer* p = peers_[peer].get();
  p->down = true;
  p->queued = 0;
  // Its control frames still queued are dropped with the link: nobody waits for them.
  for (auto it = control_out_.begin(); it != control_out_.end();)
    it = it->second.first == peer ? control_out_.erase(it) : std::next(it);
  flush_cv_.notify_all();
  if (p->bye || failed_ || closed_) return;
  if (end == LinkEnd::kBadFrame)  // what it sent cannot be framed: not a lost peer
    return fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": " + p->name + " " + why});
  const char* hint = end == LinkEnd::kSilent ? " (frozen, or the link is down)" : "";
  fail_locked(Verdict{Fault::kPeerLost, cfg_.me + " lost contact: " + p->name + " " + why + hint});
}

void LocalPlane::lend_locked(const Segment& seg) {
  if (!fabric_) return;
  const std::string w = fabric_->register_memory(seg.base(), seg.size());
  if (!w.empty()) fail_locked(Verdict{Fault::kProtocol, cfg_.me + ": cannot register memory with the fabric: " + w});
}

std::string LocalPlane::fabric_describe() {
  std::lock_guard<std::mutex> lock(mu_);
  return fabric_ ? fabric_->describe() : std::string();
}

FabricCounters LocalPlane::fabric_counters() {
  std::lock_guard<std::mutex> lock(mu_);
  return fabric_ ? fabric_->counters() : FabricCounters{};
}

std::vector<PeerCounters> LocalPlane::peer_counters() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PeerCounters> out;
  for (std::uint32_t j = 0; j < peers_.size(); j++) {
    const Peer* p = peers_[j].get();
    if (p != nullptr) out.push_back(PeerCounters{j, p->added && !p->down, p->bytes_in, p->bytes_out, p->queued});
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

std::pair<std::size_t, std::size_t> LocalPlane::queued_tasks() {
  std::lock_guard<std::mutex> lock(mu_);
  return {queue_.size(), server_queue_.size()};
}

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
  out.swap(completions_);
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
    work_cv_.notify_all();
    flush_cv_.notify_all();
  }
  for (auto& l : links_)
    if (l) l->join();
  for (auto& t : pool_)
    if (t.joinable()) t.join();
  if (fabric_) {
    // A close with unread bytes would reset the links and drop what is still in flight, such as
    // the ERROR that tells the peers why this job failed: end the writing side after it, read on,
    // and wait (briefly) until the peers' kernels have acknowledged every byte.
    fabric_->shutdown_links();
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(kDrainMs);
    while (!fabric_->drained() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // The fabric goes before any op's memory: frames queued on it point into that memory.
  progress_stop_.store(true, std::memory_order_release);
  if (fabric_) fabric_->wake();
  if (progress_.joinable()) progress_.join();
  std::lock_guard<std::mutex> lock(mu_);
  fabric_.reset();
  queue_.clear();
  server_queue_.clear();
  for (auto& p : peers_)
    if (p) {
      p->op.reset();
      p->before.clear();
    }
  control_out_.clear();
  for (auto& [seq, op] : ops_) {
    (void)results_->free(op->result);
    if (op->has_server) (void)scratch_->free(op->server);
  }
  ops_.clear();
}

}  // namespace smddp
