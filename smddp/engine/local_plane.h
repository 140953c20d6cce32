// The daemon's data plane: the workers' rings in, the reductions, the shard exchange with the other
// nodes' daemons, DONE out, with no Python on the way (docs/engine.md, "The data plane"; issue 17).
//
// It is cut along its seams, as gloo cuts its device, pairs and context (issue 29):
// - worker ports (worker_port.h): each worker shares a channel segment with its daemon
//   (channel_bytes(): the submit ring, worker -> daemon, then the done ring, daemon -> worker;
//   kSlotBytes slots holding 56-byte frame headers of docs/protocol.md). One engine thread per worker
//   pops its submit ring (spinning briefly, then sleeping on the ring's futex) and handles ATTACH (its
//   fd taken off the channel's side socket, fdpass.h), SUBMIT, RELEASE and BYE in ring order; DONE
//   goes to every worker's done ring, after the SEGMENT of its result segment the first time a worker
//   is sent one (its fd on the side socket).
// - the op table (this class): the I/O-free NodeState (node_state.h) and the op records (the memory
//   each collective reduces from and into), under the table's mutex; every segment, offset and
//   length checked against the worker's attached segments before a pointer is formed, the result
//   slot from the daemon's result arena, every chunk a peer's frame claims located by the
//   collective's state machine first.
// - the exchange (exchange.h), in a job of several nodes: the fabric to the other daemons (the links
//   Python authenticated and handed over), PARTIAL, RESULT and BLOCK sent from and received straight
//   into arena memory, control frames, heartbeats, and a progress thread that spins briefly after
//   activity and then sleeps in the fabric. The table calls it outside the table's lock.
// - the executor (executor.h): the thread that makes work ready runs it when it is small (the
//   reduction kernels, a gather's copies, the frames to send); larger work goes to the compute threads.
// Python keeps the unix sockets (handshake, CHANNEL, liveness, ERROR), the peers' handshakes, and
// learns what it must act on from events: a control frame from a peer (STATUS, REPORT, ERROR, BYE),
// or the plane's own failure with its fault.
//
// Threads and memory: the table's mutex guards the NodeState, the op records, the events and the
// traces; reductions and copies run outside it on memory the op record keeps mapped (shared_ptr
// segments); counters are atomics. Each part has its own lock and none is held while another part
// calls back into the table (lock order: the table's, then the exchange's or the executor's, then the
// fabric's). The plane owns its NodeState, its op records, its ports, its exchange and its executor;
// the result and scratch arenas belong to the caller and must outlive the plane. A frame queued to a
// peer points into an op's memory, which the op keeps until the send completes
// (Collective::send_started/send_finished); close() stops the exchange (its progress thread and
// fabric) before any op's memory goes.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "arena.h"
#include "channel.h"
#include "collective.h"
#include "exchange.h"
#include "executor.h"
#include "fabric.h"
#include "frame.h"
#include "node_state.h"
#include "ring.h"
#include "worker_port.h"

namespace smddp {

struct PlaneConfig {
  Topology topo;
  std::vector<std::string> rank_names;  // local rank i before it connects
  std::vector<std::string> node_names;  // node j in messages (one per node)
  std::string me;  // how this daemon is named in messages ("node 0 (host, ranks 0-3)")
  std::int64_t spin_ns = 200'000;  // link threads and the progress thread spin (yielding) this long, then sleep
  std::int64_t push_timeout_ns = 60'000'000'000;  // a done ring full this long: its worker is stuck
  std::uint32_t threads = 2;  // compute threads sharing the chunks of large collectives (0: none)
  // One thread pops every worker's submit ring (asleep on all their bells at once: futex_waitv)
  // instead of a thread per worker; ignored where futex_waitv may not be called (an older kernel, or
  // a seccomp filter that refuses it). The daemon keeps the default; tests/engine runs both.
  // Measured on 2 cores, 4 workers: a 4 KiB all-reduce 18-26 us against 31-37 (docs/performance.md).
  bool one_poller = true;
  // Between daemons: a HEARTBEAT to every peer each quarter of this, and a link that brings nothing
  // for this long goes down as silent (0: neither).
  std::int64_t heartbeat_ns = 0;
  bool trace = false;  // keep each collective's phases for the timeline (take_traces)
  // Which fabric links the daemons (fabric.h): "tcp", or "ofi" (libfabric from ofi_library, the
  // provider named ofi_provider).
  std::string fabric = "tcp";
  std::string ofi_library;
  std::string ofi_provider;
  // How the daemon's statistics class completions (take_completions): size classes by their upper
  // limits in bytes, ascending (one more class holds the larger ones), and latency buckets by their
  // upper bounds in seconds, ascending (one more bucket holds the slower ones). At most 255 each.
  std::vector<std::uint64_t> size_limits;
  std::vector<double> latency_buckets;
};

// The phases of a collective the timeline shows, as the daemon names them.
enum Phase : std::uint8_t { kWaitLocal, kLocalReduce, kServerReduce, kSend, kReceive, kLocalCopy, kPhases };
const char* phase_name(Phase p);

// What Python must act on, in order.
struct PlaneEvent {
  enum Kind { kFailed = 2, kPeer = 3 } kind = kFailed;
  Verdict verdict;  // kFailed: why
  // kPeer: a control frame (STATUS, REPORT, ERROR, BYE) from peer node `peer`, whole.
  std::uint32_t peer = 0;
  Header header;
  std::string payload;
};

// A retired collective's phases (wall-clock seconds), when PlaneConfig::trace is set.
struct Trace {
  std::uint64_t seq = 0;
  std::string what;
  std::vector<std::pair<Phase, std::pair<double, double>>> phases;
};

// Collectives completed here, summed by what the daemon's statistics tell apart (kind, dtype are
// wire codes; size_class and bucket index PlaneConfig::size_limits and latency_buckets).
struct Completion {
  std::uint8_t kind = 0;
  std::uint8_t dtype = 0;
  std::uint8_t size_class = 0;
  std::uint8_t bucket = 0;
  std::uint64_t count = 0;
  double seconds = 0;  // their latencies, from first sight here to DONE, summed
};

// One local worker's device copies as its engine counts them in its channel (DeviceCounts, channel.h):
// shown by `smddp status` and the metrics, never trusted for anything else.
struct WorkerDeviceCounts {
  std::uint32_t rank = 0;
  std::uint64_t d2h_bytes = 0;
  std::uint64_t h2d_bytes = 0;
  std::uint64_t d2h_copies = 0;
  std::uint64_t h2d_copies = 0;
  std::uint32_t node_reduce = 0;  // DeviceCounts::node_reduce (a code past 3 shows as 0)
};

struct PlaneCounters {
  std::uint64_t collectives = 0;
  std::uint64_t reduced_bytes = 0;  // input bytes the reductions read
  double reduce_seconds = 0;
};

class LocalPlane final : private Exchange::Owner {
 public:
  // `scratch` holds the server rows of a job of several nodes (may be null for one node).
  LocalPlane(PlaneConfig cfg, Arena* results, Arena* scratch = nullptr);
  ~LocalPlane() override;
  LocalPlane(const LocalPlane&) = delete;
  LocalPlane& operator=(const LocalPlane&) = delete;

  // Local rank `local` (global rank `rank`, named `name`) joined with its channel (mapped
  // read-write, channel_bytes() or more) and the daemon's end of its side socket (`side`, which the
  // plane owns from now on: closed on a refusal too): its ring is polled from now on. "" or why not.
  std::string add_worker(std::uint32_t local, std::uint32_t rank, const std::string& name,
                         std::shared_ptr<Segment> channel, int side);
  // The worker's connection ended: its thread handles what the worker had published, then stops.
  // Returns whether the worker said BYE on its ring.
  bool remove_worker(std::uint32_t local);

  // Peer node `node`'s link: `fd`, a stream Python connected and authenticated, which the plane
  // owns from now on (closed on failure too). Frames queued for it before are sent first. "" or why not.
  std::string add_peer(std::uint32_t node, int fd);
  // Send a control frame (STATUS, REPORT, ERROR, BYE) to peer `node` after everything queued to it
  // before; the payload is the plane's until it leaves. "" or why not (no such peer; its link is down).
  std::string send_control(std::uint32_t node, const std::uint8_t header[kHeaderSize], std::string payload);
  // Wait up to timeout_ns for every control frame to leave (or its link to go down): true if they did.
  bool flush(std::int64_t timeout_ns);
  std::vector<PeerCounters> peer_counters();
  // Each worker that joined (left ones too: their channels stay mapped), by local rank.
  std::vector<WorkerDeviceCounts> device_counts();
  // The fabric to the other daemons as it describes itself, and its counters ("" and zeros: one node).
  std::string fabric_describe();
  FabricCounters fabric_counters();
  std::vector<Trace> take_traces();

  // The table's job-wide rules, under the plane's lock (node_state.h).
  Verdict rank_left_early(std::uint32_t local, bool joined, const std::string& reason, bool* recorded);
  bool left_early(std::uint32_t local);
  bool all_ranks_gone();
  void name_rank(std::uint32_t local, const std::string& name);
  std::size_t in_flight();
  // The collectives in flight and not done yet (for stall reports): each one's sequence number, how
  // long since it was first seen, its fingerprint as messages spell it, and the local ranks that
  // have not submitted it.
  struct Waiting {
    std::uint64_t seq;
    double age_s;
    std::string what;
    std::vector<std::uint32_t> late;
    std::vector<std::uint32_t> late_nodes;  // peer nodes whose part has not come
  };
  std::vector<Waiting> waiting();

  // The job failed elsewhere (Python said so): handle nothing more, wake every worker's waits.
  void abort();
  // The next event, waiting up to timeout_ns; false if none came.
  bool next_event(std::int64_t timeout_ns, PlaneEvent* out);
  // What completed since the last take, summed per (kind, dtype, size class, latency bucket): a few
  // rows however many collectives, so that the daemon's Python does no work per collective.
  std::vector<Completion> take_completions();
  PlaneCounters counters();
  // Chunks waiting for a compute thread: this node's local work, server reductions.
  std::pair<std::size_t, std::size_t> queued_tasks();
  // Stops every thread (after remove_worker or not); idempotent.
  void close();

 private:
  struct Op;
  // A chunk of a collective: this node's local work, or a server reduction (all nodes' partials in).
  struct Task {
    std::shared_ptr<Op> op;
    Chunk chunk;
    bool server = false;
  };
  // The data frame being received from a peer (the progress thread only): where its payload went.
  struct Receiving {
    std::shared_ptr<Op> op;
    Chunk chunk;
    bool discard = false;  // the job failed at its header: read and dropped
  };
  void run(WorkerPort* port);
  // The one poller (PlaneConfig::one_poller): every port's submit ring in turn, a port drained and
  // retired once told to stop, every one at close; asleep on all their bells and poll_bell_.
  void poll();
  void retire_port(WorkerPort* port);
  void ring_poller();
  void handle(WorkerPort* port, const std::uint8_t* slot);
  void on_attach(WorkerPort* port, const Header& h);
  void on_submit(WorkerPort* port, const Header& h);
  void on_release(WorkerPort* port, const Header& h);
  void on_bye(WorkerPort* port);
  std::shared_ptr<Op> new_op_locked(const Spec& spec, std::shared_ptr<Collective> c, std::string* why);
  void start_locked(const std::shared_ptr<Op>& op, std::vector<Task> tasks, std::unique_lock<std::mutex>* lock);
  bool run_task(const Task& t);
  bool run_local(const std::shared_ptr<Op>& op, const Chunk& chunk);
  bool run_server(const std::shared_ptr<Op>& op, const Chunk& chunk);
  bool fold(const Op& op, const std::vector<const void*>& in, std::uint64_t n, std::uint8_t* out, bool partial);
  // The bytes of local rank `local`'s slice of a node-summed collective (what its slot holds).
  std::uint64_t slice_bytes(const Spec& spec, std::uint32_t local) const;
  // A node's local step over elements [first, first + n): fold(), or, for a collective its ranks
  // summed on their GPUs, each element copied from its slice's owner's slot.
  bool local_fold(const Op& op, const std::vector<const void*>& in, std::uint64_t first, std::uint64_t n,
                  std::uint8_t* out, bool partial);
  void partial_in(const std::shared_ptr<Op>& op, std::uint64_t index, std::uint32_t from);
  // A chunk is complete (`t`: one node's local reduction of it, whose result may be published).
  bool chunk_done(const std::shared_ptr<Op>& op, const Chunk* t = nullptr);
  // Streaming (channel.h): wait until every streaming input of `o` is in place up to `end` bytes
  // (false: the job failed meanwhile, or a worker took longer than the push timeout, failing it);
  // put `op`'s result slot on every worker's stream block; chunk `t` reduced, publish how far it is.
  bool inputs_in(const Op& o, std::uint64_t end);
  void publish_locked(Op& op);
  void advance_locked(Op& op, const Chunk& t);
  // A data frame to peer `node`, through the exchange, without the table's lock.
  bool send_data(const std::shared_ptr<Op>& op, std::uint32_t node, Msg type, std::uint32_t shard,
                 std::uint64_t offset, const std::uint8_t* payload, std::uint64_t length);
  bool send_all(const std::shared_ptr<Op>& op, Msg type, std::uint32_t shard, std::uint64_t offset,
                const std::uint8_t* payload, std::uint64_t length);
  void phase_locked(Op& op, Phase p, double t0, double t1);
  void phase(Op& op, Phase p, double t0, double t1);
  void refuse(Receiving* r, const Verdict& v);
  // Exchange::Owner: called on the progress thread without the exchange's lock.
  void data_header(std::uint32_t peer, const Header& h, std::uint8_t** dest) override;
  void data_frame(std::uint32_t peer, const Header& h) override;
  void data_sent(std::uint64_t seq) override;
  void control_frame(std::uint32_t peer, const Header& h, std::string payload) override;
  void exchange_failed(const Verdict& v) override;
  void complete_locked(const std::shared_ptr<Op>& op, std::unique_lock<std::mutex>* lock);
  void retire_locked(std::uint64_t seq);
  // A new arena segment: lent to the fabric (registered once, where it registers memory).
  void lend_locked(const Segment& seg);
  void fail_locked(const Verdict& v);
  void fail(const Verdict& v);
  void push_event_locked(PlaneEvent e);

  PlaneConfig cfg_;
  Arena* results_;
  Arena* scratch_;
  // The op table: its rules, its records, the events and traces, under mu_.
  std::mutex mu_;
  std::condition_variable event_cv_;
  NodeState table_;
  std::map<std::uint64_t, std::shared_ptr<Op>> ops_;
  std::deque<PlaneEvent> events_;
  std::map<std::uint32_t, Completion> completions_;  // by kind, dtype, size class, bucket
  std::vector<Trace> traces_;
  std::atomic<bool> failed_{false};  // set under mu_; read without it by the executor
  bool closed_ = false;
  // Counters (counters()): atomics, bumped without the lock by the threads that do the work.
  std::atomic<std::uint64_t> collectives_{0};
  std::atomic<std::uint64_t> reduced_bytes_{0};  // input bytes the reductions read
  std::atomic<std::uint64_t> reduce_ns_{0};
  // The worker ports, by local rank (null before it joins); the vector is sized once, its entries set
  // under mu_.
  std::vector<std::unique_ptr<WorkerPort>> ports_;
  // The one poller, where it runs: the ports it serves by local rank (each set once, under mu_, before
  // it is rung), the word it sleeps on beside the rings' bells (rung for a new port, a port to stop,
  // close), and the ports it retired (remove_worker waits for its port there).
  bool polling_ = false;
  std::thread poller_;
  std::unique_ptr<std::atomic<WorkerPort*>[]> polled_;
  std::atomic<std::uint32_t> poll_bell_{0};
  std::atomic<bool> poll_stop_{false};
  std::mutex retire_mu_;
  std::condition_variable retire_cv_;
  std::vector<Receiving> receiving_;  // by peer node: the progress thread only
  Executor executor_;
  std::unique_ptr<Exchange> exchange_;  // several nodes only
};

}  // namespace smddp
