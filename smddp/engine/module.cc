// smddp._engine: the compiled engine's Python face, bound with nanobind (docs/engine.md, "Bindings").
//
// It binds what smddp runs; what only tests and rigs call is smddp_rigs._engine_testing
// (rigs/smddp_rigs/_engine_testing.cc), never in the wheel. Only the binding files touch Python
// objects; the engine's own code never does. Every result is a named class (the records below) or a
// plain typed value, never one of several shapes told apart by type; every error goes through one
// table (Err, raise_error, translate); the GIL is released wherever the engine may block. The stubs
// (smddp/_engine.pyi) are generated from these bindings (make stubs; tests/unit/test_engine_faces.py
// regenerates and compares them).
//
// Memory: each bound object owns its engine object (Arena, LocalPlane, WorkerChannel: deleted with
// it; a Segment is shared, std::shared_ptr, with the engine and every numpy view of its buffer) and
// holds a reference to each Python object in its fields (nb::object), visited for the garbage
// collector where a field may lead back to it (WorkerChannel, Started).
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <nanobind/typing.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "arena.h"
#include "channel.h"
#include "cuda_driver.h"
#include "device_path.h"
#include "device_step.h"
#include "native_api.h"
#include "device_watch.h"
#include "fdpass.h"
#include "frame.h"
#include "local_plane.h"
#include "nb_binding.h"
#include "reduce.h"
#include "reduce16.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using namespace smddp::bind;

// --------------------------------------------------------------------------------------- codec

// The frame header codec's Python face: smddp.proto.frames encodes and decodes through these, so
// that the engine's codec (frame.cc) is the only one.
using HeaderFields = std::tuple<std::uint8_t, std::uint16_t, std::uint8_t, std::uint8_t, std::uint8_t, std::uint32_t,
                                std::uint64_t, std::uint32_t, std::uint32_t, std::uint64_t, std::uint64_t, std::uint64_t>;

HeaderFields codec_decode(nb::handle data) {
  ReadView v(data);
  smddp::Header h;
  const std::string why = smddp::decode_header(v.data(), v.size(), &h);
  if (!why.empty()) raise_error(Err::kProtocol, why);
  return {static_cast<std::uint8_t>(h.type), h.flags, h.dtype, h.op, h.kind, h.sender, h.seq, h.shard, h.aux,
          h.offset, h.length, h.count};
}

// One field of a header to encode: a Python int in [0, limit], else refused naming the message, the
// field and its value (as Python spells it: it may be beyond any C++ integer).
std::uint64_t codec_field(nb::handle v, const char* msg, const char* name, std::uint64_t limit) {
  const unsigned long long x = PyLong_AsUnsignedLongLong(v.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
  } else if (x <= limit) {
    return x;
  }
  raise_error(Err::kProtocol, std::string("cannot encode ") + msg + ": field " + name + "=" +
                                  nb::cast<std::string>(nb::str(v)) + " out of range");
}

nb::bytes codec_encode(long long type, nb::handle flags, nb::handle dtype, nb::handle op, nb::handle kind,
                       nb::handle sender, nb::handle seq, nb::handle shard, nb::handle aux, nb::handle offset,
                       nb::handle length, nb::handle count) {
  const char* msg = type >= 0 && type <= 255 ? smddp::msg_name(static_cast<std::uint8_t>(type)) : nullptr;
  if (msg == nullptr) raise_error(Err::kProtocol, "cannot encode unknown message type " + std::to_string(type));
  smddp::Header h;
  h.type = static_cast<smddp::Msg>(type);
  h.flags = static_cast<std::uint16_t>(codec_field(flags, msg, "flags", UINT16_MAX));
  h.dtype = static_cast<std::uint8_t>(codec_field(dtype, msg, "dtype", UINT8_MAX));
  h.op = static_cast<std::uint8_t>(codec_field(op, msg, "op", UINT8_MAX));
  h.kind = static_cast<std::uint8_t>(codec_field(kind, msg, "kind", UINT8_MAX));
  h.sender = static_cast<std::uint32_t>(codec_field(sender, msg, "sender", UINT32_MAX));
  h.seq = codec_field(seq, msg, "seq", smddp::kMaxU63);
  h.shard = static_cast<std::uint32_t>(codec_field(shard, msg, "shard", UINT32_MAX));
  h.aux = static_cast<std::uint32_t>(codec_field(aux, msg, "aux", UINT32_MAX));
  h.offset = codec_field(offset, msg, "offset", smddp::kMaxU63);
  h.length = codec_field(length, msg, "length", UINT64_MAX);
  h.count = codec_field(count, msg, "count", smddp::kMaxU63);
  std::uint8_t out[smddp::kHeaderSize];
  const std::string why = smddp::encode_header(h, out);
  if (!why.empty()) raise_error(Err::kProtocol, why);
  return nb::bytes(reinterpret_cast<const char*>(out), smddp::kHeaderSize);
}

// ------------------------------------------------------------------------------------- records

// Where a slot lies: `nbytes` at `offset` of segment `segment`.
struct SlotRec {
  std::uint32_t segment = 0;
  std::uint64_t offset = 0;
  std::uint64_t nbytes = 0;
};

// A slot an arena gave: its segment and offset, and the segment made for it (None if none was).
struct Allocated {
  std::uint32_t segment = 0;
  std::uint64_t offset = 0;
  std::shared_ptr<smddp::Segment> fresh;
};

struct PeerFrame {
  std::uint32_t node = 0;
  std::uint8_t type = 0;
  std::uint64_t seq = 0;
  std::uint32_t aux = 0;
  std::string payload;
};

struct PlaneFailure {
  std::string fault;
  std::string why;
};

// What WorkerChannel.pop() took off the done ring, when it took something.
struct Completed {  // a collected collective the engine completed in that pop
  std::uint64_t seq = 0;
  std::optional<std::string> error;  // a device one's copy back that could not be enqueued: why
};
struct Unmatched {  // a DONE the channel had nobody for (the general way's, or the daemon's fault)
  std::string header;
};

// run()'s end: DONE (complete, the result in place), CLOSED (nothing done: starts are closed) or
// PARKED (not complete in time: its seq and input slot, for resume or adopt).
enum class RunEnd { kDone, kClosed, kParked };
struct Ran {
  RunEnd end = RunEnd::kDone;
  std::uint64_t seq = 0;
  std::optional<SlotRec> slot;
};

// ------------------------------------------------------------------------------------- Segment

using SegmentPtr = std::shared_ptr<smddp::Segment>;

// The buffer protocol: the whole mapping (read-only when the segment is); a view holds the Python
// object, which holds the segment, so a numpy array made from it keeps the mapping alive.
int segment_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  smddp::Segment* seg = nb::inst_ptr<smddp::Segment>(self);
  return PyBuffer_FillInfo(view, self, seg->base(), static_cast<Py_ssize_t>(seg->size()), seg->writable() ? 0 : 1,
                           flags);
}

PyType_Slot kSegmentSlots[] = {
    {Py_bf_getbuffer, reinterpret_cast<void*>(segment_getbuffer)},
    {0, nullptr},
};

SegmentPtr segment_create(long long id, long long size, const std::string& name) {
  if (id < 0 || size < 0) raise_error(Err::kProtocol, "out of range: a negative offset, length, shard or size");
  if (id > static_cast<long long>(UINT32_MAX)) raise_error(Err::kProtocol, "segment id out of range");
  std::string why;
  SegmentPtr seg;
  {
    nb::gil_scoped_release unlocked;  // memfd_create, ftruncate and mmap: system calls
    seg = smddp::Segment::create(static_cast<std::uint32_t>(id), static_cast<std::uint64_t>(size), name, &why);
  }
  if (!seg) raise_error(Err::kOS, why);
  return seg;
}

// Takes the fd over: closed on a refusal too.
SegmentPtr segment_attach(long long id, int fd, long long size, bool writable) {
  if (id < 0 || id > static_cast<long long>(UINT32_MAX) || size < 0) {
    if (fd >= 0) ::close(fd);
    raise_error(Err::kProtocol, "segment " + std::to_string(id) + ": id or size out of range");
  }
  std::string why;
  SegmentPtr seg =
      smddp::Segment::attach(static_cast<std::uint32_t>(id), fd, static_cast<std::uint64_t>(size), writable, &why);
  if (!seg) raise_error(Err::kProtocol, why);
  return seg;
}

void segment_check(const smddp::Segment& seg, long long offset, long long nbytes) {
  std::uint8_t* p = nullptr;
  const std::string why =
      offset < 0 || nbytes < 0
          ? "segment " + std::to_string(seg.id()) + ": range [" + std::to_string(offset) + ", +" +
                std::to_string(nbytes) + ") outside its " + std::to_string(seg.size()) + " bytes"
          : seg.range(static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(nbytes), &p);
  if (!why.empty()) raise_error(Err::kProtocol, why);
}

// --------------------------------------------------------------------------------------- Arena

Allocated arena_alloc(smddp::Arena& arena, long long nbytes) {
  if (nbytes < 0) raise_error(Err::kProtocol, "a slot of a negative size");
  smddp::Slot slot;
  Allocated out;
  std::string why;
  {
    nb::gil_scoped_release unlocked;  // may wait for the arena's lock, or make a segment
    why = arena.alloc(static_cast<std::uint64_t>(nbytes), &slot, &out.fresh);
  }
  if (!why.empty()) raise_error(Err::kOS, why);
  out.segment = slot.segment;
  out.offset = slot.offset;
  return out;
}

// An arena's segment `id`, or None (an id no u32 holds names none).
SegmentPtr arena_segment(smddp::Arena& arena, long long id) {
  if (id < 0 || id > static_cast<long long>(UINT32_MAX)) return nullptr;
  return arena.segment(static_cast<std::uint32_t>(id));
}

void arena_free(smddp::Arena& arena, long long segment, long long offset, long long nbytes) {
  if (segment < 0 || segment > static_cast<long long>(UINT32_MAX) || offset < 0 || nbytes < 0)
    raise_error(Err::kValue, "not a slot of this arena");
  const std::string why = arena.free(smddp::Slot{static_cast<std::uint32_t>(segment),
                                                 static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(nbytes)});
  if (!why.empty()) raise_error(Err::kValue, why);
}

// ---------------------------------------------------------------------------------- LocalPlane

// The fields of a PlaneConfig (smddp.daemon.config), read by name: a wrong type or a missing field
// raises TypeError naming it (a missing one: AttributeError, as Python's getattr).
struct ConfigFields {
  nb::handle obj;

  nb::object get(const char* name) { return nb::getattr(obj, name); }
  [[noreturn]] static void wrong(const char* name, const char* want) {
    raise_error(Err::kType, std::string("PlaneConfig.") + name + " must be " + want);
  }
  long long integer(const char* name) {
    nb::object v = get(name);
    if (!PyLong_Check(v.ptr()) || PyBool_Check(v.ptr())) wrong(name, "an int");
    const long long x = PyLong_AsLongLong(v.ptr());
    if (x == -1 && PyErr_Occurred()) throw nb::python_error();
    return x;
  }
  double real(const char* name) {
    nb::object v = get(name);
    if (!PyFloat_Check(v.ptr()) && !(PyLong_Check(v.ptr()) && !PyBool_Check(v.ptr()))) wrong(name, "a number");
    const double x = PyFloat_AsDouble(v.ptr());
    if (x == -1.0 && PyErr_Occurred()) throw nb::python_error();
    return x;
  }
  bool flag(const char* name) {
    nb::object v = get(name);
    if (!PyBool_Check(v.ptr())) wrong(name, "a bool");
    return v.ptr() == Py_True;
  }
  std::string str(const char* name) {
    nb::object v = get(name);
    if (!PyUnicode_Check(v.ptr())) wrong(name, "a str");
    return nb::cast<std::string>(v);
  }
  // A sequence of numbers, ascending, at most 255 of them (the plane indexes them with a byte).
  template <typename T>
  std::vector<T> ascending(const char* name) {
    nb::object v = get(name);
    const char* want = "a sequence of numbers, ascending, at most 255";
    if (PyUnicode_Check(v.ptr()) || PyBytes_Check(v.ptr()) || !PySequence_Check(v.ptr())) wrong(name, want);
    const Py_ssize_t n = PySequence_Size(v.ptr());
    if (n < 0 || n > 255) {
      PyErr_Clear();
      wrong(name, want);
    }
    std::vector<T> out;
    for (Py_ssize_t i = 0; i < n; i++) {
      nb::object x = nb::steal(PySequence_GetItem(v.ptr(), i));
      bool good = x.is_valid() && !PyBool_Check(x.ptr()) &&
                  (PyLong_Check(x.ptr()) || (std::is_floating_point_v<T> && PyFloat_Check(x.ptr())));
      T value{};
      if (good) {
        if constexpr (std::is_floating_point_v<T>) {
          value = static_cast<T>(PyFloat_AsDouble(x.ptr()));
        } else {
          const unsigned long long u = PyLong_AsUnsignedLongLong(x.ptr());  // a negative one raises OverflowError
          good = !(u == static_cast<unsigned long long>(-1) && PyErr_Occurred());
          value = static_cast<T>(u);
        }
      }
      if (good && !out.empty() && !(out.back() < value)) good = false;
      if (!good) {
        PyErr_Clear();
        wrong(name, want);
      }
      out.push_back(value);
    }
    return out;
  }
  std::vector<std::string> strs(const char* name) {
    nb::object v = get(name);
    if (PyUnicode_Check(v.ptr()) || PyBytes_Check(v.ptr())) wrong(name, "a sequence of str");
    std::vector<std::string> out;
    for (nb::handle item : v) {
      if (!PyUnicode_Check(item.ptr())) wrong(name, "a sequence of str");
      out.push_back(nb::cast<std::string>(item));
    }
    return out;
  }
};

// The bound plane: owns its LocalPlane, and holds the arenas it was given while it uses them.
struct Plane {
  std::unique_ptr<smddp::LocalPlane> plane;
  nb::object results;
  nb::object scratch;  // None on one node

  Plane(nb::handle config, nb::handle results_obj, nb::handle scratch_obj);
  ~Plane() {
    nb::gil_scoped_release unlocked;  // joins the link threads
    plane.reset();
  }
  Plane(const Plane&) = delete;
  Plane& operator=(const Plane&) = delete;
};

Plane::Plane(nb::handle config, nb::handle results_obj, nb::handle scratch_obj) {
  ConfigFields f{config};
  const long long node = f.integer("node"), local_size = f.integer("local_size"), world = f.integer("world"),
                  first_rank = f.integer("first_rank"), nnodes = f.integer("nnodes"),
                  chunk_bytes = f.integer("chunk_bytes"), replicate_bytes = f.integer("replicate_bytes"),
                  threads = f.integer("threads");
  const double spin_us = f.real("spin_us"), push_timeout_s = f.real("push_timeout_s"),
               heartbeat_s = f.real("heartbeat_s");
  smddp::PlaneConfig cfg;
  cfg.rank_names = f.strs("rank_names");
  cfg.node_names = f.strs("node_names");
  cfg.me = f.str("me");
  cfg.trace = f.flag("trace");
  cfg.fabric = f.str("fabric");
  cfg.ofi_library = f.str("ofi_library");
  cfg.ofi_provider = f.str("ofi_provider");
  cfg.size_limits = f.ascending<std::uint64_t>("size_limits");
  cfg.latency_buckets = f.ascending<double>("latency_buckets");
  for (long long v : {node, local_size, chunk_bytes, nnodes, first_rank, replicate_bytes})
    if (v < 0) raise_error(Err::kProtocol, "out of range: a negative offset, length, shard or size");
  constexpr long long kU32 = static_cast<long long>(UINT32_MAX);
  if (local_size == 0 || chunk_bytes == 0 || nnodes == 0 || node >= nnodes || nnodes > kU32 || local_size > kU32 ||
      world > kU32 || first_rank + local_size > world)
    raise_error(Err::kProtocol, "an impossible job layout");
  smddp::Arena* results_arena = nullptr;
  smddp::Arena* scratch_arena = nullptr;
  if (!nb::try_cast<smddp::Arena*>(results_obj, results_arena) || results_arena == nullptr ||
      (!scratch_obj.is_none() && (!nb::try_cast<smddp::Arena*>(scratch_obj, scratch_arena) || scratch_arena == nullptr)))
    raise_error(Err::kType, "results and scratch must be smddp._engine.Arena objects");
  if (spin_us < 0 || push_timeout_s <= 0 || threads < 0 || threads > 256 || heartbeat_s < 0)
    raise_error(Err::kValue,
                "spin_us, heartbeat_s and threads (at most 256) must not be negative, push_timeout_s must be positive");
  if (cfg.rank_names.size() != static_cast<std::size_t>(local_size))
    raise_error(Err::kValue, "one rank name per local rank");
  if (nnodes > 1 && (cfg.node_names.size() != static_cast<std::size_t>(nnodes) || scratch_arena == nullptr))
    raise_error(Err::kValue, "a job of several nodes needs node_names (one per node) and scratch");
  cfg.topo.node = static_cast<std::uint32_t>(node);
  cfg.topo.nnodes = static_cast<std::uint32_t>(nnodes);
  cfg.topo.local_size = static_cast<std::uint32_t>(local_size);
  cfg.topo.world = static_cast<std::uint32_t>(world);
  cfg.topo.first_rank = static_cast<std::uint32_t>(first_rank);
  cfg.topo.chunk_bytes = static_cast<std::uint64_t>(chunk_bytes);
  cfg.topo.replicate_bytes = static_cast<std::uint64_t>(replicate_bytes);
  cfg.spin_ns = spin_ns(spin_us);
  cfg.push_timeout_ns = static_cast<std::int64_t>(push_timeout_s * 1e9);
  cfg.heartbeat_ns = static_cast<std::int64_t>(heartbeat_s * 1e9);
  cfg.threads = static_cast<std::uint32_t>(threads);
  try {
    plane = std::make_unique<smddp::LocalPlane>(std::move(cfg), results_arena, scratch_arena);
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::system_error& e) {
    raise_error(Err::kOS, std::string("cannot start the plane's threads: ") + e.what());
  } catch (const std::exception& e) {
    raise_error(Err::kOS, std::string("cannot start the plane: ") + e.what());
  }
  results = nb::borrow(results_obj);
  scratch = nb::borrow(scratch_obj);
}

std::uint32_t local_arg(long long v) { return u32(v, Err::kValue, "local rank out of range"); }
std::uint32_t node_arg(long long v) { return u32(v, Err::kValue, "node out of range"); }

// The plane takes the fd `side` over: closed on any refusal too.
void plane_add_worker(Plane& p, long long local, long long rank, const std::string& name, nb::handle channel_obj,
                      int side) {
  if (side < 0) raise_error(Err::kValue, "add_worker: side is an fd");
  auto refuse = [side](Err err, const char* why) {
    ::close(side);
    raise_error(err, why);
  };
  if (local < 0 || local > static_cast<long long>(UINT32_MAX)) refuse(Err::kValue, "local rank out of range");
  if (rank < 0) refuse(Err::kProtocol, "out of range: a negative offset, length, shard or size");
  SegmentPtr channel;
  if (!nb::try_cast(channel_obj, channel) || !channel) refuse(Err::kType, "expected an smddp._engine.Segment");
  std::string why;
  try {
    why = p.plane->add_worker(static_cast<std::uint32_t>(local), static_cast<std::uint32_t>(rank), name,
                              std::move(channel), side);
  } catch (const std::system_error& e) {
    why = std::string("cannot start its thread: ") + e.what();
  }
  if (!why.empty()) raise_error(Err::kProtocol, why);
}

// None when nothing came in time.
nb::object plane_next_event(Plane& p, double timeout_s) {
  smddp::PlaneEvent e;
  bool got = false;
  {
    nb::gil_scoped_release unlocked;
    got = p.plane->next_event(seconds_ns(timeout_s), &e);
  }
  if (!got) return nb::none();
  if (e.kind == smddp::PlaneEvent::kPeer)
    return nb::cast(PeerFrame{e.peer, static_cast<std::uint8_t>(e.header.type), e.header.seq, e.header.aux,
                              std::move(e.payload)});
  const char* fault = e.verdict.fault == smddp::Fault::kMismatch   ? "mismatch"
                      : e.verdict.fault == smddp::Fault::kPeerLost ? "peer_lost"
                                                                   : "protocol";
  return nb::cast(PlaneFailure{fault, e.verdict.why});
}

std::string plane_send_control(Plane& p, long long node, nb::handle header, nb::handle payload) {
  const std::uint32_t j = node_arg(node);
  ReadView h(header);
  if (h.size() != smddp::kHeaderSize) raise_error(Err::kValue, "a header is 56 bytes");
  std::string body;
  if (payload.is_valid() && !payload.is_none()) {
    ReadView b(payload);
    body.assign(reinterpret_cast<const char*>(b.data()), b.size());
  }
  std::uint8_t frame[smddp::kHeaderSize];
  std::memcpy(frame, h.data(), smddp::kHeaderSize);
  nb::gil_scoped_release unlocked;
  return p.plane->send_control(j, frame, std::move(body));
}

std::pair<std::string, std::map<std::string, std::uint64_t>> plane_fabric(Plane& p) {
  std::string d;
  smddp::FabricCounters c;
  {
    nb::gil_scoped_release unlocked;
    d = p.plane->fabric_describe();
    c = p.plane->fabric_counters();
  }
  if (d.empty()) return {d, {}};
  return {d,
          {{"registrations", c.registrations},
           {"temp_registrations", c.temp_registrations},
           {"messages_in", c.messages_in},
           {"messages_out", c.messages_out},
           {"rejected", c.rejected}}};
}

// ------------------------------------------------------------------------------- WorkerChannel

struct Started;

// Owns its channel; `keep` (seq -> the destination object or an address's owner) holds each collected
// collective's destination alive while the channel may still copy into it (collect): a taker's copy
// may be running while the caller's own failure handling gives up its references. An entry goes
// when the collective completes here (pop, finish) or with the channel, which is deleted before
// `keep` lets go (~Channel). `live` holds every record begin() made until it finishes, so that
// shutdown finds the collectives nobody waited for; records hold the channel too (a cycle the
// garbage collector breaks: channel_traverse, channel_clear).
struct Channel {
  std::unique_ptr<smddp::WorkerChannel> ch;
  nb::dict keep;        // seq -> what keeps a collected collective's destination in place
  nb::object live;      // bind(): seq -> its record, begun and not finished (a dict; unset before)
  nb::object arena;     // bind(): the worker's arena, begin()'s slots
  nb::object handle_type;  // bind(): the class begin() makes (Started, or a subclass)
  nb::object ctx;          // bind(): what each record names as its `_client`
  smddp::Arena* arena_ptr = nullptr;
  std::uint32_t rank = 0;       // bind(): the sender of begin()'s SUBMITs
  std::uint64_t batch = 0;      // bind(): RELEASE batch bytes
  std::int64_t timeout_ns = 0;  // bind(): the job's timeout (a wait without one; a RELEASE's ring wait)
  std::int64_t spin_ns = 0;     // bind(): how long a wait spins before it sleeps

  explicit Channel(const std::string& name) {
    std::string why;
    ch = smddp::WorkerChannel::create(name, &why);
    if (!ch) raise_error(Err::kOS, why);
  }
  ~Channel() { ch.reset(); }  // first: no taker is left to copy into what `keep` holds
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  bool bound() const { return handle_type.is_valid(); }
  void require_bound(const char* call) const {
    if (!bound()) raise_error(Err::kRuntime, std::string(call) + ": the channel is not bound (bind)");
  }
  // What bind() gave that leads back to the client (its ctx, the records of its live table) let go;
  // begin() then refuses until bound again.
  void let_go() {
    live.reset();
    ctx.reset();
    handle_type.reset();
  }
  // `seq`'s entry of a table gone, if it has one.
  static void discard(nb::handle table, std::uint64_t seq) {
    if (!table.is_valid()) return;
    nb::object key = nb::int_(seq);
    if (PyDict_DelItem(table.ptr(), key.ptr()) != 0) PyErr_Clear();
  }
  void unkeep(std::uint64_t seq) { discard(keep, seq); }
};

int channel_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  Channel* c = nb::inst_ptr<Channel>(self);
  Py_VISIT(c->keep.ptr());
  Py_VISIT(c->live.ptr());
  Py_VISIT(c->arena.ptr());
  Py_VISIT(c->handle_type.ptr());
  Py_VISIT(c->ctx.ptr());
  return 0;
}

// Breaks cycles; the WorkerChannel itself goes only with the object (records still hold it).
int channel_clear(PyObject* self) {
  if (nb::inst_ready(self)) nb::inst_ptr<Channel>(self)->let_go();
  return 0;
}

PyType_Slot kChannelSlots[] = {
    {Py_tp_traverse, reinterpret_cast<void*>(channel_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(channel_clear)},
    {0, nullptr},
};

[[noreturn]] void raise_ring(const Channel& c, smddp::RingWait r) {
  if (r == smddp::RingWait::kTimeout) raise_error(Err::kTimeout, kRingFull);
  raise_error(Err::kProtocol, c.ch->why());
}

[[noreturn]] void raise_fast(const Channel& c, smddp::FastEnd end) {
  if (end == smddp::FastEnd::kRingFull) raise_error(Err::kTimeout, kRingFull);
  raise_error(Err::kProtocol, c.ch->why());
}

// A start() that did not start and is not kHeld (which callers answer with CLOSED or None).
[[noreturn]] void raise_not_started(const Channel& c, smddp::FastEnd end) {
  if (end == smddp::FastEnd::kArena) raise_error(Err::kOS, c.ch->why());
  if (end == smddp::FastEnd::kBacklog) raise_error(Err::kCollectiveTimeout, c.ch->backlog_why());
  raise_fast(c, end);
}

void channel_push(Channel& c, nb::bytes header, double timeout_s, double spin_us) {
  if (header.size() != smddp::kHeaderSize) raise_error(Err::kValue, "a descriptor is one 56-byte header");
  std::uint8_t frame[smddp::kHeaderSize];
  std::memcpy(frame, header.c_str(), smddp::kHeaderSize);
  // A ring with room takes the descriptor at once: no need to give up the GIL (and wait to get it
  // back, behind the thread that takes DONEs) for that. Only a full ring's wait releases it.
  smddp::RingWait r = c.ch->try_push(frame);
  if (r == smddp::RingWait::kTimeout) {
    nb::gil_scoped_release unlocked;
    r = c.ch->push(frame, static_cast<std::int64_t>(timeout_s * 1e9), spin_ns(spin_us));
  }
  if (r != smddp::RingWait::kReady) raise_ring(c, r);
}

// The next header of the done ring (Unmatched: the background taker's, channel.h), a collected
// collective the engine completed in this pop (Completed; a device one's result on its way back to
// the device, or why it could not go), or None.
nb::object channel_pop(Channel& c, double timeout_s, double spin_us) {
  std::uint8_t slot[smddp::kSlotBytes];
  smddp::RingWait r;
  bool completed = false;
  smddp::Located at;
  {
    nb::gil_scoped_release unlocked;
    r = c.ch->pop(slot, static_cast<std::int64_t>(timeout_s * 1e9), spin_ns(spin_us), &completed, &at);
  }
  if (r == smddp::RingWait::kTimeout) return nb::none();
  if (r == smddp::RingWait::kCorrupt) raise_error(Err::kProtocol, c.ch->why());
  if (completed) {
    smddp::Header h;  // the channel decoded it: a DONE
    (void)smddp::decode_header(slot, smddp::kHeaderSize, &h);
    c.unkeep(h.seq);
    Completed out{h.seq, std::nullopt};
    if (!at.why.empty()) out.error = at.why;
    return nb::cast(std::move(out));
  }
  return nb::cast(Unmatched{std::string(reinterpret_cast<const char*>(slot), smddp::kHeaderSize)});
}

// nbytes < 0: never waits for the next push (channel.h)
void channel_release(Channel& c, long long rank, long long seq, long long nbytes, long long batch_bytes,
                     double timeout_s, double spin_us) {
  if (rank < 0 || rank > static_cast<long long>(UINT32_MAX) || seq < 0 || batch_bytes < 0)
    raise_error(Err::kValue, "release: rank, seq and batch_bytes are non-negative");
  smddp::RingWait r;
  {
    nb::gil_scoped_release unlocked;
    r = c.ch->release(static_cast<std::uint32_t>(rank), static_cast<std::uint64_t>(seq), nbytes,
                      static_cast<std::uint64_t>(batch_bytes), static_cast<std::int64_t>(timeout_s * 1e9),
                      spin_ns(spin_us));
  }
  if (r != smddp::RingWait::kReady) raise_ring(c, r);
}

// An address argument (an int instead of a buffer): `count` elements of `dtype` that the caller keeps
// alive and in place (a torch tensor's data_ptr(): its numpy view costs more than the rest of the
// call). The engine cannot check it; only smddp's own callers pass one. ValueError (its message
// starting with `what`) for a zero address, count or dtype, or a length that overflows.
std::pair<std::uint8_t*, std::uint64_t> address_arg(nb::handle arg, long long dtype, long long count,
                                                    const char* what) {
  const unsigned long long addr = PyLong_AsUnsignedLongLong(arg.ptr());
  if (PyErr_Occurred()) throw nb::python_error();
  const std::uint64_t item = smddp::dtype_size(static_cast<std::uint8_t>(dtype));
  if (addr == 0 || item == 0 || count <= 0 || static_cast<std::uint64_t>(count) > UINT64_MAX / item)
    raise_error(Err::kValue, std::string(what) + " needs a non-zero address, count and dtype");
  return {reinterpret_cast<std::uint8_t*>(static_cast<std::uintptr_t>(addr)), static_cast<std::uint64_t>(count) * item};
}

// A few values inline and any more on the heap: what one call holds (most calls hold one buffer, and
// a heap allocation per call is the binding's largest cost after its dispatch).
template <typename T, std::size_t N>
class Small {
 public:
  void push_back(const T& v) {
    if (n_ < N) {
      inline_[n_] = v;
    } else {
      if (n_ == N) heap_.assign(inline_, inline_ + N);
      heap_.push_back(v);
    }
    n_++;
  }
  T* data() { return n_ <= N ? inline_ : heap_.data(); }
  const T* data() const { return n_ <= N ? inline_ : heap_.data(); }
  std::size_t size() const { return n_; }
  T& front() { return data()[0]; }

 private:
  T inline_[N]{};
  std::vector<T> heap_;
  std::size_t n_ = 0;
};

// What a fast collective sends, held for one begin() or run() call: a buffer, a tuple of buffers sent
// one after another (a fused buffer's parts, never packed first), or the address of `count` elements
// of `dtype` (address_arg). run()'s is also where its result goes (in place): writable.
struct Sources {
  Small<Py_buffer, 4> views;
  Small<smddp::Source, 4> sources;
  Sources() = default;
  Sources(const Sources&) = delete;
  Sources& operator=(const Sources&) = delete;
  ~Sources() {
    for (std::size_t i = 0; i < views.size(); i++) PyBuffer_Release(&views.data()[i]);
  }
  void one(PyObject* obj, bool writable) {
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, writable ? (PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) : PyBUF_C_CONTIGUOUS) != 0)
      throw nb::python_error();
    views.push_back(v);
    sources.push_back(smddp::Source{static_cast<const std::uint8_t*>(v.buf), static_cast<std::uint64_t>(v.len)});
  }
  void take(nb::handle src, long long dtype, long long count, bool writable) {
    if (PyLong_Check(src.ptr())) {
      const auto [data, len] = address_arg(src, dtype, count, "a fast collective's address");
      sources.push_back(smddp::Source{data, len});
      return;
    }
    if (!PyTuple_Check(src.ptr())) return one(src.ptr(), writable);
    const Py_ssize_t n = PyTuple_Size(src.ptr());
    for (Py_ssize_t i = 0; i < n; i++) one(PyTuple_GetItem(src.ptr(), i), writable);
  }
};

// The SUBMIT begin() and run() push, from their arguments (the channel fills in seq, shard and offset).
smddp::Header submit_fields(long long kind, std::uint32_t rank, long long count, long long dtype, long long op,
                            long long root) {
  constexpr long long kU32 = static_cast<long long>(UINT32_MAX);
  if (kind < 0 || kind > 255 || dtype < 0 || dtype > 255 || op < 0 || op > 255 || count < 0 || root < 0 ||
      root > kU32)
    raise_error(Err::kValue, "a fast collective's fields are out of range");
  smddp::Header h;
  h.type = smddp::Msg::kSubmit;
  h.kind = static_cast<std::uint8_t>(kind);
  h.dtype = static_cast<std::uint8_t>(dtype);
  h.op = static_cast<std::uint8_t>(op);
  h.sender = rank;
  h.aux = static_cast<std::uint32_t>(root);
  h.count = static_cast<std::uint64_t>(count);
  return h;
}

// Where a started collective's result goes: `dst` (a writable buffer, or the address of `count`
// elements of `dtype`, whose owner `owner` must then be) takes its bytes from `src_offset` of a
// result of `result_bytes`. Refused (ProtocolError) when that lies outside the result. Returns the
// delivery and what keeps the destination alive.
std::pair<smddp::Delivery, nb::object> delivery_arg(nb::handle dst, long long src_offset, long long result_bytes,
                                                    long long dtype, long long count, nb::handle owner) {
  if (src_offset < 0 || result_bytes < 0)
    raise_error(Err::kValue, "a delivery's src_offset and result_bytes are non-negative");
  smddp::Delivery out;
  if (PyLong_Check(dst.ptr())) {
    if (owner.is_none()) raise_error(Err::kValue, "a destination address needs the object that owns it");
    const auto [data, len] = address_arg(dst, dtype, count, "a destination address");
    out = smddp::Delivery{data, len, static_cast<std::uint64_t>(src_offset), static_cast<std::uint64_t>(result_bytes)};
  } else {
    Py_buffer view;
    if (PyObject_GetBuffer(dst.ptr(), &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) throw nb::python_error();
    out = smddp::Delivery{static_cast<std::uint8_t*>(view.buf), static_cast<std::uint64_t>(view.len),
                          static_cast<std::uint64_t>(src_offset), static_cast<std::uint64_t>(result_bytes)};
    PyBuffer_Release(&view);  // the object itself is kept: its memory stays where it is
  }
  if (out.src_offset > out.result_bytes || out.nbytes > out.result_bytes - out.src_offset)
    raise_error(Err::kProtocol, "a fast collective's destination lies outside its result");
  return {out, nb::borrow(owner.is_none() ? dst : owner)};
}

// ------------------------------------------------------------------------------------- Started

// A fast collective started asynchronously (begin), and the handle callers wait on: everything its
// wait (finish) and collect take is kept here, so that none of it crosses the binding again, and a
// wait that completes it returns its result without running any Python. begin() makes it as the
// class bind() named (smddp.client.session.EngineHandle subclasses it with the rest of a handle:
// callbacks, polls, and _settle for every wait that does not end in its result).
//
// Memory: a reference to each Python field. It holds its channel and arena (so they outlive it);
// `keep`, which keeps its destination in place (the destination buffer, or an address's owner; the
// channel's own `keep` holds that too once it is collected, as a taker may copy into it after this
// object is gone); `keepalive` (what else the caller keeps until it finishes), dropped then. The
// channel's `live` table holds the record until it finishes.
struct Started {
  nb::object channel_obj;  // the WorkerChannel
  Channel* channel = nullptr;
  nb::object arena_obj;
  smddp::Arena* arena = nullptr;
  nb::object keep;
  nb::object ctx;        // the channel's bind() ctx: the handle's client
  nb::object result;     // what wait() returns
  nb::object keepalive;  // dropped once finished
  smddp::Header submit;  // as pushed: seq, kind, dtype, count, sender (finish checks its DONE against it)
  smddp::Slot slot{smddp::kNoSegment, 0, 0};  // its input slot (kNoSegment: none)
  smddp::Delivery out;
  std::uint64_t batch = 0;
  std::int64_t timeout_ns = 0;  // the job's: a wait without a timeout; a collected one's RELEASE
  std::int64_t spin_ns = 0;
  bool finished = false;   // complete: its result is in place, or it failed (`failed`)
  bool failed = false;     // finished by the job's failure (_complete(True)): its wait raises (_settle)
  bool collected = false;  // collect() was asked: a wait that completes it runs _completed() (callbacks)
  // A device collective's way back (DeviceEngine.deliver_to): the channel's sink for its result, and
  // the DeviceEngine it belongs to (held, so that the engine outlives it).
  std::shared_ptr<smddp::DeviceOut> device;
  nb::object device_engine;

  // Finished: out of the channel's live table (and its `keep`, where it was collected), and what the
  // caller kept until then let go.
  void retire() {
    finished = true;
    keepalive = nb::none();
    Channel::discard(channel->live, submit.seq);
    if (collected) channel->unkeep(submit.seq);
  }
};

// Tracked by the garbage collector: `keep`, `result` and `ctx` are the caller's objects, which may
// lead back to the handle that is this record.
int started_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  Started* s = nb::inst_ptr<Started>(self);
  Py_VISIT(s->channel_obj.ptr());
  Py_VISIT(s->arena_obj.ptr());
  Py_VISIT(s->keep.ptr());
  Py_VISIT(s->ctx.ptr());
  Py_VISIT(s->result.ptr());
  Py_VISIT(s->keepalive.ptr());
  Py_VISIT(s->device_engine.ptr());
  return 0;
}

// Breaks a cycle through the caller's objects only: a record without its channel or arena cannot be
// waited for.
int started_clear(PyObject* self) {
  if (!nb::inst_ready(self)) return 0;
  Started* s = nb::inst_ptr<Started>(self);
  s->keep.reset();
  s->ctx.reset();
  s->result.reset();
  s->keepalive.reset();
  return 0;
}

// smddp's enum (smddp.proto.dtypes `name`) of a record's wire code, for its kind and dtype: the
// record keeps the codes its SUBMIT carries, and the enum is made only when asked (error messages).
nb::object spec_enum(const char* name, std::uint8_t code) {
  return nb::module_::import_("smddp.proto.dtypes").attr(name)(code);
}

PyType_Slot kStartedSlots[] = {
    {Py_tp_traverse, reinterpret_cast<void*>(started_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(started_clear)},
    {0, nullptr},
};

using StartedSelf = nb::pointer_and_handle<Started>;

// A record of `type` (Started or a subclass of it, checked by the caller), its C++ part constructed
// and nothing else set: made before anything starts, so that once something is pushed nothing fails.
std::pair<nb::object, Started*> new_record(nb::handle type) {
  nb::object obj = nb::inst_alloc(type);
  Started* s = nb::inst_ptr<Started>(obj);
  new (s) Started();
  nb::inst_mark_ready(obj);
  return {obj, s};
}

bool is_record_type(nb::handle type) {
  return PyType_Check(type.ptr()) &&
         PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type.ptr()),
                          reinterpret_cast<PyTypeObject*>(nb::type<Started>().ptr()));
}

// What a wait that did not simply end in the result says, handed to the handle's Python:
// self._settle(end, left_s, waited_s, stream) (`waited_s`: the wait's whole timeout), where `end` is
// True (finished: it failed), False (not in time, or the channel aborted), None (its DONE is another
// thread's to complete) or the exception the channel's refusal makes (not raised: _settle fails the
// client with it).
nb::object settle(nb::handle self, nb::handle end, double left_s, double waited_s, nb::handle stream) {
  return self.attr("_settle")(end, left_s, waited_s, stream);
}

// The exception a refused finish() stands for (not raised).
nb::object refusal(const Started& s, smddp::FastEnd end) {
  if (end == smddp::FastEnd::kRingFull) return nb::borrow(PyExc_TimeoutError)(kRingFull);
  return nb::borrow(error_class(Err::kProtocol))(s.channel->ch->why());
}

// A held record's DONE was taken (by its wait, or a pop): its sink was told, as deliver_to set it
// before its SUBMIT went (give, give_when refuse one without); what the sink could not do fails the
// client (its _device_failed), which finishes every record of its, this one too.
void device_arrived(const Started& s, const smddp::Located& at) {
  if (!at.why.empty() && s.ctx.is_valid())
    s.ctx.attr("_device_failed")(nb::borrow(error_class(Err::kDevice))(at.why));
}

nb::object finished_result(StartedSelf self, nb::handle stream) {
  if (self.p->failed) return settle(self.h, Py_True, 0.0, 0.0, stream);
  return self.p->result.is_valid() ? self.p->result : nb::none();
}

// Its result once in place (the DONE checked, the Delivery copied, the input slot freed, its RELEASE
// held or sent: WorkerChannel::finish, GIL released). timeout None: the job's. Anything else is the
// handle's _settle (settle above). `stream` is for device buffers' handles; a host collective has
// nothing to order on one.
nb::object started_wait(StartedSelf self, std::optional<double> timeout, nb::handle stream) {
  Started& s = *self.p;
  const std::int64_t wait_ns = timeout_ns(timeout, s.timeout_ns);
  if (s.finished) return finished_result(self, stream);
  smddp::FastEnd end;
  std::int64_t took_ns = 0;
  smddp::Located at;
  {
    nb::gil_scoped_release unlocked;
    const auto t0 = std::chrono::steady_clock::now();
    end = s.channel->ch->finish(*s.arena, s.slot, s.submit, s.out, s.batch, wait_ns, s.spin_ns, &at);
    took_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  }
  if (end == smddp::FastEnd::kDone) {
    // A device collective's result has gone on to the device (its record's DeviceOut enqueued the
    // copy back in finish(), before the record is finished, so that nobody sees it complete before
    // that copy is under way; its RELEASE follows the copy). One that could not be enqueued fails
    // the client, and this record with it.
    if (at.held) device_arrived(s, at);
    if (!s.finished) {  // (a copy back that could not go failed the job, and it with it)
      s.retire();
      if (s.collected) self.h.attr("_completed")();  // callbacks wait for it: the handle runs them
    }
    return finished_result(self, stream);
  }
  const double left_s = wait_ns > took_ns ? static_cast<double>(wait_ns - took_ns) * 1e-9 : 0.0;
  const double waited_s = static_cast<double>(wait_ns) * 1e-9;
  if (end == smddp::FastEnd::kTimeout) return settle(self.h, Py_False, left_s, waited_s, stream);
  if (end == smddp::FastEnd::kGone) return settle(self.h, Py_None, left_s, waited_s, stream);
  return settle(self.h, refusal(s, end), left_s, waited_s, stream);
}

// None when it has finished already (the caller completes the handle), else whether the channel took
// it: callbacks wait for it, maybe nobody ever waits, so the taker that meets its DONE completes it
// (WorkerChannel::collect; pop() then returns it Completed), its destination kept alive by the
// channel until then. Either way, from now on a wait that completes it runs _completed().
// `drop`: its caller was told it failed (a blocking call that timed out), so its result goes nowhere:
// its DONE is still taken and its RELEASE sent, but nothing is copied into the caller's memory, now
// or by a later wait (asked again, it replaces the destination a first collect() gave the channel).
std::optional<bool> started_collect(Started& s, bool drop) {
  if (s.finished) return std::nullopt;
  if (drop) {
    s.out.dst = nullptr;  // (a held (device) delivery copies nothing here: its DeviceOut drops it)
    s.out.nbytes = 0;
    if (s.device) s.device->drop();
    s.result = nb::none();  // what wait() returns: nobody's now
  }
  s.collected = true;  // (under the GIL, as a wait's check of it once finish() returned)
  smddp::WorkerChannel::Collected how;
  how.submit = s.submit;
  how.out = s.out;
  how.batch_bytes = s.batch;
  how.timeout_ns = s.timeout_ns;
  Channel& c = *s.channel;
  nb::object key = nb::int_(s.submit.seq);
  // Kept before the channel may copy into it (a taker may meet its DONE as soon as collect returns).
  c.keep[key] = s.keep.is_valid() ? s.keep : nb::none();
  const bool taken = c.ch->collect(s.submit.seq, how);
  if (!taken) Channel::discard(c.keep, s.submit.seq);
  return taken;
}

// A reserved record's SUBMIT goes (WorkerChannel::give: in its place on the ring, whatever order
// records are given in). TimeoutError when the daemon left the ring full; CollectiveTimeoutError when
// the collectives before it had no result in time (WorkerChannel::make_room); ProtocolError when the
// channel refused it (given twice, a broken ring).
void started_give(Started& s, std::optional<double> timeout) {
  if (s.out.hold && !s.out.sink) raise_error(Err::kRuntime, "give: the record has no way back yet (deliver_to)");
  const std::int64_t wait_ns = timeout_ns(timeout, s.timeout_ns);
  smddp::RingWait r;
  bool backlog = false;
  {
    nb::gil_scoped_release unlocked;
    r = s.channel->ch->give(s.submit, wait_ns, s.spin_ns, &backlog);
  }
  if (backlog) raise_error(Err::kCollectiveTimeout, s.channel->ch->backlog_why());
  if (r != smddp::RingWait::kReady) raise_ring(*s.channel, r);
}

// Finished other than by its own wait (the DONE thread completed it, collected; or the job failed):
// its wait returns at once, or (failed) raises through _settle.
void started_complete(Started& s, bool failed) {
  if (failed) s.failed = true;
  s.retire();
}

// ------------------------------------------------------------------------- WorkerChannel: records

// The rest of a record whose collective is under way (begin, resume, reserve_record): what its wait
// and collect take, the bound channel's settings, and its place in the live table until it finishes
// (shutdown waits for it; should that insert fail, for want of memory, the collective still runs:
// only shutdown would not know it). Nothing here can fail.
void fill_record(nb::handle channel_obj, Channel& c, nb::handle record, Started& s, const smddp::Header& h,
                 const smddp::Slot& slot, const smddp::Delivery& out, nb::handle result, nb::handle keepalive) {
  s.channel_obj = nb::borrow(channel_obj);
  s.channel = &c;
  s.arena_obj = c.arena;
  s.arena = c.arena_ptr;
  s.ctx = c.ctx;
  s.result = nb::borrow(result);
  s.keepalive = nb::borrow(keepalive);
  s.submit = h;
  s.slot = slot;
  s.out = out;
  s.batch = c.batch;
  s.timeout_ns = c.timeout_ns;
  s.spin_ns = c.spin_ns;
  nb::object key = nb::steal(PyLong_FromUnsignedLongLong(h.seq));
  if (!key.is_valid() || PyDict_SetItem(c.live.ptr(), key.ptr(), record.ptr()) != 0) PyErr_Clear();
}

using ChannelSelf = nb::pointer_and_handle<Channel>;

// What every begin() of this worker shares, given once: its arena, its rank, the RELEASE batch, the
// job's timeout and spin, the class of the records begin() makes (Started or a subclass) and the ctx
// each names as its client. A second bind() replaces the first: records already made keep what they hold.
void channel_bind(Channel& c, nb::handle arena, long long rank, long long batch_bytes, double timeout_s,
                  double spin_us, nb::handle handle_type, nb::handle ctx) {
  smddp::Arena* a = nullptr;
  if (!nb::try_cast<smddp::Arena*>(arena, a) || a == nullptr)
    raise_error(Err::kType, "bind: expected an smddp._engine.Arena");
  if (!is_record_type(handle_type))
    raise_error(Err::kType, "bind: handle_type is smddp._engine.Started or a subclass of it");
  if (rank < 0 || rank > static_cast<long long>(UINT32_MAX) || batch_bytes < 0 || !(timeout_s >= 0) ||
      !(spin_us >= 0))
    raise_error(Err::kValue, "bind: rank, batch_bytes, timeout_s and spin_us are non-negative");
  c.live = nb::dict();
  c.arena = nb::borrow(arena);
  c.arena_ptr = a;
  c.handle_type = nb::borrow(handle_type);
  c.ctx = nb::borrow(ctx);
  c.rank = static_cast<std::uint32_t>(rank);
  c.batch = static_cast<std::uint64_t>(batch_bytes);
  c.timeout_ns = static_cast<std::int64_t>(timeout_s * 1e9);
  c.spin_ns = spin_ns(spin_us);
}

// What begin() and begin_allreduce() share once their SUBMIT `h`, sources and delivery are known: a
// record of bind()'s class, made before anything is pushed (once pushed, nothing may fail), the
// collective started (WorkerChannel::start, asynchronous), and the record filled in; None when
// starts are closed.
nb::object start_record(ChannelSelf self, smddp::Header& h, const Sources& sources, const smddp::Delivery& out,
                        nb::object keep, nb::handle result, nb::handle keepalive) {
  Channel& c = *self.p;
  auto [record, s] = new_record(c.handle_type);
  s->keep = std::move(keep);
  smddp::Slot slot;
  smddp::FastEnd end;
  {
    nb::gil_scoped_release unlocked;
    end = c.ch->start(*c.arena_ptr, sources.sources.data(), sources.sources.size(), &h, &slot, c.timeout_ns,
                      c.spin_ns, true);
  }
  if (end == smddp::FastEnd::kHeld) return nb::none();
  if (end != smddp::FastEnd::kDone) raise_not_started(c, end);
  fill_record(self.h, c, record, *s, h, slot, out, result, keepalive);
  return record;
}

// A record of bind()'s class, or None (held: starts are closed, shutting down): a slot of the bound
// arena for `src` (Sources; none when it is empty), ATTACHed if new, `src` copied in and the SUBMIT
// pushed under the channel's next sequence number (WorkerChannel::start, asynchronous); its result
// goes to `dst` (delivery_arg) once something waits for it or collects it, and its wait returns
// `result`. Nothing starts when the destination lies outside the result (ProtocolError).
// TimeoutError when the ring stayed full, OSError when the arena cannot grow.
nb::object channel_begin(ChannelSelf self, long long kind, nb::handle src, long long count, long long dtype,
                         long long op, long long root, nb::handle dst, long long src_offset, long long result_bytes,
                         nb::handle owner, nb::handle result, nb::handle keepalive) {
  Channel& c = *self.p;
  c.require_bound("begin");
  smddp::Header h = submit_fields(kind, c.rank, count, dtype, op, root);
  auto [out, keep] = delivery_arg(dst, src_offset, result_bytes, dtype, count, owner);
  Sources sources;
  sources.take(src, dtype, count, false);
  return start_record(self, h, sources, out, std::move(keep), result, keepalive);
}

// begin() of the all-reduce every training step makes: `count` elements of `dtype` from `src` (a
// writable buffer, or their address, whose owner `keep` is) and its result back in place, in one
// piece. Its own call so that it is positional and never None (nanobind's simple dispatch: about 500
// instructions a call fewer than begin's twelve arguments take); `keep` keeps the memory in place
// until the engine's last copy into it, as begin()'s owner does.
nb::object channel_begin_allreduce(ChannelSelf self, nb::handle src, long long dtype, long long count, long long op,
                                   nb::handle result, nb::handle keep) {
  Channel& c = *self.p;
  c.require_bound("begin_allreduce");
  smddp::Header h = submit_fields(static_cast<long long>(smddp::Kind::kAllreduce), c.rank, count, dtype, op, 0);
  if (PyTuple_Check(src.ptr())) raise_error(Err::kType, "begin_allreduce: one buffer, its result in place");
  Sources sources;
  sources.take(src, dtype, count, true);
  const smddp::Source& in = sources.sources.front();
  if (in.nbytes != smddp::dtype_size(static_cast<std::uint8_t>(dtype)) * static_cast<std::uint64_t>(count))
    raise_error(Err::kValue, "begin_allreduce: the buffer holds " + std::to_string(in.nbytes) + " bytes, not " +
                                 std::to_string(count) + " elements of its dtype");
  const smddp::Delivery out{const_cast<std::uint8_t*>(in.data), in.nbytes, 0, in.nbytes};
  return start_record(self, h, sources, out, nb::borrow(keep), result, nb::none());
}

// The garbage collector's slots of a binding struct `T` whose one Python reference is its member
// `M`: traversed, and let go of to break a cycle.
template <typename T, nb::object T::*M>
int one_ref_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  Py_VISIT((nb::inst_ptr<T>(self)->*M).ptr());
  return 0;
}

template <typename T, nb::object T::*M>
int one_ref_clear(PyObject* self) {
  if (nb::inst_ready(self)) (nb::inst_ptr<T>(self)->*M).reset();
  return 0;
}

template <typename T, nb::object T::*M>
PyType_Slot kOneRefSlots[] = {
    {Py_tp_traverse, reinterpret_cast<void*>(one_ref_traverse<T, M>)},
    {Py_tp_clear, reinterpret_cast<void*>(one_ref_clear<T, M>)},
    {0, nullptr},
};

// ------------------------------------------------------------------------------- NativeApi

// A bound channel's C function table (native_api.h, capi.h) for native front ends: made once a
// client is bound, handed out in capsules, failed with the client. Holds the channel object, so
// that the WorkerChannel and the arena it names outlive every capsule (each capsule holds this).
struct NativeApi {
  nb::object channel_obj;
  std::shared_ptr<smddp::NativeWorks> works;
  nb::object device_obj;  // the DeviceEngine whose path start_device runs on (use_device), kept alive with the table
};

void native_api_init(NativeApi* self, ChannelSelf channel, long long world, long long piece_bytes) {
  Channel& c = *channel.p;
  c.require_bound("native_api");
  if (world < 1 || world > static_cast<long long>(UINT32_MAX) || c.rank >= static_cast<std::uint64_t>(world) ||
      piece_bytes < 0)
    raise_error(Err::kValue, "NativeApi: a world that holds the channel's rank, and a piece size >= 0");
  smddp::NativeConfig cfg;
  cfg.rank = c.rank;
  cfg.world = static_cast<std::uint32_t>(world);
  cfg.batch_bytes = c.batch;
  cfg.timeout_ns = c.timeout_ns;
  cfg.spin_ns = c.spin_ns;
  cfg.piece_bytes = static_cast<std::uint64_t>(piece_bytes);
  new (self) NativeApi{nb::borrow(channel.h), std::make_shared<smddp::NativeWorks>(c.ch.get(), c.arena_ptr, cfg), nb::object()};
}

void capsule_gone(PyObject* capsule) {
  // (the capsule's context holds the NativeApi object, which holds the table's memory)
  Py_XDECREF(static_cast<PyObject*>(PyCapsule_GetContext(capsule)));
}

// A capsule named SMDDP_CAPI_CAPSULE whose pointer is the table, holding this object while it lives.
nb::object native_api_capsule(nb::handle self) {
  NativeApi& a = nb::cast<NativeApi&>(self);
  PyObject* cap = PyCapsule_New(const_cast<smddp_capi*>(a.works->table()), SMDDP_CAPI_CAPSULE, capsule_gone);
  if (cap == nullptr) throw nb::python_error();
  Py_INCREF(self.ptr());
  if (PyCapsule_SetContext(cap, self.ptr()) != 0) {
    Py_DECREF(self.ptr());
    Py_DECREF(cap);
    throw nb::python_error();
  }
  return nb::steal(cap);
}

void native_api_fail_all(NativeApi& a, const std::string& error_class, const std::string& why) {
  nb::gil_scoped_release unlocked;  // (callbacks run here, and may want the GIL)
  a.works->fail_all(error_class, why);
}

std::optional<std::pair<std::string, std::string>> native_api_take_failure(NativeApi& a) {
  auto f = a.works->take_failure();
  if (f.second.empty()) return std::nullopt;
  return f;
}

// ------------------------------------------------------------------------------- DeviceEngine

// A client's device path in the engine (device_path.h): the CUDA driver (loaded at run time:
// libcuda.so.1, or the stand-in's), a progress thread per device that gives each held device SUBMIT
// the moment its copy-in has landed, and each device record's way back (deliver_to): its result
// copied to the device by whichever thread takes its DONE, and RELEASEd once that copy has landed.
// A copy that failed, or a ring the daemon left full, is kept as the engine's failure (failure():
// the client's DONE thread looks, and fails the job with it).
//
// Memory: owns the path; holds its channel (a reference) so that the channel outlives every watch,
// and, by token, what keeps each copy back's destination alive (`holds`, let go of under the GIL
// once the path says it landed: reap). stop() (and the end of the object) ends the watches first.
// The events are the caller's: it keeps each alive until its watch has ended (the record holds it).
struct DeviceEngine {
  nb::object channel_obj;
  Channel* channel = nullptr;
  std::unique_ptr<smddp::DevicePath> path;
  std::int64_t spin_ns = 0;  // how long a wait for a copy-in yields the core before it naps
  nb::dict holds;  // token -> what a copy back's destinations need kept alive until it lands
  std::uint64_t next_token = 1;

  ~DeviceEngine() {
    if (path) path->stop(false);
  }

  // Lets go of what the copies back that landed held (GIL held).
  void reap() {
    for (std::uint64_t t : path->take_landed()) Channel::discard(holds, t);
  }
};

int device_engine_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  DeviceEngine* e = nb::inst_ptr<DeviceEngine>(self);
  Py_VISIT(e->channel_obj.ptr());
  Py_VISIT(e->holds.ptr());
  return 0;
}

int device_engine_clear(PyObject* self) {
  if (!nb::inst_ready(self)) return 0;
  nb::inst_ptr<DeviceEngine>(self)->holds.clear();
  return 0;
}

PyType_Slot kDeviceEngineSlots[] = {
    {Py_tp_traverse, reinterpret_cast<void*>(device_engine_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(device_engine_clear)},
    {0, nullptr},
};

void require_device(long long device) {
  if (device < 0 || device > 1024) raise_error(Err::kValue, "no such device");
}

void device_engine_init(DeviceEngine* self, nb::handle channel, const std::string& library, double spin_us) {
  Channel* c = nullptr;
  if (!nb::try_cast<Channel*>(channel, c) || c == nullptr)
    raise_error(Err::kType, "DeviceEngine: expected an smddp._engine.WorkerChannel");
  c->require_bound("DeviceEngine");
  std::string why;
  std::unique_ptr<smddp::DevicePath> p;
  {
    nb::gil_scoped_release unlocked;  // (cuInit may take a while)
    p = smddp::DevicePath::load(library, c->ch.get(), c->batch, c->timeout_ns, c->spin_ns, spin_ns(spin_us), &why);
  }
  if (!p) raise_error(Err::kOS, why);
  new (self) DeviceEngine();
  self->channel_obj = nb::borrow(channel);
  self->channel = c;
  self->path = std::move(p);
  self->spin_ns = spin_ns(spin_us);
}

// The table's device route runs on `engine`'s path from now on (once: a later call with another
// engine is refused); the table holds the engine, so the path outlives every device work.
void native_api_use_device(NativeApi& a, nb::handle engine) {
  DeviceEngine* e = nullptr;
  if (!nb::try_cast<DeviceEngine*>(engine, e) || e == nullptr || !e->path)
    raise_error(Err::kType, "use_device: expected an smddp._engine.DeviceEngine");
  if (a.device_obj.is_valid()) {
    if (!a.device_obj.is(engine)) raise_error(Err::kValue, "use_device: the table runs on another DeviceEngine");
    return;
  }
  if (!a.channel_obj.is(e->channel_obj)) raise_error(Err::kValue, "use_device: a DeviceEngine of another channel");
  a.device_obj = nb::borrow(engine);
  a.works->use_device(e->path.get());
}

// A point of a caller's stream (DeviceEngine.mark): the event the engine recorded there, which a
// collective's copies wait for. Owns it through the engine's DeviceMark (which shares the driver, so
// it may end after the engine).
struct Mark {
  std::shared_ptr<smddp::DeviceMark> mark;
};

// An event recorded now on `stream` of `device` (DeviceError naming the driver's refusal).
Mark device_engine_mark(DeviceEngine& e, long long device, std::uintptr_t stream) {
  require_device(device);
  std::string why;
  std::shared_ptr<smddp::DeviceMark> m = e.path->mark(static_cast<int>(device), stream, &why);
  if (!m) raise_error(Err::kDevice, why);
  return Mark{std::move(m)};
}

// The engine's mark `before` is (None: nullptr), refused (ValueError) when it is another device's:
// `what`'s copies on `device` could not wait for it.
std::shared_ptr<smddp::DeviceMark> mark_on(const Mark* before, long long device, const char* what) {
  if (before == nullptr) return nullptr;
  if (before->mark->device() != device) raise_error(Err::kValue, std::string(what) + ": a mark of another device");
  return before->mark;
}

// Whether `stream` of `device` is capturing a CUDA graph (DeviceError naming the driver's refusal).
bool device_engine_capturing(DeviceEngine& e, long long device, std::uintptr_t stream) {
  require_device(device);
  bool yes = false;
  const smddp::cuda::Result r = e.path->capturing(static_cast<int>(device), stream, &yes);
  if (r != smddp::cuda::kSuccess)
    raise_error(Err::kDevice, "cuda:" + std::to_string(device) + ": " + e.path->driver().describe(r, "cuStreamIsCapturing"));
  return yes;
}

// A device collective's copy into its input slot (DeviceEngine.copy_in): the engine's DeviceIn, and
// the DeviceEngine it belongs to (held, so that the path outlives it). Its GC slots are
// kOneRefSlots: a DeviceIn shares the engine's driver, so it may end after the engine, and the
// collector may let go of either first.
struct CopyIn {
  std::shared_ptr<smddp::DeviceIn> in;
  nb::object engine;
};

// Enqueues the copy of `nbytes` from device address `src` into `arena`'s segment `segment` at
// `offset`, on `stream` of `device` after `before` (None: nothing); the input segment
// page-locked first, once (GIL released: registering touches every page, and a copy into memory
// that could not be page-locked blocks until the producer's work is done). DeviceError naming the
// driver's refusal; ValueError for a slot outside its segment or a segment the arena lacks.
CopyIn device_engine_copy_in(nb::handle self, DeviceEngine& e, smddp::Arena& arena, long long segment,
                             long long offset, long long nbytes, long long device, std::uint64_t src,
                             std::uintptr_t stream, const Mark* before) {
  require_device(device);
  if (offset < 0 || nbytes < 0) raise_error(Err::kValue, "copy_in: a negative offset or size");
  const std::shared_ptr<smddp::DeviceMark> mark = mark_on(before, device, "copy_in");
  SegmentPtr seg = arena_segment(arena, segment);
  if (!seg) raise_error(Err::kValue, "copy_in: the arena has no segment " + std::to_string(segment));
  if (static_cast<std::uint64_t>(offset) > seg->size() ||
      static_cast<std::uint64_t>(nbytes) > seg->size() - static_cast<std::uint64_t>(offset))
    raise_error(Err::kValue, "copy_in: the slot is outside its segment");
  std::string why;
  std::shared_ptr<smddp::DeviceIn> in;
  {
    nb::gil_scoped_release unlocked;
    in = e.path->copy_in(static_cast<int>(device), stream, mark.get(), seg,
                         static_cast<std::uint64_t>(offset), src, static_cast<std::uint64_t>(nbytes), &why);
  }
  if (!in) raise_error(Err::kDevice, why);
  return CopyIn{std::move(in), nb::borrow(self)};
}

// Whether its copy has landed; DeviceError for one that failed on the device.
bool copy_in_done(CopyIn& c) {
  const smddp::cuda::Result r = c.in->query();
  if (r == smddp::cuda::kNotReady) return false;
  if (r != smddp::cuda::kSuccess) raise_error(Err::kDevice, c.in->driver().describe(r, "cuEventQuery"));
  return true;
}

// Waits (GIL released) up to `timeout_s` for its copy to land, polled (the core yielded for the
// engine's spin, then short naps: the wait keeps its timeout); whether it landed in time.
bool copy_in_wait(CopyIn& c, double timeout_s) {
  if (!c.engine.is_valid()) raise_error(Err::kRuntime, "a copy-in whose engine was let go of");
  DeviceEngine& e = nb::cast<DeviceEngine&>(c.engine);
  smddp::cuda::Result r;
  {
    nb::gil_scoped_release unlocked;
    r = c.in->wait(seconds_ns(timeout_s), e.spin_ns);
  }
  if (r == smddp::cuda::kNotReady) return false;
  if (r != smddp::cuda::kSuccess) raise_error(Err::kDevice, c.in->driver().describe(r, "cuEventQuery"));
  return true;
}

// Gives `record`'s SUBMIT once `copy`'s copy-in has landed. False once stopped (nothing will give it).
bool device_engine_give_when(DeviceEngine& e, Started& s, CopyIn& copy) {
  if (s.channel != e.channel) raise_error(Err::kValue, "give_when: a record of another channel");
  if (!s.out.sink) raise_error(Err::kRuntime, "give_when: the record has no way back yet (deliver_to)");
  if (!copy.engine.is(nb::find(&e))) raise_error(Err::kValue, "give_when: a copy-in of another engine (or let go of)");
  return e.path->give_when(s.submit, copy.in, s.timeout_ns, s.spin_ns);
}

// `record`'s result goes back to the device: each (address, offset, bytes) of `parts` from its result
// to device memory, on `stream` of `device`, after `before` (None: nothing), by whoever takes its
// DONE, and an event of the engine's own recorded after them; `hold` (which keeps the destinations
// alive) is kept until the copies have landed. Before its SUBMIT is given.
void device_engine_deliver_to(nb::handle self, DeviceEngine& e, StartedSelf rec, long long device,
                              std::uintptr_t stream, const Mark* before,
                              const std::vector<std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>>& parts,
                              nb::handle hold, std::optional<std::pair<std::uint64_t, std::uint32_t>> then) {
  Started& s = *rec.p;
  if (s.channel != e.channel) raise_error(Err::kValue, "deliver_to: a record of another channel");
  if (!s.out.hold || s.out.sink) raise_error(Err::kValue, "deliver_to: a held record (reserve_record), once");
  require_device(device);
  std::shared_ptr<smddp::DeviceMark> mark = mark_on(before, device, "deliver_to");
  std::vector<smddp::DeviceOut::Part> ps;
  ps.reserve(parts.size());
  for (const auto& [dst, offset, nbytes] : parts) {
    if (offset > s.out.result_bytes || nbytes > s.out.result_bytes - offset)
      raise_error(Err::kValue, "deliver_to: a part outside the record's result");
    ps.push_back(smddp::DeviceOut::Part{dst, offset, nbytes});
  }
  e.reap();
  const std::uint64_t token = e.next_token++;
  e.holds[nb::int_(token)] = nb::borrow(hold);
  smddp::DeviceOut::Then after;
  if (then) after = smddp::DeviceOut::Then{then->first, then->second};
  auto out = std::make_shared<smddp::DeviceOut>(e.path.get(), static_cast<int>(device), stream,
                                                std::move(mark), std::move(ps), token, after);
  s.device = out;
  s.device_engine = nb::borrow(self);
  s.out.sink = std::move(out);
}

std::optional<std::pair<int, std::string>> device_engine_failure(DeviceEngine& e) {
  auto [kind, why] = e.path->failure();
  if (kind == 0) return std::nullopt;
  return std::make_pair(kind, why);
}

// The GPU step of one rank (smddp/engine/device_step.h), on a driver of its own (the library the
// client's DeviceEngine loaded: a process has one driver, whoever resolves its entry points). Its
// calls come from one thread at a time (the client's collective calls).
struct Step {
  std::unique_ptr<smddp::DeviceStep> step;
};

// A node collective's end on the device (DeviceStep.allreduce): owns the engine's StepWork.
struct StepDone {
  std::shared_ptr<smddp::StepWork> work;
};

void step_init(Step* self, const std::string& library, long long device, long long local_rank, long long local_size,
               long long slot_bytes) {
  require_device(device);
  if (local_rank < 0 || local_size < 1 || local_size > 1024 || slot_bytes < 0)
    raise_error(Err::kValue, "DeviceStep: a negative rank or size");
  std::string why;
  std::unique_ptr<smddp::DeviceStep> st;
  {
    nb::gil_scoped_release unlocked;
    std::shared_ptr<smddp::cuda::Driver> d = smddp::cuda::Driver::load(library, &why);
    if (d)
      st = smddp::DeviceStep::create(std::move(d), static_cast<int>(device), static_cast<std::uint32_t>(local_rank),
                                     static_cast<std::uint32_t>(local_size), static_cast<std::uint64_t>(slot_bytes),
                                     &why);
  }
  if (!st) raise_error(Err::kDevice, why);
  new (self) Step();
  self->step = std::move(st);
}

nb::bytes step_card(Step& s) {
  const std::string c = s.step->card();
  if (c.empty()) raise_error(Err::kDevice, "the GPU step's staging memory has no IPC handle (cuIpcGetMemHandle)");
  return nb::bytes(c.data(), c.size());
}

void step_join(Step& s, const std::vector<nb::bytes>& cards) {
  std::vector<std::string> cs;
  cs.reserve(cards.size());
  for (const nb::bytes& b : cards) cs.emplace_back(b.c_str(), b.size());
  std::string why;
  bool ok;
  {
    nb::gil_scoped_release unlocked;
    ok = s.step->join(cs, &why);
  }
  if (!ok) raise_error(Err::kDevice, why);
}

StepDone step_allreduce(Step& s, std::uint64_t buf, long long n, long long dtype, long long op, long long divisor,
                        std::optional<std::uintptr_t> stream) {
  if (n < 0 || dtype < 0 || dtype > 255 || op < 0 || op > 255 || divisor < 0)
    raise_error(Err::kValue, "allreduce: a negative count, or a code out of range");
  std::string why;
  std::shared_ptr<smddp::StepWork> w;
  {
    nb::gil_scoped_release unlocked;
    w = s.step->allreduce(buf, static_cast<std::uint64_t>(n), static_cast<std::uint8_t>(dtype),
                          static_cast<std::uint8_t>(op), static_cast<std::uint64_t>(divisor), stream.has_value(),
                          stream.value_or(0), &why);
  }
  if (!w) raise_error(Err::kDevice, why);
  return StepDone{std::move(w)};
}

// The node's other collectives on the step (one node): `call` enqueues, GIL released.
template <typename F>
StepDone step_call(const char* what, F&& call) {
  std::string why;
  std::shared_ptr<smddp::StepWork> w;
  {
    nb::gil_scoped_release unlocked;
    w = call(&why);
  }
  if (!w) raise_error(Err::kDevice, std::string(what) + ": " + why);
  return StepDone{std::move(w)};
}

void step_codes(const char* what, long long n, long long dtype, long long op) {
  if (n < 0 || dtype < 0 || dtype > 255 || op < 0 || op > 255)
    raise_error(Err::kValue, std::string(what) + ": a negative count, or a code out of range");
}

StepDone step_reduce_scatter(Step& s, std::uint64_t in, std::uint64_t out, long long part, long long dtype,
                             long long op, long long divisor, std::optional<std::uintptr_t> stream) {
  step_codes("reduce_scatter", part, dtype, op);
  if (divisor < 0) raise_error(Err::kValue, "reduce_scatter: a negative divisor");
  return step_call("reduce_scatter", [&](std::string* why) {
    return s.step->reduce_scatter(in, out, static_cast<std::uint64_t>(part), static_cast<std::uint8_t>(dtype),
                                  static_cast<std::uint8_t>(op), static_cast<std::uint64_t>(divisor),
                                  stream.has_value(), stream.value_or(0), why);
  });
}

StepDone step_allgather(Step& s, std::uint64_t in, std::uint64_t out, long long n, long long dtype,
                        std::optional<std::uintptr_t> stream) {
  step_codes("allgather", n, dtype, 0);
  return step_call("allgather", [&](std::string* why) {
    return s.step->allgather(in, out, static_cast<std::uint64_t>(n), static_cast<std::uint8_t>(dtype),
                             stream.has_value(), stream.value_or(0), why);
  });
}

StepDone step_broadcast(Step& s, std::uint64_t buf, long long n, long long dtype, long long root,
                        std::optional<std::uintptr_t> stream) {
  step_codes("broadcast", n, dtype, 0);
  if (root < 0 || root > 0xFFFF) raise_error(Err::kValue, "broadcast: a root out of range");
  return step_call("broadcast", [&](std::string* why) {
    return s.step->broadcast(buf, static_cast<std::uint64_t>(n), static_cast<std::uint8_t>(dtype),
                             static_cast<std::uint32_t>(root), stream.has_value(), stream.value_or(0), why);
  });
}

// Across nodes (DeviceStep::allreduce_across, allgather_across, broadcast_across): what each piece
// sends copied to the host by `engine`'s device path into `arena`'s slot (segment, offset) of that
// piece (the slice alone, from the slot's start, where a SUBMIT_NODE_SUMMED slot holds it), on the
// step's in lane; a piece that sends nothing (a broadcast's other ranks) has no slot (segment -1)
// and no copy, but a copy-in all the same: the point of the in lane its SUBMIT waits for (after the
// waits for the node's done flags, so that no piece's result comes back into a slot still read).
// Returns its end, each piece's copy-in (for give_when) and each piece's (number, count, back
// address, back offset in the piece's result, back bytes, out_ready address): where its slice of
// the result goes.
using PieceRec = std::tuple<std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t>;
using Across = std::tuple<StepDone, std::vector<CopyIn>, std::vector<PieceRec>>;
template <typename F>
Across step_across(const char* what, Step& s, nb::handle engine_obj, smddp::Arena& arena,
                   const std::vector<std::pair<long long, long long>>& slots, long long n, long long dtype,
                   long long op, std::size_t unit_items, F&& call) {
  DeviceEngine* e = nullptr;
  if (!nb::try_cast<DeviceEngine*>(engine_obj, e) || e == nullptr)
    raise_error(Err::kType, std::string(what) + ": expected an smddp._engine.DeviceEngine");
  if (n < 0 || dtype < 0 || dtype > 255 || op < 0 || op > 255)
    raise_error(Err::kValue, std::string(what) + ": a negative count, or a code out of range");
  const std::size_t isz = smddp::dtype_size(static_cast<std::uint8_t>(dtype));
  if (isz == 0) raise_error(Err::kValue, std::string(what) + ": no such dtype");
  const std::vector<std::uint64_t> counts = s.step->piece_counts(static_cast<std::uint64_t>(n), isz * unit_items);
  if (slots.size() != counts.size())
    raise_error(Err::kValue, std::string(what) + ": " + std::to_string(slots.size()) + " slots for " +
                                 std::to_string(counts.size()) + " pieces");
  std::vector<SegmentPtr> segs;
  for (std::size_t i = 0; i < slots.size(); i++) {
    if (slots[i].first < 0) {
      segs.emplace_back();  // (a piece that sends nothing: Send refuses one that would)
      continue;
    }
    SegmentPtr seg = arena_segment(arena, slots[i].first);
    if (!seg)
      raise_error(Err::kValue, std::string(what) + ": the arena has no segment " + std::to_string(slots[i].first));
    if (slots[i].second < 0) raise_error(Err::kValue, std::string(what) + ": a negative slot offset");
    segs.push_back(std::move(seg));  // (copy_in checks each copy against its segment)
  }
  std::vector<std::shared_ptr<smddp::DeviceIn>> ins;
  std::vector<smddp::DeviceStep::Piece> pieces;
  std::string why;
  std::shared_ptr<smddp::StepWork> w;
  {
    nb::gil_scoped_release unlocked;
    std::size_t i = 0;
    const int device = s.step->device();
    smddp::DevicePath* path = e->path.get();
    const smddp::DeviceStep::Send send = [&](const smddp::DeviceStep::Piece& p, smddp::cuda::Stream lane,
                                             std::string* w2) {
      const std::size_t k = i++;
      if (p.send != 0 && !segs[k]) {
        *w2 = "piece " + std::to_string(k) + " sends data but was given no slot";
        return false;
      }
      std::shared_ptr<smddp::DeviceIn> in =
          path->copy_in(device, reinterpret_cast<std::uintptr_t>(lane), nullptr, p.send == 0 ? nullptr : segs[k],
                        p.send == 0 ? 0 : static_cast<std::uint64_t>(slots[k].second), p.send, p.send_bytes, w2);
      if (!in) return false;
      ins.push_back(std::move(in));
      return true;
    };
    w = call(send, &pieces, &why);
  }
  if (!w) raise_error(Err::kDevice, why);
  std::vector<CopyIn> copies;
  for (auto& in : ins) copies.push_back(CopyIn{std::move(in), nb::borrow(engine_obj)});
  std::vector<PieceRec> recs;
  for (const auto& p : pieces) recs.emplace_back(p.number, p.count, p.back, p.back_offset, p.back_bytes, p.out_ready);
  return {StepDone{std::move(w)}, std::move(copies), std::move(recs)};
}

Across step_allreduce_across(Step& s, nb::handle engine_obj, smddp::Arena& arena,
                             const std::vector<std::pair<long long, long long>>& slots, std::uint64_t buf, long long n,
                             long long dtype, long long op, std::optional<std::uintptr_t> stream) {
  return step_across("allreduce_across", s, engine_obj, arena, slots, n, dtype, op, 1,
                     [&](const smddp::DeviceStep::Send& send, std::vector<smddp::DeviceStep::Piece>* pieces,
                         std::string* why) {
                       return s.step->allreduce_across(buf, static_cast<std::uint64_t>(n),
                                                       static_cast<std::uint8_t>(dtype), static_cast<std::uint8_t>(op),
                                                       stream.has_value(), stream.value_or(0), send, pieces, why);
                     });
}

Across step_allgather_across(Step& s, nb::handle engine_obj, smddp::Arena& arena,
                             const std::vector<std::pair<long long, long long>>& slots, std::uint64_t in,
                             std::uint64_t out, long long n, long long dtype, long long world,
                             std::optional<std::uintptr_t> stream) {
  const std::uint32_t g = s.step->local_size();
  if (world < 1 || world > 1000000 || world % g != 0)
    raise_error(Err::kValue, "allgather_across: a world that is not whole nodes of " + std::to_string(g));
  return step_across("allgather_across", s, engine_obj, arena, slots, n, dtype, 0,
                     static_cast<std::size_t>(world / g),
                     [&](const smddp::DeviceStep::Send& send, std::vector<smddp::DeviceStep::Piece>* pieces,
                         std::string* why) {
                       return s.step->allgather_across(in, out, static_cast<std::uint64_t>(n),
                                                       static_cast<std::uint8_t>(dtype),
                                                       static_cast<std::uint32_t>(world), stream.has_value(),
                                                       stream.value_or(0), send, pieces, why);
                     });
}

Across step_reduce_scatter_across(Step& s, nb::handle engine_obj, smddp::Arena& arena,
                                  const std::vector<std::pair<long long, long long>>& slots, std::uint64_t in,
                                  std::uint64_t out, long long part, long long dtype, long long op, long long world,
                                  long long rank, std::optional<std::uintptr_t> stream) {
  const std::uint32_t g = s.step->local_size();
  if (world < 1 || world > 1000000 || world % g != 0 || rank < 0 || rank >= world)
    raise_error(Err::kValue, "reduce_scatter_across: a rank or world that is not of whole nodes of " + std::to_string(g));
  return step_across("reduce_scatter_across", s, engine_obj, arena, slots, part, dtype, op,
                     static_cast<std::size_t>(world),
                     [&](const smddp::DeviceStep::Send& send, std::vector<smddp::DeviceStep::Piece>* pieces,
                         std::string* why) {
                       return s.step->reduce_scatter_across(
                           in, out, static_cast<std::uint64_t>(part), static_cast<std::uint8_t>(dtype),
                           static_cast<std::uint8_t>(op), static_cast<std::uint32_t>(world),
                           static_cast<std::uint32_t>(rank), stream.has_value(), stream.value_or(0), send, pieces, why);
                     });
}

Across step_broadcast_across(Step& s, nb::handle engine_obj, smddp::Arena& arena,
                             const std::vector<std::pair<long long, long long>>& slots, std::uint64_t buf, long long n,
                             long long dtype, bool root, std::optional<std::uintptr_t> stream) {
  return step_across("broadcast_across", s, engine_obj, arena, slots, n, dtype, 0, 1,
                     [&](const smddp::DeviceStep::Send& send, std::vector<smddp::DeviceStep::Piece>* pieces,
                         std::string* why) {
                       return s.step->broadcast_across(buf, static_cast<std::uint64_t>(n),
                                                       static_cast<std::uint8_t>(dtype), root, stream.has_value(),
                                                       stream.value_or(0), send, pieces, why);
                     });
}

bool step_done_query(StepDone& d) {
  const smddp::cuda::Result r = d.work->query();
  if (r == smddp::cuda::kNotReady) return false;
  if (r != smddp::cuda::kSuccess) raise_error(Err::kDevice, "the GPU step: " + d.work->driver().describe(r, "cuEventQuery"));
  return true;
}

// Polls (GIL released) up to `timeout_s` for the collective's end (StepWork::wait: the core yielded
// for kStepSpinUs, then short naps, so the wait keeps its timeout; an event a GPU never reaches is
// never synchronised on).
constexpr double kStepSpinUs = 50.0;
bool step_done_wait(StepDone& d, double timeout_s) {
  smddp::cuda::Result r;
  {
    nb::gil_scoped_release unlocked;
    r = d.work->wait(seconds_ns(timeout_s), spin_ns(kStepSpinUs));
  }
  if (r == smddp::cuda::kNotReady) return false;
  if (r != smddp::cuda::kSuccess) raise_error(Err::kDevice, "the GPU step: " + d.work->driver().describe(r, "cuEventQuery"));
  return true;
}

void step_done_order(StepDone& d, std::uintptr_t stream) {
  const smddp::cuda::Result r = d.work->order(stream);
  if (r != smddp::cuda::kSuccess)
    raise_error(Err::kDevice, "the GPU step: " + d.work->driver().describe(r, "cuStreamWaitEvent"));
}

// The driver's error of a device record's call, raised as smddp.errors.DeviceError.
void raise_device(DeviceEngine& e, smddp::cuda::Result r, const char* call, const Started& s) {
  raise_error(Err::kDevice, "collective #" + std::to_string(s.submit.seq) + ": " + e.path->driver().describe(r, call));
}

// The device record's copy back, from Python (DeviceHandle): `record`'s DeviceOut, refused for one without.
smddp::DeviceOut& device_out(const Started& s) {
  if (!s.device) raise_error(Err::kRuntime, "not a device record (deliver_to)");
  return *s.device;
}

DeviceEngine& engine_of(const Started& s) { return nb::cast<DeviceEngine&>(s.device_engine); }

// A finished device record's result is on its way to the device (or landed): `stream`'s later work
// waits for it (nothing to do on the stream its copies ran on). DeviceError when the driver refuses.
void started_device_order(const Started& s, std::uintptr_t stream) {
  smddp::DeviceOut& out = device_out(s);
  const smddp::cuda::Result r = out.order(stream);
  if (r != smddp::cuda::kSuccess) raise_device(engine_of(s), r, "cuStreamWaitEvent", s);
}

// Whether its copy back has landed (True too for one that copied nothing); DeviceError for one that failed.
bool started_device_done(const Started& s) {
  smddp::DeviceOut& out = device_out(s);
  const smddp::cuda::Result r = out.query();
  if (r == smddp::cuda::kNotReady) return false;
  if (r != smddp::cuda::kSuccess) raise_device(engine_of(s), r, "cuEventQuery", s);
  return true;
}

// Waits (GIL released) up to `timeout_s` for its copy back to land: polled, yielding the core at
// first and then in short sleeps, so that the wait keeps its timeout. Whether it landed in time.
bool started_device_synchronize(const Started& s, double timeout_s) {
  smddp::DeviceOut& out = device_out(s);
  smddp::cuda::Result r;
  {
    nb::gil_scoped_release unlocked;
    const auto t0 = std::chrono::steady_clock::now();
    const auto deadline = t0 + std::chrono::nanoseconds(seconds_ns(timeout_s));
    while ((r = out.query()) == smddp::cuda::kNotReady) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) break;
      smddp::stream_pause(t0, s.spin_ns);
    }
  }
  if (r == smddp::cuda::kNotReady) return false;
  if (r != smddp::cuda::kSuccess) raise_device(engine_of(s), r, "cuEventQuery", s);
  return true;
}

// The run()s that end DONE or CLOSED share one answer each (the module's RAN_DONE and RAN_CLOSED,
// which hold them): the blocking call allocates nothing.
nb::handle g_ran_done;
nb::handle g_ran_closed;

// A blocking fast collective whole: its result back in `buf` (in place: an all-reduce; a barrier's is
// empty), its slot (from the bound arena) freed and its RELEASE held (DONE); nothing done once starts
// are closed (CLOSED: shutting down); not complete in time (PARKED, with its seq and slot: resume, or
// adopt(seq)). start() and finish() on one thread, the GIL released once. The rest as bind() gave it.
nb::object channel_run(Channel& c, long long kind, nb::handle buf, long long count, long long dtype, long long op,
                       double timeout_s) {
  // (the arena, not handle_type: unbind() lets go of what leads back to the client, and a blocking
  // call needs none of that)
  if (!c.arena.is_valid()) raise_error(Err::kRuntime, "run: the channel is not bound (bind)");
  const std::int64_t wait_ns = timeout_ns(timeout_s, c.timeout_ns);
  smddp::Header h = submit_fields(kind, c.rank, count, dtype, op, 0);
  if (PyTuple_Check(buf.ptr())) raise_error(Err::kType, "run: one buffer, its result in place");
  Sources sources;
  sources.take(buf, dtype, count, true);
  smddp::Arena& a = *c.arena_ptr;
  const smddp::Source& in = sources.sources.front();
  const smddp::Delivery out{const_cast<std::uint8_t*>(in.data), in.nbytes, 0, in.nbytes};
  smddp::WorkerChannel& ch = *c.ch;
  smddp::Slot slot;
  smddp::FastEnd end;
  smddp::WorkerChannel::Streamed streamed;  // a streaming all-reduce's result copied out while it copies in
  {
    nb::gil_scoped_release unlocked;
    end = ch.start(a, &in, 1, &h, &slot, wait_ns, c.spin_ns, false, &out, &streamed);
    if (end == smddp::FastEnd::kDone)
      end = ch.finish(a, slot, h, out, c.batch, wait_ns, c.spin_ns, nullptr, &streamed);
    else
      h.seq = 0;  // not started
  }
  if (end == smddp::FastEnd::kDone) return nb::borrow(g_ran_done);
  if (h.seq == 0) {
    if (end == smddp::FastEnd::kHeld) return nb::borrow(g_ran_closed);
    raise_not_started(c, end);
  }
  if (end == smddp::FastEnd::kTimeout)
    return nb::cast(Ran{RunEnd::kParked, h.seq, SlotRec{slot.segment, slot.offset, slot.nbytes}});
  raise_fast(c, end);
}

// A blocking collective that run() parked (`seq`, in `slot`) as an asynchronous one from now on
// (WorkerChannel::unblock), its result to `dst` (in place: the buffer run() was given, or a view of
// the memory at its address; empty for a barrier), as begin()'s records are: a wait, or collect()
// and the taker of its DONE, completes it in the engine. None when it is no longer the fast path's
// (nothing then completes it here). Its phases stay the engine's (timeline).
nb::object channel_resume(ChannelSelf self, long long seq, const SlotRec& slot, long long kind_v, long long count,
                          long long dtype_v, long long op, nb::handle dst, nb::handle result) {
  Channel& c = *self.p;
  c.require_bound("resume");
  smddp::Header h = submit_fields(kind_v, c.rank, count, dtype_v, op, 0);
  h.seq = u64(seq, Err::kValue, "resume: seq is non-negative");
  h.shard = slot.segment;
  h.offset = slot.offset;
  // run()'s result goes back whole into its buffer: an all-reduce's count of its dtype, a barrier's none.
  const auto result_bytes = static_cast<long long>(smddp::dtype_size(static_cast<std::uint8_t>(dtype_v))) * count;
  auto [out, keep] = delivery_arg(dst, 0, result_bytes, dtype_v, count, nb::none());
  auto [record, s] = new_record(c.handle_type);  // made first: once unblocked, nothing may fail
  s->keep = std::move(keep);
  if (!c.ch->unblock(h.seq)) return nb::none();
  fill_record(self.h, c, record, *s, h, smddp::Slot{slot.segment, slot.offset, slot.nbytes}, out, result, nb::none());
  return record;
}

// A record of `handle_type` (Started or a subclass) for a collective whose data the caller puts in
// `slot` itself, or none (None: a broadcast's receiver, or nothing to send), under the channel's next
// sequence number (WorkerChannel::reserve_fast): the engine's from now on. Its SUBMIT goes when the
// caller gives it (give()); its DONE is checked and its result located by whoever takes it (its
// wait, or collect()'s taker), and handed to its way back (DeviceEngine.deliver_to, set before its
// SUBMIT may go: the device path's copy back and RELEASE). Its wait returns `result`.
nb::object channel_reserve_record(ChannelSelf self, long long kind_v, long long count, long long dtype_v, long long op,
                                  long long root, std::optional<SlotRec> slot, long long result_bytes,
                                  nb::handle result, nb::handle keepalive, nb::handle handle_type, bool node_summed) {
  Channel& c = *self.p;
  c.require_bound("reserve_record");
  if (result_bytes < 0) raise_error(Err::kValue, "reserve_record: result_bytes is non-negative");
  smddp::Header h = submit_fields(kind_v, c.rank, count, dtype_v, op, root);
  if (node_summed) h.flags = smddp::kSubmitNodeSummed;
  const smddp::Slot in = slot ? smddp::Slot{slot->segment, slot->offset, slot->nbytes}
                              : smddp::Slot{smddp::kNoSegment, 0, 0};
  if (!is_record_type(handle_type))
    raise_error(Err::kType, "reserve_record: handle_type is smddp._engine.Started or a subclass of it");
  auto [record, s] = new_record(handle_type);  // made first: nothing may fail after
  h.seq = c.ch->reserve_fast();
  h.shard = in.segment;
  h.offset = in.offset;
  smddp::Delivery out;
  out.result_bytes = static_cast<std::uint64_t>(result_bytes);
  out.hold = true;
  fill_record(self.h, c, record, *s, h, in, out, result, keepalive);
  return record;
}

// A slot for the general way's next SUBMIT, its segment ATTACHed first when new (WorkerChannel::alloc).
Allocated channel_alloc(Channel& c, smddp::Arena& arena, long long nbytes, long long rank, double timeout_s,
                        double spin_us) {
  if (nbytes < 0 || rank < 0 || rank > static_cast<long long>(UINT32_MAX))
    raise_error(Err::kValue, "alloc: nbytes and rank are non-negative");
  smddp::Slot slot;
  Allocated got;
  std::string arena_why;
  smddp::RingWait r = smddp::RingWait::kReady;
  {
    nb::gil_scoped_release unlocked;
    r = c.ch->alloc(arena, static_cast<std::uint64_t>(nbytes), static_cast<std::uint32_t>(rank),
                    static_cast<std::int64_t>(timeout_s * 1e9), spin_ns(spin_us), &slot, &got.fresh, &arena_why);
  }
  if (!arena_why.empty()) raise_error(Err::kOS, arena_why);
  if (r != smddp::RingWait::kReady) raise_ring(c, r);
  got.segment = slot.segment;
  got.offset = slot.offset;
  return got;
}

// The DONE that already came (56 bytes), or None: the parked collective goes the general way.
std::optional<nb::bytes> channel_adopt(Channel& c, long long seq) {
  std::uint8_t slot[smddp::kSlotBytes];
  if (!c.ch->adopt(u64(seq, Err::kValue, "adopt: seq is non-negative"), slot)) return std::nullopt;
  return nb::bytes(reinterpret_cast<const char*>(slot), smddp::kHeaderSize);
}

std::pair<std::vector<smddp::ChannelTrace>, std::uint64_t> channel_take_traces(Channel& c) {
  std::uint64_t dropped = 0;
  std::vector<smddp::ChannelTrace> traces = c.ch->take_traces(&dropped);
  return {std::move(traces), dropped};
}

void channel_attach(Channel& c, const smddp::Segment& seg, long long rank, double timeout_s, double spin_us) {
  const std::uint32_t r32 = u32(rank, Err::kProtocol, "out of range: a negative offset, length, shard or size");
  smddp::RingWait r;
  {
    nb::gil_scoped_release unlocked;
    r = c.ch->attach(seg, r32, static_cast<std::int64_t>(timeout_s * 1e9), spin_ns(spin_us));
  }
  if (r != smddp::RingWait::kReady) raise_ring(c, r);
}

// --------------------------------------------------------------------------------------- misc

std::vector<std::string> ofi_providers(const std::string& library) {
  std::vector<std::string> names;
  std::string why;
  {
    nb::gil_scoped_release unlocked;
    why = smddp::ofi_providers(library, &names);
  }
  if (!why.empty()) raise_error(Err::kOS, why);
  return names;
}

// A record's class: each field declared once, read-only, in order; its __match_args__ (what `match`
// takes by position) are those fields as declared.
template <typename T>
class Record {
 public:
  Record(nb::handle scope, const char* name, const char* doc) : cls_(scope, name, doc) {}
  template <typename M>
  Record& field(const char* name, M T::*member, const char* doc) {
    cls_.def_ro(name, member, doc);
    return named(name);
  }
  template <typename Get>
  Record& prop(const char* name, Get&& get, const char* doc) {
    cls_.def_prop_ro(name, std::forward<Get>(get), doc);
    return named(name);
  }
  nb::class_<T>& cls() { return cls_; }

 private:
  Record& named(const char* name) {
    names_.append(name);
    cls_.attr("__match_args__") = nb::steal(PySequence_Tuple(names_.ptr()));
    return *this;
  }
  nb::class_<T> cls_;
  nb::list names_;
};

}  // namespace

NB_MODULE(_engine, m) {
  m.doc() = "smddp's compiled engine: the data plane's code, called from Python for setup and checks.";
  load_errors();
  // What is alive when the interpreter ends (a client never shut down, a cycle not collected) goes
  // with the process: nanobind's report of it would be noise on every such exit.
  nb::set_leak_warnings(false);

  m.def("decode_header", &codec_decode, "data"_a,
        nb::sig("def decode_header(data: bytes | bytearray | memoryview) -> tuple[int, int, int, int, int, int, "
                "int, int, int, int, int, int]"),
        "One header's fields (type, flags, dtype, op, kind, sender, seq, shard, aux, offset, length, count), "
        "every one checked (smddp/engine/frame.cc); ProtocolError naming what is wrong.");
  m.def("encode_header", &codec_encode, "type"_a, "flags"_a, "dtype"_a, "op"_a, "kind"_a, "sender"_a, "seq"_a,
        "shard"_a, "aux"_a, "offset"_a, "length"_a, "count"_a,
        nb::sig("def encode_header(type: int, flags: int, dtype: int, op: int, kind: int, sender: int, seq: int, "
                "shard: int, aux: int, offset: int, length: int, count: int) -> bytes"),
        "The 56 bytes of a header; refuses what decode_header would refuse, naming the field.");
  m.def("has_f16c", &smddp::have_f16c, "Whether float16 can be reduced here (x86-64 with AVX2 and F16C).");
  m.attr("CHANNEL_BYTES") = smddp::channel_bytes();
  m.attr("SLOT_ALIGN") = smddp::kSlotAlign;
  // SUBMITs on a channel's ring without their DONE taken, at most (a start past it takes DONEs first).
  m.attr("MAX_IN_FLIGHT") = smddp::kMaxInFlight;

  // Records.
  Record<SlotRec> slot_rec(m, "Slot", "Where a slot lies: nbytes at offset of segment segment.");
  slot_rec.field("segment", &SlotRec::segment, "its segment's id")
      .field("offset", &SlotRec::offset, "its offset in that segment")
      .field("nbytes", &SlotRec::nbytes, "its length");
  slot_rec.cls()
      .def(
          "__init__",
          [](SlotRec* self, long long segment, long long offset, long long nbytes) {
            new (self) SlotRec{u32(segment, Err::kValue, "a slot's segment is a u32"),
                               u64(offset, Err::kValue, "a slot's offset is non-negative"),
                               u64(nbytes, Err::kValue, "a slot's nbytes is non-negative")};
          },
          "segment"_a, "offset"_a, "nbytes"_a)
      .def(
          "__eq__",
          [](const SlotRec& a, nb::handle other) {
            SlotRec* b = nullptr;
            return nb::try_cast(other, b) && b != nullptr && a.segment == b->segment && a.offset == b->offset &&
                   a.nbytes == b->nbytes;
          },
          nb::sig("def __eq__(self, other: object, /) -> bool"))
      .def("__hash__",
           [](const SlotRec& s) { return std::hash<std::uint64_t>()(s.offset * 1000003u + s.nbytes * 31u + s.segment); })
      .def("__repr__", [](const SlotRec& s) {
        return "Slot(segment=" + std::to_string(s.segment) + ", offset=" + std::to_string(s.offset) +
               ", nbytes=" + std::to_string(s.nbytes) + ")";
      });

  Record<Allocated>(m, "Allocated", "A slot an arena gave (Arena.alloc, WorkerChannel.alloc).")
      .field("segment", &Allocated::segment, "its segment's id")
      .field("offset", &Allocated::offset, "its offset in that segment")
      .field("fresh", &Allocated::fresh, "the segment made for it, or None");

  Record<PeerFrame>(m, "PeerFrame", "A control frame from a peer daemon (next_event).")
      .field("node", &PeerFrame::node, "the peer node that sent it")
      .field("type", &PeerFrame::type, "its message type (the wire code: STATUS, REPORT, ERROR or BYE)")
      .field("seq", &PeerFrame::seq, "its header's seq")
      .field("aux", &PeerFrame::aux, "its header's aux")
      .prop(
          "payload", [](const PeerFrame& f) { return nb::bytes(f.payload.data(), f.payload.size()); },
          "its payload, whole");

  Record<PlaneFailure>(m, "PlaneFailure", "The plane's own failure, with its fault (next_event).")
      .field("fault", &PlaneFailure::fault,
             "what failed: 'protocol', 'mismatch' or 'peer_lost' (the smddp.errors class to raise)")
      .field("why", &PlaneFailure::why, "the message every rank prints");

  Record<smddp::PeerCounters>(m, "PeerCounters", "One peer daemon's link as the plane counts it (peer_counters).")
      .field("node", &smddp::PeerCounters::node, "the peer node")
      .field("up", &smddp::PeerCounters::up, "its link is handed over and not down")
      .field("bytes_in", &smddp::PeerCounters::bytes_in, "data frames' bytes received from it, headers included")
      .field("bytes_out", &smddp::PeerCounters::bytes_out, "data frames' bytes sent to it, headers included")
      .field("queued", &smddp::PeerCounters::queued, "frames queued to it that have not left yet");

  using WDC = smddp::WorkerDeviceCounts;
  Record<WDC>(m, "WorkerDeviceCounts",
              "One local worker's copies between its devices and smddp's memory, as its engine counts them "
              "(device_counts): shown, never trusted.")
      .field("rank", &WDC::rank, "the worker's rank")
      .field("d2h_bytes", &WDC::d2h_bytes, "bytes copied device to host (into input slots)")
      .field("h2d_bytes", &WDC::h2d_bytes, "bytes copied host to device (results back)")
      .field("d2h_copies", &WDC::d2h_copies, "copies device to host")
      .field("h2d_copies", &WDC::h2d_copies, "copies host to device")
      .field("node_reduce", &WDC::node_reduce,
             "where its device all-reduces are summed: 0 not decided, 1 host, 2 the GPU step, 3 host (the step "
             "could not be had)");

  using Waiting = smddp::LocalPlane::Waiting;
  Record<Waiting>(m, "Waiting", "A collective in flight and not done (waiting).")
      .field("seq", &Waiting::seq, "the collective's sequence number")
      .field("age_s", &Waiting::age_s, "seconds since this daemon first saw it")
      .field("what", &Waiting::what, "its fingerprint as messages spell it")
      .field("late", &Waiting::late, "the local ranks that have not submitted it")
      .field("late_nodes", &Waiting::late_nodes, "the peer nodes whose part has not come");

  Record<smddp::Completion>(
      m, "Completion",
      "Collectives completed here, summed by kind, dtype, size class and latency bucket (take_completions).")
      .field("kind", &smddp::Completion::kind, "the collectives' kind (wire code)")
      .field("dtype", &smddp::Completion::dtype, "their dtype (wire code)")
      .field("size_class", &smddp::Completion::size_class,
             "their size class: an index into PlaneConfig.size_limits (its length: larger than all)")
      .field("bucket", &smddp::Completion::bucket,
             "their latency bucket: an index into PlaneConfig.latency_buckets (its length: slower than all)")
      .field("completed", &smddp::Completion::count, "how many completed")
      .field("seconds", &smddp::Completion::seconds, "their latencies (first sight here to DONE), summed");

  Record<smddp::Trace>(m, "Trace", "A retired collective's phases (take_traces).")
      .field("seq", &smddp::Trace::seq, "the collective's sequence number")
      .field("what", &smddp::Trace::what, "its fingerprint as messages spell it")
      .prop(
          "phases",
          [](const smddp::Trace& t) {
            std::vector<std::tuple<std::string, double, double>> out;
            out.reserve(t.phases.size());
            for (const auto& [phase, span] : t.phases) out.emplace_back(smddp::phase_name(phase), span.first, span.second);
            return out;
          },
          "[(phase name, start, end)] in wall-clock seconds");

  Record<smddp::PlaneCounters>(m, "PlaneCounters", "The plane's running totals (counters).")
      .field("collectives", &smddp::PlaneCounters::collectives, "collectives completed")
      .field("reduced_bytes", &smddp::PlaneCounters::reduced_bytes, "input bytes the reductions read")
      .field("reduce_seconds", &smddp::PlaneCounters::reduce_seconds, "seconds the reductions took");

  Record<smddp::ChannelTrace>(m, "WorkerTrace", "A fast collective's phases on its worker (WorkerChannel.take_traces).")
      .field("seq", &smddp::ChannelTrace::seq, "the collective's sequence number")
      .field("kind", &smddp::ChannelTrace::kind, "its kind (wire code)")
      .field("dtype", &smddp::ChannelTrace::dtype, "its dtype (wire code)")
      .field("elements", &smddp::ChannelTrace::count, "its SUBMIT's count")
      .field("start", &smddp::ChannelTrace::start, "when its start began (wall-clock seconds): the copy in")
      .field("submitted", &smddp::ChannelTrace::submitted, "when its SUBMIT was on the ring")
      .field("done", &smddp::ChannelTrace::done, "when its DONE was taken up")
      .field("copied", &smddp::ChannelTrace::copied, "when its result was copied out");

  Record<Completed>(m, "Completed", "A collected collective the engine completed in a pop().")
      .field("seq", &Completed::seq, "its sequence number")
      .field("error", &Completed::error, "a device one's copy back that could not be enqueued: why; else None");

  Record<Unmatched>(m, "Unmatched", "A DONE pop() had nobody for: the general way's, or the daemon's fault.")
      .prop(
          "header", [](const Unmatched& u) { return nb::bytes(u.header.data(), u.header.size()); },
          "its 56-byte header");

  nb::enum_<RunEnd>(m, "RunEnd", "How WorkerChannel.run() ended.")
      .value("DONE", RunEnd::kDone, "complete: its result is in place")
      .value("CLOSED", RunEnd::kClosed, "nothing done: starts are closed (shutting down); go the general way")
      .value("PARKED", RunEnd::kParked, "not complete in time: parked (resume, or adopt)");

  Record<Ran>(m, "Ran", "What WorkerChannel.run() did.")
      .field("end", &Ran::end, "how it ended")
      .field("seq", &Ran::seq, "PARKED: its sequence number (0 otherwise)")
      .field("slot", &Ran::slot, "PARKED: its input slot (None otherwise)");
  m.attr("RAN_DONE") = nb::cast(Ran{RunEnd::kDone, 0, std::nullopt});
  m.attr("RAN_CLOSED") = nb::cast(Ran{RunEnd::kClosed, 0, std::nullopt});
  g_ran_done = m.attr("RAN_DONE");
  g_ran_closed = m.attr("RAN_CLOSED");

  // Segments and arenas.
  nb::class_<smddp::Segment>(m, "Segment", nb::type_slots(kSegmentSlots),
                             "A sealed memfd segment, mapped (smddp/engine/arena.h); its buffer is the mapping.")
      .def_prop_ro("id", &smddp::Segment::id, "its id within its owner")
      .def_prop_ro("size", &smddp::Segment::size, "bytes")
      .def_prop_ro("fd", &smddp::Segment::fd, "its memfd (-1 once closed)")
      .def_prop_ro("writable", &smddp::Segment::writable, "mapped read-write")
      .def("check", &segment_check, "offset"_a, "nbytes"_a, "Raises ProtocolError unless the range lies inside the segment.")
      .def("close_fd", &smddp::Segment::close_fd, "The fd goes now, the mapping with its last holder.");
  m.def("segment_create", &segment_create, "id"_a, "size"_a, "name"_a, "A new sealed memfd, mapped read-write.");
  m.def("segment_attach", &segment_attach, "id"_a, "fd"_a, "size"_a, "writable"_a,
        "A segment mapped from `fd`, which it takes over (closed on a refusal too).");

  nb::class_<smddp::Arena>(m, "Arena", "First fit over growing memfd segments (smddp/engine/arena.h); thread-safe.")
      .def(
          "__init__",
          [](smddp::Arena* self, const std::string& name, long long segment_bytes) {
            if (segment_bytes < 0) raise_error(Err::kProtocol, "segment_bytes must not be negative");
            new (self) smddp::Arena(name, static_cast<std::uint64_t>(segment_bytes));
          },
          "name"_a, "segment_bytes"_a)
      .def_prop_ro("in_use", &smddp::Arena::in_use, "bytes in live slots (rounded to the slot alignment)")
      .def("alloc", &arena_alloc, "nbytes"_a, "A slot of nbytes, and the segment made for it if one was.")
      .def("free", &arena_free, "segment"_a, "offset"_a, "nbytes"_a, "ValueError unless it is exactly a live slot.")
      .def("segment", &arena_segment, "id"_a, "The arena's segment `id`, or None.")
      .def("close", &smddp::Arena::close, "Drop every segment and slot.");

  // The daemon's plane.
  nb::class_<Plane>(m, "LocalPlane", "The daemon's data plane: rings, reductions, the shard exchange (smddp/engine/local_plane.h).")
      .def(nb::init<nb::handle, nb::handle, nb::handle>(), "config"_a.none(), "results"_a.none(), "scratch"_a.none() = nb::none(),
           nb::sig("def __init__(self, config: smddp.daemon.config.PlaneConfig, results: Arena, scratch: Arena | None = None) -> None"))
      .def("__len__", [](Plane& p) { return p.plane->in_flight(); })
      .def("add_worker", &plane_add_worker, "local"_a, "rank"_a, "name"_a, "channel"_a.none(), "side"_a,
           "Its ring is polled from now on (the plane owns the fd side, closed on failure too).")
      .def(
          "remove_worker",
          [](Plane& p, long long local) {
            const std::uint32_t i = local_arg(local);
            nb::gil_scoped_release unlocked;
            return p.plane->remove_worker(i);
          },
          "local"_a, "Whether it said BYE (its ring handled first).")
      .def(
          "rank_left_early",
          [](Plane& p, long long local, bool joined, const std::string& reason) {
            const std::uint32_t i = local_arg(local);
            bool recorded = false;
            smddp::Verdict v;
            {
              nb::gil_scoped_release unlocked;
              v = p.plane->rank_left_early(i, joined, reason, &recorded);
            }
            if (!v.ok()) raise_verdict(v);
            return recorded;
          },
          "local"_a, "joined"_a, "reason"_a, "Recorded; raises when a collective waits for it.")
      .def(
          "left_early", [](Plane& p, long long local) { return p.plane->left_early(local_arg(local)); }, "local"_a,
          "Its process ended without joining.")
      .def(
          "all_ranks_gone", [](Plane& p) { return p.plane->all_ranks_gone(); },
          "Every local rank said BYE or left early.")
      .def(
          "name_rank", [](Plane& p, long long local, const std::string& name) { p.plane->name_rank(local_arg(local), name); },
          "local"_a, "name"_a)
      .def(
          "waiting", [](Plane& p) { return p.plane->waiting(); }, "The collectives in flight and not done.")
      .def(
          "abort", [](Plane& p) { p.plane->abort(); }, "The job failed: handle nothing more.")
      .def("next_event", &plane_next_event, "timeout_s"_a,
           nb::sig("def next_event(self, timeout_s: float) -> PeerFrame | PlaneFailure | None"),
           "A peer's control frame; the plane's own failure; None: nothing in time.")
      .def(
          "take_completions", [](Plane& p) { return p.plane->take_completions(); },
          "What completed since the last take, summed.")
      .def(
          "add_peer",
          [](Plane& p, long long node, int fd) {
            const std::uint32_t j = node_arg(node);
            if (fd < 0) raise_error(Err::kValue, "not a file descriptor");
            std::string why;
            {
              nb::gil_scoped_release unlocked;
              why = p.plane->add_peer(j, fd);
            }
            if (!why.empty()) raise_error(Err::kProtocol, why);
          },
          "node"_a, "fd"_a, "The plane owns the authenticated stream `fd` from now on (closed on failure too).")
      .def("send_control", &plane_send_control, "node"_a, "header"_a.none(), "payload"_a.none() = nb::none(),
           nb::sig("def send_control(self, node: int, header: bytes, payload: bytes | None = None) -> str"),
           "'' or why not: a control frame after what is queued to that peer.")
      .def(
          "flush",
          [](Plane& p, double timeout_s) {
            nb::gil_scoped_release unlocked;
            return p.plane->flush(seconds_ns(timeout_s));
          },
          "timeout_s"_a, "Every control frame left (or its link went down).")
      .def("fabric", &plane_fabric, "The fabric to the other daemons and its counters ('' and {} on one node).")
      .def(
          "peer_counters", [](Plane& p) { return p.plane->peer_counters(); }, "Each peer daemon's link.")
      .def(
          "device_counts", [](Plane& p) { return p.plane->device_counts(); },
          "Each local worker's device copies (its channel's counts), by local rank.")
      .def(
          "take_traces", [](Plane& p) { return p.plane->take_traces(); }, "The retired collectives' phases.")
      .def(
          "queued_tasks",
          [](Plane& p) {
            const auto q = p.plane->queued_tasks();
            return std::make_pair(static_cast<std::uint64_t>(q.first), static_cast<std::uint64_t>(q.second));
          },
          "(local, server): chunks waiting for a compute thread.")
      .def(
          "counters", [](Plane& p) { return p.plane->counters(); }, "The plane's running totals.")
      .def(
          "close",
          [](Plane& p) {
            nb::gil_scoped_release unlocked;
            p.plane->close();
          },
          "Stop every thread.");

  // The worker's channel, and its records.
  nb::class_<Started>(m, "Started", nb::type_slots(kStartedSlots),
                      "A fast collective started asynchronously (WorkerChannel.begin), and its handle.")
      .def("wait", &started_wait, "timeout"_a = nb::none(), "stream"_a.none() = nb::none(),
           nb::sig("def wait(self, timeout: float | None = None, stream: typing.Any = None) -> typing.Any"),
           "Its result once in place (else the handle's _settle says what).")
      // smddp's own waits (a device handle's, shutdown's, torch's host Works): positional and never
      // None, so that nanobind takes its simple dispatch (wait()'s keywords and defaults take the
      // general one, about 440 instructions a call more).
      .def(
          "_wait",
          [](StartedSelf self, double timeout_s) { return started_wait(self, timeout_s, nb::none()); },
          nb::sig("def _wait(self, timeout_s: float, /) -> typing.Any"), "wait(timeout_s), for smddp's own callers.")
      .def("collect", &started_collect, "drop"_a = false,
           "None (finished already) or whether the channel took it: whoever takes its DONE completes it; "
           "drop: its result goes nowhere.")
      .def("give", &started_give, "timeout_s"_a = nb::none(), "A reserved record's SUBMIT goes, in its place on the ring.")
      .def("_complete", &started_complete, "failed"_a, "Finished other than by its own wait.")
      .def("_device_order", &started_device_order, "stream"_a,
           "A device record's: `stream`'s later work waits for its copy back.")
      .def("_device_done", &started_device_done, "A device record's: whether its copy back has landed.")
      .def("_device_synchronize", &started_device_synchronize, "timeout_s"_a,
           "A device record's: wait for its copy back to land; whether it did in time.")
      .def_prop_ro(
          "seq", [](const Started& s) { return s.submit.seq; }, "its sequence number")
      .def_prop_ro(
          "kind", [](const Started& s) { return spec_enum("Kind", s.submit.kind); },
          nb::sig("def kind(self) -> smddp.proto.dtypes.Kind"), "its kind (smddp.proto.dtypes.Kind)")
      .def_prop_ro(
          "dtype", [](const Started& s) { return spec_enum("DType", s.submit.dtype); },
          nb::sig("def dtype(self) -> smddp.proto.dtypes.DType"), "its dtype (smddp.proto.dtypes.DType)")
      .def_prop_ro(
          "count", [](const Started& s) { return s.submit.count; }, "its SUBMIT's count")
      .def_prop_ro(
          "slot",
          [](const Started& s) -> std::optional<SlotRec> {
            if (s.slot.segment == smddp::kNoSegment) return std::nullopt;
            return SlotRec{s.slot.segment, s.slot.offset, s.slot.nbytes};
          },
          "its input slot, or None")
      .def_prop_ro(
          "finished", [](const Started& s) { return s.finished; }, "complete: its result in place, or failed")
      .def_prop_ro(
          "_client", [](const Started& s) { return s.ctx.is_valid() ? s.ctx : nb::none(); },
          nb::sig("def _client(self) -> typing.Any"), "the ctx its channel was bound with")
      .def_prop_ro(
          "_value", [](const Started& s) { return s.result.is_valid() ? s.result : nb::none(); },
          nb::sig("def _value(self) -> typing.Any"), "what its wait returns");

  m.attr("_S") = nb::type_var("_S", "bound"_a = nb::type<Started>());

  nb::class_<Channel>(m, "WorkerChannel", nb::type_slots(kChannelSlots),
                      "A worker's rings to its daemon (smddp/engine/channel.h).")
      .def(nb::init<const std::string&>(), "name"_a)
      .def_prop_ro(
          "segment", [](const Channel& c) { return c.ch->segment(); }, "the channel's segment (pass its fd to the daemon)")
      .def_prop_ro(
          "daemon_end", [](const Channel& c) { return c.ch->daemon_end(); },
          "the daemon's end of the side socket (pass it with CHANNEL)")
      .def("push", &channel_push, "header"_a, "timeout_s"_a, "spin_us"_a, "A descriptor onto the submit ring.")
      .def("pop", &channel_pop, "timeout_s"_a, "spin_us"_a,
           nb::sig("def pop(self, timeout_s: float, spin_us: float) -> Completed | Unmatched | None"),
           "What the done ring gave: a collected collective completed here, a DONE nobody had, or None "
           "(nothing in time; the fast path's waits go first).")
      .def(
          "abort", [](Channel& c) { c.ch->abort(); }, "Pops return None from now on.")
      .def("release", &channel_release, "rank"_a, "seq"_a, "nbytes"_a, "batch_bytes"_a, "timeout_s"_a, "spin_us"_a,
           "RELEASE a result slot (small ones held back to go with the next SUBMIT).")
      .def("bind", &channel_bind, "arena"_a.none(), "rank"_a, "batch_bytes"_a, "timeout_s"_a, "spin_us"_a, "handle_type"_a.none(),
           "ctx"_a.none(),
           nb::sig("def bind(self, arena: Arena, rank: int, batch_bytes: int, timeout_s: float, spin_us: float, "
                   "handle_type: type[Started], ctx: typing.Any) -> None"),
           "What every begin() shares.")
      .def("begin", &channel_begin, "kind"_a, "src"_a.none(), "count"_a, "dtype"_a, "op"_a, "root"_a, "dst"_a.none(), "src_offset"_a,
           "result_bytes"_a, "owner"_a.none(), "result"_a.none(), "keepalive"_a.none(),
           nb::sig("def begin(self, kind: int, src: typing.Any, count: int, dtype: int, op: int, root: int, "
                   "dst: typing.Any, src_offset: int, result_bytes: int, owner: typing.Any, result: typing.Any, "
                   "keepalive: typing.Any) -> typing.Any"),
           "A record of bind()'s handle_type, or None (starts are closed): an asynchronous fast collective's "
           "slot, copy-in and SUBMIT under the next seq.")
      // The all-reduce every training step starts: positional and never None, as run() is.
      .def("begin_allreduce", &channel_begin_allreduce,
           nb::sig("def begin_allreduce(self, src: typing.Any, dtype: int, count: int, op: int, result: typing.Any, "
                   "keep: typing.Any, /) -> typing.Any"),
           "begin() of an all-reduce in place, in one piece: a record of bind()'s handle_type, or None.")
      .def(
          "live",
          [](const Channel& c) -> nb::list {
            if (!c.live.is_valid()) return nb::list();
            return nb::steal<nb::list>(PyDict_Values(c.live.ptr()));
          },
          "What begin() made and nothing has finished yet.")
      .def(
          "unbind", [](Channel& c) { c.let_go(); }, "Let go of what bind() gave, and the live table.")
      // The blocking call, every training step's: positional and never None, so that nanobind takes
      // its simple dispatch (keywords and None cost a blocking all-reduce ~300 instructions more).
      .def("run", &channel_run,
           nb::sig("def run(self, kind: int, buf: typing.Any, count: int, dtype: int, op: int, "
                   "timeout_s: float, /) -> Ran"),
           "A blocking fast collective whole, its result in place.")
      .def("reserve_record", &channel_reserve_record, "kind"_a, "count"_a, "dtype"_a, "op"_a, "root"_a, "slot"_a.none(),
           "result_bytes"_a, "result"_a.none(), "keepalive"_a.none(), "handle_type"_a.none(), "node_summed"_a = false,
           nb::sig("def reserve_record(self, kind: int, count: int, dtype: int, op: int, root: int, "
                   "slot: Slot | None, result_bytes: int, result: typing.Any, keepalive: typing.Any, "
                   "handle_type: type[_S], node_summed: bool = False) -> _S"),
           "A record whose SUBMIT goes with give() and whose result its way back (DeviceEngine.deliver_to) takes on; "
           "node_summed: its SUBMIT says the node's ranks summed it on their GPUs (each slot holds its slice).")
      .def(
          "close_starts", [](Channel& c) { c.ch->close_starts(); }, "No fast collective starts from now on.")
      .def(
          "blocking", [](const Channel& c) { return c.ch->blocking(); }, "The blocking fast collectives not finished.")
      .def("alloc", &channel_alloc, "arena"_a, "nbytes"_a, "rank"_a, "timeout_s"_a, "spin_us"_a,
           "A slot, its segment ATTACHed first when new.")
      .def("adopt", &channel_adopt, "seq"_a, "A parked fast collective goes the general way: the DONE that came, or None.")
      .def("resume", &channel_resume, "seq"_a, "slot"_a, "kind"_a, "count"_a, "dtype"_a, "op"_a, "dst"_a.none(), "result"_a.none(),
           nb::sig("def resume(self, seq: int, slot: Slot, kind: int, count: int, dtype: int, op: int, "
                   "dst: typing.Any, result: typing.Any) -> typing.Any"),
           "A parked blocking collective as an asynchronous one: its record, or None.")
      .def(
          "set_trace", [](Channel& c, bool on) { c.ch->set_trace(on); }, "on"_a,
          "Keep each fast collective's phases (take_traces), or stop.")
      .def(
          "set_node_reduce",
          [](Channel& c, long long code) {
            if (code < 0 || code > 3) raise_error(Err::kValue, "set_node_reduce: 0 to 3");
            c.ch->set_node_reduce(static_cast<std::uint32_t>(code));
          },
          "code"_a,
          "Where this worker's device all-reduces are summed (0 not decided, 1 host, 2 the GPU step, 3 host after "
          "the step could not be had), for its daemon to show.")
      .def(
          "set_stream", [](Channel& c, bool on) { c.ch->set_stream(on); }, "on"_a,
          "Large all-reduces stream through the channel's stream block (a job of one node).")
      .def(
          "streamed",
          [](const Channel& c) {
            return std::make_pair(static_cast<std::uint64_t>(c.ch->streamed_in()),
                                  static_cast<std::uint64_t>(c.ch->streamed_out()));
          },
          "(copied in as it went, copied out before the DONE): bytes, since the channel began.")
      .def("take_traces", &channel_take_traces, "(the fast collectives' phases since the last take, how many were not kept).")
      .def("attach", &channel_attach, "segment"_a, "rank"_a, "timeout_s"_a, "spin_us"_a,
           "ATTACH an input segment (its fd on the side socket).")
      .def(
          "result",
          [](const Channel& c, long long id) -> SegmentPtr {
            if (id < 0 || id > static_cast<long long>(UINT32_MAX)) return nullptr;
            return c.ch->result(static_cast<std::uint32_t>(id));
          },
          "id"_a, "The result segment the daemon sent as `id`, or None.")
      .def(
          "close_daemon_end", [](Channel& c) { c.ch->close_daemon_end(); },
          "The daemon's end of the side socket is closed here (once passed).");

  nb::class_<NativeApi>(m, "NativeApi", nb::type_slots(kOneRefSlots<NativeApi, &NativeApi::channel_obj>),
                        "A bound channel's C function table for native front ends (smddp/engine/capi.h).")
      .def("__init__", &native_api_init, "channel"_a, "world"_a, "piece_bytes"_a,
           "The table over `channel` (bound: its rank, arena, RELEASE batch, timeout and spin) in a job of "
           "`world` ranks, whose all-reduces go in pieces of `piece_bytes` (0: whole).")
      .def("capsule", &native_api_capsule,
           "A capsule named smddp._engine.capi whose pointer is the table (a const smddp_capi*), valid while "
           "the capsule lives.")
      .def("fail_all", &native_api_fail_all, "error_class"_a, "why"_a,
           "Every work not complete fails with `why` (its callback called, nothing more written); starts "
           "are refused from now on.")
      .def("pending", [](NativeApi& a) { return a.works->pending(); }, "Works started and not complete.")
      .def("use_device", &native_api_use_device, "engine"_a,
           "The table's device route (start_device) runs on `engine`'s path from now on; the table holds it.")
      .def("take_failure", &native_api_take_failure,
           "The failure a start or wait met that fails the whole client, once: (error class, why), or None.");
  nb::class_<CopyIn>(m, "CopyIn", nb::type_slots(kOneRefSlots<CopyIn, &CopyIn::engine>),
                     "A device collective's copy into its input slot, enqueued by the engine (DeviceEngine.copy_in).")
      .def("done", &copy_in_done, "Whether the copy has landed; DeviceError for one that failed on the device.")
      .def("wait", &copy_in_wait, "timeout_s"_a,
           "Wait (polled, GIL released) up to `timeout_s` for the copy to land; whether it did. DeviceError "
           "for one that failed on the device.");

  nb::class_<Mark>(m, "Mark",
                   "A point of a caller's stream (DeviceEngine.mark): the event a collective's copies wait for.")
      .def_prop_ro(
          "device", [](const Mark& k) { return k.mark->device(); }, "the device whose stream it was recorded on");

  nb::class_<DeviceEngine>(m, "DeviceEngine", nb::type_slots(kDeviceEngineSlots),
                           "A client's device path in the engine: held SUBMITs given once their copy-ins land, "
                           "results copied back and RELEASEd.")
      .def("__init__", &device_engine_init, "channel"_a, "library"_a, "spin_us"_a,
           nb::sig("def __init__(self, channel: WorkerChannel, library: str, spin_us: float) -> None"),
           "The CUDA driver `library` loaded (OSError naming why not), for `channel`'s records.")
      .def("capturing", &device_engine_capturing, "device"_a, "stream"_a,
           "Whether `stream` of `device` is capturing a CUDA graph (active or invalidated); DeviceError if the "
           "driver refuses to say.")
      .def("mark", &device_engine_mark, "device"_a, "stream"_a,
           "An event recorded now on `stream` of `device` (a caller's): what a collective's copies wait for. "
           "DeviceError if refused.")
      .def(
          "copy_in",
          [](nb::handle self, smddp::Arena& arena, long long segment, long long offset, long long nbytes,
             long long device, std::uint64_t src, std::uintptr_t stream, const Mark* before) {
            return device_engine_copy_in(self, nb::cast<DeviceEngine&>(self), arena, segment, offset, nbytes, device,
                                         src, stream, before);
          },
          "arena"_a, "segment"_a, "offset"_a, "nbytes"_a, "device"_a, "src"_a, "stream"_a, "before"_a.none(),
          nb::sig("def copy_in(self, arena: Arena, segment: int, offset: int, nbytes: int, device: int, src: int, "
                  "stream: int, before: Mark | None) -> CopyIn"),
          "Enqueue the copy of `nbytes` from device address `src` into the arena's slot (segment, offset) on "
          "`stream`, after `before` (None: nothing); the segment page-locked once. DeviceError if refused.")
      .def("give_when", &device_engine_give_when, "record"_a, "copy"_a,
           "Give the record's SUBMIT once its copy-in has landed; False once stopped.")
      .def(
          "deliver_to",
          [](nb::handle self, StartedSelf rec, long long device, std::uintptr_t stream, const Mark* before,
             const std::vector<std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>>& parts, nb::handle hold,
             std::optional<std::pair<std::uint64_t, std::uint32_t>> then) {
            device_engine_deliver_to(self, nb::cast<DeviceEngine&>(self), rec, device, stream, before, parts, hold,
                                     then);
          },
          "record"_a, "device"_a, "stream"_a, "before"_a.none(), "parts"_a, "hold"_a.none(), "then"_a = nb::none(),
          nb::sig("def deliver_to(self, record: Started, device: int, stream: int, before: Mark | None, "
                  "parts: collections.abc.Sequence[tuple[int, int, int]], hold: typing.Any, "
                  "then: tuple[int, int] | None = None) -> None"),
          "The record's result goes to the device at its DONE: (address, offset, bytes) parts on `stream`, "
          "after `before` (None: nothing), then (`then`: (address, value)) a 32-bit device word written, then an "
          "event of the engine's recorded; `hold` kept until they land.")
      .def("failure", &device_engine_failure,
           "None, or (1: a device copy failed, 2: the daemon's ring; why) for the first failure.")
      .def(
          "pending",
          [](DeviceEngine& e) {
            e.reap();
            return e.path->pending();
          },
          "Watches not yet ended: copies in and back in flight.")
      .def(
          "reap",
          [](DeviceEngine& e) {
            e.reap();
            return e.path->take_notes();
          },
          "Let go of what landed copies held; what the engine would log since the last call.")
      .def(
          "settle",
          [](DeviceEngine& e, double timeout_s) {
            bool all;
            {
              nb::gil_scoped_release unlocked;
              all = e.path->settle(seconds_ns(timeout_s));
            }
            e.reap();
            return all;
          },
          "timeout_s"_a, "Wait for every copy in and back in flight to end; whether they did in time.")
      .def_prop_ro(
          "driver_version", [](DeviceEngine& e) { return e.path->driver().version(); },
          "the driver's cuDriverGetVersion (1000 * major + 10 * minor)")
      .def(
          "stop",
          [](DeviceEngine& e, bool unpin) {
            {
              nb::gil_scoped_release unlocked;
              e.path->stop(unpin);
            }
            e.reap();
          },
          "unpin"_a,
          "End every watch (nothing is given or RELEASEd from now on); unpin: and let go of the result "
          "segments' page-locking (only once nothing copies from them).");

  nb::class_<StepDone>(m, "StepDone", "A node collective's end on the device (DeviceStep.allreduce).")
      .def("done", &step_done_query, "Whether it has ended; DeviceError for one that failed on the device.")
      .def("wait", &step_done_wait, "timeout_s"_a,
           "Wait (polled, GIL released) up to `timeout_s` for its end; whether it came. DeviceError for a failure.")
      .def("order", &step_done_order, "stream"_a, "`stream`'s later work waits for its end (on the device).");

  nb::class_<Step>(m, "DeviceStep",
                   "One rank's GPU step: the node's ranks sum on their GPUs through each other's staging memory "
                   "(smddp/engine/device_step.h).")
      .def("__init__", &step_init, "library"_a, "device"_a, "local_rank"_a, "local_size"_a, "slot_bytes"_a,
           nb::sig("def __init__(self, library: str, device: int, local_rank: int, local_size: int, "
                   "slot_bytes: int) -> None"),
           "The CUDA driver `library`; staging memory of two slots of `slot_bytes` on `device`, lanes and "
           "kernels. DeviceError naming why not.")
      .def_prop_ro_static(
          "max_ranks", [](nb::handle) { return smddp::DeviceStep::kMaxRanks; }, "the most ranks of a node it takes")
      .def_prop_ro_static(
          "card_bytes", [](nb::handle) { return smddp::DeviceStep::kCardBytes; }, "the bytes of a card")
      .def("card", &step_card, "What the node's other ranks need to open this rank's staging memory.")
      .def("join", &step_join, "cards"_a,
           "Every local rank's card, in local-rank order: the others' staging memory opened; DeviceError why not.")
      .def("allreduce", &step_allreduce, "buf"_a, "n"_a, "dtype"_a, "op"_a, "divisor"_a, "stream"_a.none(),
           "Enqueue the node's all-reduce of `n` elements at device address `buf` (in place), after the work "
           "already on `stream` (None: the buffer is ready now); an average divided by `divisor`.")
      .def("reduce_scatter", &step_reduce_scatter, "input"_a, "out"_a, "part"_a, "dtype"_a, "op"_a, "divisor"_a,
           "stream"_a.none(),
           "Enqueue the node's reduce-scatter (one node: the job) of local_size blocks of `part` elements at "
           "device address `input`, this rank's block of the result to `out`; as allreduce otherwise.")
      .def("allgather", &step_allgather, "input"_a, "out"_a, "n"_a, "dtype"_a, "stream"_a.none(),
           "Enqueue the node's all-gather (one node: the job) of each rank's `n` elements at `input` into `out` "
           "(local_size x n, local rank order): copies alone.")
      .def("broadcast", &step_broadcast, "buf"_a, "n"_a, "dtype"_a, "root"_a, "stream"_a.none(),
           "Enqueue the node's broadcast (one node: the job) of local rank `root`'s `n` elements at `buf`.")
      .def(
          "close",
          [](Step& s, double timeout_s) {
            nb::gil_scoped_release unlocked;
            return s.step->close(seconds_ns(timeout_s));
          },
          "timeout_s"_a,
          "Wait up to `timeout_s` for its lanes and its peers' reads of its slots to end, then let go of its "
          "memory, lanes and kernels: whether it could (else they stay until the process ends).")
      .def("allreduce_across", &step_allreduce_across, "engine"_a, "arena"_a, "slots"_a, "buf"_a, "n"_a, "dtype"_a,
           "op"_a, "stream"_a.none(),
           "Across nodes: enqueue the node's partial of each piece, its slice copied to the host into its slot "
           "(segment, offset: the slice alone) by the engine's device path; (end, copy-ins, (number, count, back "
           "address, back offset in the piece's result, back bytes, out_ready address) per piece).")
      .def("allgather_across", &step_allgather_across, "engine"_a, "arena"_a, "slots"_a, "input"_a, "out"_a, "n"_a,
           "dtype"_a, "world"_a, "stream"_a.none(),
           "Across nodes: enqueue an all-gather of `world` ranks' `n` elements each, each piece of `input` "
           "copied to the host into its slot; the node gathers the rows each rank brings back into `out`; as "
           "allreduce_across's otherwise.")
      .def("reduce_scatter_across", &step_reduce_scatter_across, "engine"_a, "arena"_a, "slots"_a, "input"_a,
           "out"_a, "part"_a, "dtype"_a, "op"_a, "world"_a, "rank"_a, "stream"_a.none(),
           "Across nodes: enqueue a reduce-scatter of `world` ranks' blocks of `part` elements, the node's partial "
           "of each piece summed on the GPUs, this rank's slice of it copied to the host into its slot; block "
           "`rank` of each piece's result comes back into `out`; as allreduce_across's otherwise.")
      .def("broadcast_across", &step_broadcast_across, "engine"_a, "arena"_a, "slots"_a, "buf"_a, "n"_a, "dtype"_a,
           "root"_a, "stream"_a.none(),
           "Across nodes: enqueue a broadcast, each piece copied to the host into its slot where `root` (this rank "
           "is the job's root; elsewhere every slot is (-1, 0): nothing is sent); the node gathers the slices each "
           "rank brings back into `buf`; as allreduce_across's otherwise.")
      .def(
          "piece_counts",
          [](Step& s, long long n, long long itemsize) {
            if (n < 0 || itemsize <= 0) raise_error(Err::kValue, "piece_counts: a negative count or size");
            return s.step->piece_counts(static_cast<std::uint64_t>(n), static_cast<std::size_t>(itemsize));
          },
          "n"_a, "itemsize"_a, "The elements of each piece a buffer of `n` elements goes in.")
      .def_prop_ro(
          "back_lane", [](Step& s) { return reinterpret_cast<std::uintptr_t>(s.step->back_lane()); },
          "the stream its slices' results come back on (across nodes)")
      .def_prop_ro(
          "pieces", [](Step& s) { return s.step->pieces(); }, "pieces enqueued so far")
      .def_prop_ro(
          "slot_bytes", [](Step& s) { return s.step->slot_bytes(); }, "bytes of each slot");

  m.def("ofi_providers", &ofi_providers, "library"_a,
        "The providers of that libfabric with reliable-datagram tagged messages.");
}
