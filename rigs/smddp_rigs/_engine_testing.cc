// smddp_rigs._engine_testing: the engine's parts as only tests and rigs call them, never shipped.
//
// The same engine sources as smddp._engine (smddp/engine/), bound with nanobind for the tests that
// drive them without processes (the layouts, the kernels, the collective state machine, the
// daemon's table) and for a stand-in daemon's end of a worker's rings (DaemonChannel). The wheel's
// smddp._engine (module.cc) binds only what smddp runs, the frame codec included; what both share
// (the error table, the argument checks) is smddp/engine/nb_binding.h. The stubs
// (_engine_testing.pyi) are generated from these bindings (make stubs) and checked by regenerating.
//
// Memory: each bound object owns its engine object (NodeState, DaemonEnd: deleted with it) but a
// Collective, which it shares (std::shared_ptr) with the NodeState whose table holds it.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "arena.h"
#include "channel.h"
#include "collective.h"
#include "fdpass.h"
#include "frame.h"
#include "layout.h"
#include "nb_binding.h"
#include "node_state.h"
#include "reduce.h"
#include "reduce16.h"
#include "ring.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using namespace smddp::bind;

// Every argument from the wire or a layout refused if negative, as the engine's fields are unsigned.
void non_negative(std::initializer_list<long long> values) {
  for (long long v : values)
    if (v < 0) raise_error(Err::kProtocol, "out of range: a negative offset, length, shard or size");
}

// ------------------------------------------------------------------------------------- layouts

std::tuple<std::uint64_t, std::uint64_t, std::uint64_t> locate_reduce(long long count, long long itemsize,
                                                                      long long nshards, long long chunk_elems,
                                                                      long long shard, long long byte_offset,
                                                                      long long byte_length) {
  non_negative({count, itemsize, nshards, chunk_elems, shard, byte_offset, byte_length});
  if (nshards > static_cast<long long>(UINT32_MAX)) raise_error(Err::kProtocol, "too many shards");
  smddp::ChunkAt c;
  const std::string why = smddp::locate_reduce(
      static_cast<std::uint64_t>(count), static_cast<std::uint64_t>(itemsize), static_cast<std::uint32_t>(nshards),
      static_cast<std::uint64_t>(chunk_elems), static_cast<std::uint64_t>(shard),
      static_cast<std::uint64_t>(byte_offset), static_cast<std::uint64_t>(byte_length), &c);
  if (!why.empty()) raise_error(Err::kProtocol, why);
  return {c.index, c.elems.start, c.elems.end};
}

std::pair<std::uint64_t, std::uint64_t> shard_range(long long count, long long nshards, long long shard) {
  non_negative({count, nshards, shard});
  if (nshards == 0 || nshards > static_cast<long long>(UINT32_MAX) || shard >= nshards)
    raise_error(Err::kProtocol, "shard out of range");
  const smddp::Range r = smddp::shard_range(static_cast<std::uint64_t>(count), static_cast<std::uint32_t>(nshards),
                                            static_cast<std::uint32_t>(shard));
  return {r.start, r.end};
}

std::uint64_t locate_block(long long start, long long end, long long chunk_bytes, long long byte_offset,
                           long long byte_length) {
  non_negative({start, end, chunk_bytes, byte_offset, byte_length});
  std::uint64_t index = 0;
  const std::string why = smddp::locate_block(
      {static_cast<std::uint64_t>(start), static_cast<std::uint64_t>(end)}, static_cast<std::uint64_t>(chunk_bytes),
      static_cast<std::uint64_t>(byte_offset), static_cast<std::uint64_t>(byte_length), &index);
  if (!why.empty()) raise_error(Err::kProtocol, why);
  return index;
}

// ------------------------------------------------------------------------------------- kernels

constexpr std::size_t kMaxInputs = 4096;

// The buffers a kernel call reads and writes, held for the call (released with the GIL held).
struct Views {
  std::vector<Py_buffer> views;
  Views() = default;
  Views(const Views&) = delete;
  Views& operator=(const Views&) = delete;
  ~Views() {
    for (Py_buffer& v : views) PyBuffer_Release(&v);
  }
  Py_buffer& get(nb::handle obj, int flags) {
    views.emplace_back();
    if (PyObject_GetBuffer(obj.ptr(), &views.back(), flags) != 0) {
      views.pop_back();
      throw nb::python_error();
    }
    return views.back();
  }
  // `out` (writable) and then each of `inputs`, every one holding out's bytes, a multiple of `item`.
  std::vector<const void*> inputs_like_out(nb::handle inputs, nb::handle out, std::size_t item) {
    nb::list seq = nb::list(inputs);
    const std::size_t k = nb::len(seq);
    if (k < 1 || k > kMaxInputs)
      raise_error(Err::kValue, "between 1 and " + std::to_string(kMaxInputs) + " inputs, not " + std::to_string(k));
    const Py_ssize_t len = get(out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE).len;
    if (len % static_cast<Py_ssize_t>(item) != 0)
      raise_error(Err::kValue, item == 2 ? std::string("out holds an odd number of bytes")
                                         : "out holds " + std::to_string(len) + " bytes, not whole elements of " +
                                               std::to_string(item));
    std::vector<const void*> ptrs;
    for (std::size_t j = 0; j < k; j++) {
      const Py_buffer& v = get(seq[j], PyBUF_C_CONTIGUOUS);
      if (v.len != len)
        raise_error(Err::kValue, "input " + std::to_string(j) + " holds " + std::to_string(v.len) + " bytes, out " +
                                     std::to_string(len));
      ptrs.push_back(v.buf);
    }
    return ptrs;
  }
};

// The block kernel alone, for its tests (reduce() is what the daemon runs): kind 0 float16, 1
// bfloat16; op 0 sum, 1 min, 2 max; divisor 0.0 for none. Returns the block indices left unwritten
// (their result holds a NaN). portable: bfloat16 by the baseline's loops where the CPU would run the
// AVX2 ones.
std::vector<std::size_t> reduce16(int kind, int op, nb::handle inputs, nb::handle out, float divisor, bool portable) {
  if (kind != 0 && kind != 1) raise_error(Err::kValue, "unknown kind " + std::to_string(kind));
  if (op < 0 || op > 2) raise_error(Err::kValue, "unknown op " + std::to_string(op));
  if (kind == 0 && !smddp::have_f16c()) {
    PyErr_SetString(PyExc_NotImplementedError, "float16 needs a CPU with F16C");
    throw nb::python_error();
  }
  Views v;
  const std::vector<const void*> ptrs = v.inputs_like_out(inputs, out, 2);
  std::vector<const std::uint16_t*> halves;
  for (const void* p : ptrs) halves.push_back(static_cast<const std::uint16_t*>(p));
  auto* dst = static_cast<std::uint16_t*>(v.views[0].buf);
  const std::size_t n = static_cast<std::size_t>(v.views[0].len / 2);
  std::vector<std::size_t> nan_blocks;
  nb::gil_scoped_release unlocked;
  smddp::reduce16(static_cast<smddp::Half>(kind), static_cast<smddp::Fold>(op), halves.data(), halves.size(), n, dst,
                  divisor, &nan_blocks, portable);
  return nan_blocks;
}

// The daemon's kernel (reduce_wire) for any wire dtype and op. Inputs and out hold equally many
// bytes, a multiple of the itemsize; out may alias an input element-wise. divisor: 0 for none.
void reduce(int dtype, int op, nb::handle inputs, nb::handle out, unsigned long long divisor) {
  if (dtype < 0 || dtype > 255 || smddp::dtype_size(static_cast<std::uint8_t>(dtype)) == 0)
    raise_error(Err::kValue, "dtype " + std::to_string(dtype) + " is not a wire dtype");
  if (op < 1 || op > 4) raise_error(Err::kValue, "unknown op " + std::to_string(op));
  const std::size_t size = smddp::dtype_size(static_cast<std::uint8_t>(dtype));
  Views v;
  const std::vector<const void*> ptrs = v.inputs_like_out(inputs, out, size);
  void* dst = v.views[0].buf;
  const std::size_t n = static_cast<std::size_t>(v.views[0].len) / size;
  std::string why;
  {
    nb::gil_scoped_release unlocked;
    why = smddp::reduce_wire(static_cast<std::uint8_t>(dtype), static_cast<std::uint8_t>(op), ptrs.data(), ptrs.size(),
                             n, dst, divisor);
  }
  if (!why.empty()) raise_error(Err::kValue, why);
}

// ---------------------------------------------------------------------------------- Collective

using Chunk3 = std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>;                 // (index, start, end)
using Chunk4 = std::tuple<std::uint32_t, std::uint64_t, std::uint64_t, std::uint64_t>;  // (shard, index, start, end)
using CollectivePtr = std::shared_ptr<smddp::Collective>;

Chunk3 chunk3(const smddp::Chunk& c) { return {c.index, c.start, c.end}; }
Chunk4 chunk4(const smddp::Chunk& c) { return {c.shard, c.index, c.start, c.end}; }

CollectivePtr collective_new(const std::string& who, long long seq, long long kind, long long itemsize, bool widened,
                             long long count, bool has_op, long long root, long long node, long long nnodes,
                             long long local_size, long long world, long long chunk_bytes, long long replicate_bytes) {
  non_negative({seq, kind, itemsize, count, root, node, nnodes, local_size, world, chunk_bytes, replicate_bytes});
  for (long long v : {kind, itemsize, root, node, nnodes, local_size, world})
    if (v > static_cast<long long>(UINT32_MAX)) raise_error(Err::kProtocol, "out of range: a field over 32 bits");
  smddp::Spec spec;
  spec.seq = static_cast<std::uint64_t>(seq);
  spec.kind = kind > 255 ? 0 : static_cast<std::uint8_t>(kind);
  spec.itemsize = static_cast<std::uint32_t>(itemsize);
  spec.widened = widened;
  spec.count = static_cast<std::uint64_t>(count);
  spec.has_op = has_op;
  spec.root = static_cast<std::uint32_t>(root);
  smddp::Topology topo;
  topo.node = static_cast<std::uint32_t>(node);
  topo.nnodes = static_cast<std::uint32_t>(nnodes);
  topo.local_size = static_cast<std::uint32_t>(local_size);
  topo.world = static_cast<std::uint32_t>(world);
  topo.chunk_bytes = static_cast<std::uint64_t>(chunk_bytes);
  topo.replicate_bytes = static_cast<std::uint64_t>(replicate_bytes);
  const std::string why = smddp::Collective::check(spec, topo);
  if (!why.empty()) raise_error(Err::kProtocol, who + ": " + why);
  return std::make_shared<smddp::Collective>(spec, topo);
}

std::uint32_t local_of(long long local, const std::string& who) {
  if (local < 0 || local > static_cast<long long>(UINT32_MAX)) raise_error(Err::kProtocol, who + " is not a local rank");
  return static_cast<std::uint32_t>(local);
}

// The sender of a data frame: from the wire, so checked before anything else.
std::uint32_t from_node(long long from) {
  if (from < 0 || from > static_cast<long long>(UINT32_MAX))
    raise_error(Err::kProtocol, "out of range: node " + std::to_string(from));
  return static_cast<std::uint32_t>(from);
}

void check(const std::string& why) {
  if (!why.empty()) raise_error(Err::kProtocol, why);
}

// ----------------------------------------------------------------------------------- NodeState

std::uint32_t index_arg(long long v, std::size_t limit, const char* what) {
  if (v < 0 || static_cast<unsigned long long>(v) >= limit)
    raise_error(Err::kProtocol, std::string(what) + " " + std::to_string(v) + " out of range");
  return static_cast<std::uint32_t>(v);
}

std::uint32_t local_rank(const smddp::NodeState& s, long long local) {
  return index_arg(local, s.rank_count(), "local rank");
}

// The fingerprint arguments as a Spec.
smddp::Spec spec_of(long long seq, long long kind, long long dtype, long long itemsize, bool widened, long long count,
                    long long op, long long root) {
  non_negative({seq, kind, dtype, itemsize, count, op, root});
  if (kind > 255 || dtype > 255 || op > 255 || itemsize > static_cast<long long>(UINT32_MAX) ||
      root > static_cast<long long>(UINT32_MAX))
    raise_error(Err::kProtocol, "out of range: a fingerprint field");
  smddp::Spec out;
  out.seq = static_cast<std::uint64_t>(seq);
  out.kind = static_cast<std::uint8_t>(kind);
  out.dtype = static_cast<std::uint8_t>(dtype);
  out.itemsize = static_cast<std::uint32_t>(itemsize);
  out.widened = widened;
  out.count = static_cast<std::uint64_t>(count);
  out.op = static_cast<std::uint8_t>(op);
  out.has_op = op != 0;
  out.root = static_cast<std::uint32_t>(root);
  return out;
}

void verdict(const smddp::Verdict& v) {
  if (!v.ok()) raise_verdict(v);
}

void node_state_init(smddp::NodeState* self, long long node, long long nnodes, long long local_size, long long world,
                     long long chunk_bytes, long long replicate_bytes, std::vector<std::string> node_names,
                     std::vector<std::string> rank_names) {
  non_negative({node, nnodes, local_size, world, chunk_bytes, replicate_bytes});
  for (long long v : {node, nnodes, local_size, world})
    if (v > static_cast<long long>(UINT32_MAX)) raise_error(Err::kProtocol, "out of range: a field over 32 bits");
  if (nnodes == 0 || local_size == 0 || node >= nnodes || world != nnodes * local_size || chunk_bytes == 0)
    raise_error(Err::kProtocol, "an impossible job layout");
  smddp::Topology topo;
  topo.node = static_cast<std::uint32_t>(node);
  topo.nnodes = static_cast<std::uint32_t>(nnodes);
  topo.local_size = static_cast<std::uint32_t>(local_size);
  topo.world = static_cast<std::uint32_t>(world);
  topo.chunk_bytes = static_cast<std::uint64_t>(chunk_bytes);
  topo.replicate_bytes = static_cast<std::uint64_t>(replicate_bytes);
  new (self) smddp::NodeState(topo, std::move(node_names), std::move(rank_names));
}

// -------------------------------------------------------------------------------- DaemonChannel

// The daemon's end of a worker's channel (the plane holds the same two views and side socket for
// each worker): what a stand-in daemon uses to read a real client's descriptors and answer them.
struct DaemonEnd {
  DaemonEnd(std::shared_ptr<smddp::Segment> s, int sd)
      : seg(std::move(s)),
        side(sd),
        submit(seg->base(), smddp::kChannelSlots, false),
        done(seg->base() + smddp::done_ring_offset(), smddp::kChannelSlots, false) {}
  ~DaemonEnd() { ::close(side); }
  DaemonEnd(const DaemonEnd&) = delete;
  DaemonEnd& operator=(const DaemonEnd&) = delete;
  std::shared_ptr<smddp::Segment> seg;  // keeps the mapping while the views use it
  int side;                             // the side socket's daemon end (owned)
  smddp::RingView submit;               // consumer
  smddp::RingView done;                 // producer
  std::mutex pop_mu, push_mu;           // one thread at a time on each side
  std::map<std::uint32_t, std::shared_ptr<smddp::Segment>> inputs;  // ATTACHed (under pop_mu)
};

// The channel segment a worker passed with CHANNEL (its fd, attached read-write here) and the side
// socket's end that came with it: both taken over (closed on failure too).
void daemon_channel_init(DaemonEnd* self, int fd, long long size, int side) {
  if (side < 0 || fd < 0 || size < static_cast<long long>(smddp::channel_bytes())) {
    if (fd >= 0) ::close(fd);
    if (side >= 0) ::close(side);
    raise_error(Err::kValue,
                "DaemonChannel: two fds and a channel of at least " + std::to_string(smddp::channel_bytes()) + " bytes");
  }
  std::string why;
  std::shared_ptr<smddp::Segment> seg = smddp::Segment::attach(0, fd, static_cast<std::uint64_t>(size), true, &why);
  if (!seg) {
    ::close(side);
    raise_error(Err::kProtocol, "the channel: " + why);
  }
  new (self) DaemonEnd(std::move(seg), side);
}

// The next 56-byte header of the submit ring, or None; an ATTACH is taken in here (its fd off the
// side socket, the segment kept), as the plane does, and not returned.
std::optional<nb::bytes> daemon_channel_pop(DaemonEnd& end, double timeout_s) {
  std::uint8_t slot[smddp::kSlotBytes];
  smddp::RingWait r;
  std::string why;
  {
    nb::gil_scoped_release unlocked;
    std::lock_guard<std::mutex> g(end.pop_mu);
    for (;;) {
      r = end.submit.pop(slot, static_cast<std::int64_t>(timeout_s * 1e9), 0);
      if (r == smddp::RingWait::kCorrupt) why = "the worker broke its submit ring: " + end.submit.why();
      smddp::Header h;
      if (r != smddp::RingWait::kReady || !smddp::decode_header(slot, smddp::kHeaderSize, &h).empty() ||
          h.type != smddp::Msg::kAttach)
        break;
      int fd = -1;
      why = smddp::recv_fd(end.side, h.shard, h.offset, &fd);
      std::shared_ptr<smddp::Segment> seg;
      if (why.empty()) seg = smddp::Segment::attach(h.shard, fd, h.offset, false, &why);
      if (!seg) {
        why = "the worker's ATTACH of " + why;
        r = smddp::RingWait::kCorrupt;
        break;
      }
      end.inputs[h.shard] = std::move(seg);
    }
  }
  if (r == smddp::RingWait::kTimeout) return std::nullopt;
  if (r == smddp::RingWait::kCorrupt) raise_error(Err::kProtocol, why);
  return nb::bytes(reinterpret_cast<const char*>(slot), smddp::kHeaderSize);
}

// Onto the done ring; TimeoutError when it stayed full.
void daemon_channel_push(DaemonEnd& end, nb::handle header, double timeout_s) {
  std::uint8_t frame[smddp::kHeaderSize];
  {
    ReadView v(header);
    if (v.size() != smddp::kHeaderSize) raise_error(Err::kValue, "a descriptor is one 56-byte header");
    std::memcpy(frame, v.data(), smddp::kHeaderSize);
  }
  smddp::RingWait r;
  std::string why;
  {
    nb::gil_scoped_release unlocked;
    std::lock_guard<std::mutex> g(end.push_mu);
    r = end.done.push(frame, smddp::kHeaderSize, static_cast<std::int64_t>(timeout_s * 1e9), 0);
    if (r == smddp::RingWait::kCorrupt) why = end.done.why();
  }
  if (r == smddp::RingWait::kTimeout) raise_error(Err::kTimeout, "the worker left its done ring full");
  if (r == smddp::RingWait::kCorrupt) raise_error(Err::kProtocol, "the worker broke its done ring: " + why);
}

// A result segment's fd (not taken over) on the side socket, then its SEGMENT.
void daemon_channel_send_segment(DaemonEnd& end, int fd, long long id, long long size, long long node,
                                 double timeout_s) {
  non_negative({id, size, node});
  if (id > static_cast<long long>(UINT32_MAX)) raise_error(Err::kProtocol, "a segment id out of range");
  smddp::Header h;
  h.type = smddp::Msg::kSegment;
  h.sender = static_cast<std::uint32_t>(node);
  h.shard = static_cast<std::uint32_t>(id);
  h.offset = static_cast<std::uint64_t>(size);
  std::uint8_t frame[smddp::kHeaderSize];
  std::string why = smddp::encode_header(h, frame);
  smddp::RingWait r = smddp::RingWait::kCorrupt;
  {
    nb::gil_scoped_release unlocked;
    std::lock_guard<std::mutex> g(end.push_mu);
    bool gone = false;
    if (why.empty())
      why = smddp::send_fd(end.side, static_cast<std::uint32_t>(id), static_cast<std::uint64_t>(size), fd, &gone);
    if (why.empty()) {
      r = end.done.push(frame, smddp::kHeaderSize, static_cast<std::int64_t>(timeout_s * 1e9), 0);
      if (r == smddp::RingWait::kCorrupt) why = "the worker broke its done ring: " + end.done.why();
    }
  }
  if (r == smddp::RingWait::kTimeout) raise_error(Err::kTimeout, "the worker left its done ring full");
  if (r != smddp::RingWait::kReady) raise_error(Err::kProtocol, why);
}

}  // namespace

NB_MODULE(_engine_testing, m) {
  m.doc() = "The engine's parts as tests and rigs call them (never in smddp's wheel).";
  load_errors();
  nb::set_leak_warnings(false);  // (as smddp._engine: what lives at exit goes with the process)

  m.attr("HEADER_SIZE") = smddp::kHeaderSize;
  m.attr("BLOCK") = smddp::kReduceBlock;
  m.def("shard_range", &shard_range, "count"_a, "nshards"_a, "shard"_a,
        "(start, end): shard `shard` of `count` elements cut in `nshards` balanced shards.");
  m.def("locate_reduce", &locate_reduce, "count"_a, "itemsize"_a, "nshards"_a, "chunk_elems"_a, "shard"_a,
        "byte_offset"_a, "byte_length"_a, "(index, start, end) of the chunk a frame of a reduction carries.");
  m.def("locate_block", &locate_block, "start"_a, "end"_a, "chunk_bytes"_a, "byte_offset"_a, "byte_length"_a,
        "The index of the block a frame of a gather carries.");
  m.def("reduce16", &reduce16, "kind"_a, "op"_a, "inputs"_a, "out"_a, "divisor"_a, "portable"_a = false,
        nb::sig("def reduce16(kind: int, op: int, inputs: collections.abc.Sequence[typing.Any], out: typing.Any, "
                "divisor: float, portable: bool = False) -> list[int]"),
        "The 16-bit block kernel alone: the block indices (NaN) left for the caller.");
  m.def("reduce", &reduce, "dtype"_a, "op"_a, "inputs"_a, "out"_a, "divisor"_a,
        nb::sig("def reduce(dtype: int, op: int, inputs: collections.abc.Sequence[typing.Any], out: typing.Any, "
                "divisor: int) -> None"),
        "The daemon's kernel, any wire dtype.");

  nb::class_<smddp::Collective>(m, "Collective",
                                "One collective as a daemon sees it: the state machine without I/O "
                                "(smddp/engine/collective.h).")
      .def(nb::new_(&collective_new), "who"_a, "seq"_a, "kind"_a, "itemsize"_a, "widened"_a, "count"_a, "has_op"_a,
           "root"_a, "node"_a, "nnodes"_a, "local_size"_a, "world"_a, "chunk_bytes"_a, "replicate_bytes"_a)
      .def_prop_ro("replicated", &smddp::Collective::replicated, "every node serves the whole buffer (one network step)")
      .def_prop_ro("own_in_input", &smddp::Collective::own_in_input, "the one local input is the node partial as it is")
      .def_prop_ro("is_gather", &smddp::Collective::is_gather, "a broadcast or all-gather")
      .def_prop_ro("done", &smddp::Collective::done, "every chunk is complete")
      .def_prop_ro("may_retire", &smddp::Collective::may_retire, "done, released by every local rank, every send left")
      .def_prop_ro("server_live", &smddp::Collective::server_live, "its server rows are still in use")
      .def_prop_ro("submitted", &smddp::Collective::submitted, "how many local ranks submitted")
      .def_prop_ro("server_rows", &smddp::Collective::server_rows,
                   "rows of own_range() held for every node's partial (0: none)")
      .def_prop_ro("result_bytes", &smddp::Collective::result_bytes, "bytes of the result every local rank reads")
      .def_prop_ro(
          "own_range",
          [](const smddp::Collective& c) {
            const smddp::Range r = c.own_range();
            return std::make_pair(r.start, r.end);
          },
          "(start, end): the elements (or block bytes) this node serves")
      .def(
          "submit",
          [](smddp::Collective& c, long long local_rank, const std::string& who) {
            bool all_in = false;
            check(c.submit(local_of(local_rank, who), who, &all_in));
            return all_in;
          },
          "local_rank"_a, "who"_a, "Whether every local rank is in now.")
      .def(
          "local_tasks",
          [](const smddp::Collective& c) {
            std::vector<Chunk4> out;
            for (const smddp::Chunk& t : c.local_tasks()) out.push_back(chunk4(t));
            return out;
          },
          "[(shard, index, start, end)]: the chunks the local ranks' inputs reduce to.")
      .def(
          "own_chunk",
          [](const smddp::Collective& c, long long index) {
            if (index < 0 || static_cast<unsigned long long>(index) >= c.own_chunks())
              raise_error(Err::kProtocol, "chunk " + std::to_string(index) + " is not one this node serves");
            return chunk4(c.own_chunk(static_cast<std::uint64_t>(index)));
          },
          "index"_a, "(shard, index, start, end) of a chunk this node serves.")
      .def(
          "locate_partial",
          [](const smddp::Collective& c, long long node, long long shard, long long offset, long long length,
             const std::string& who, const std::string& me) {
            const std::uint32_t from = from_node(node);
            non_negative({shard, offset, length});
            smddp::Chunk out;
            check(c.locate_partial(from, static_cast<std::uint64_t>(shard), static_cast<std::uint64_t>(offset),
                                   static_cast<std::uint64_t>(length), who, me, &out));
            return chunk3(out);
          },
          "node"_a, "shard"_a, "offset"_a, "length"_a, "who"_a, "me"_a,
          "(index, start, end) of the chunk a PARTIAL from `node` carries.")
      .def(
          "partial_arrived",
          [](smddp::Collective& c, long long index, long long node, const std::string& who) {
            const std::uint32_t from = from_node(node);
            non_negative({index});
            bool ready = false;
            check(c.partial_arrived(static_cast<std::uint64_t>(index), from, who, &ready));
            return ready;
          },
          "index"_a, "node"_a, "who"_a, "Whether every node's partial of the chunk is in.")
      .def(
          "locate_result",
          [](smddp::Collective& c, long long node, long long shard, long long offset, long long length,
             const std::string& who) {
            const std::uint32_t from = from_node(node);
            non_negative({shard, offset, length});
            smddp::Chunk out;
            check(c.locate_result(from, static_cast<std::uint64_t>(shard), static_cast<std::uint64_t>(offset),
                                  static_cast<std::uint64_t>(length), who, &out));
            return chunk3(out);
          },
          "node"_a, "shard"_a, "offset"_a, "length"_a, "who"_a, "(index, start, end), marked as arriving.")
      .def(
          "locate_block",
          [](smddp::Collective& c, long long node, long long offset, long long length, const std::string& who) {
            const std::uint32_t from = from_node(node);
            non_negative({offset, length});
            smddp::Chunk out;
            check(c.locate_block(from, static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(length), who,
                                 &out));
            return chunk3(out);
          },
          "node"_a, "offset"_a, "length"_a, "who"_a, "(index, start, end) in bytes, marked as arriving.")
      .def("chunk_completed", &smddp::Collective::chunk_completed, "Whether it just became done.")
      .def("send_started", &smddp::Collective::send_started)
      .def("send_finished", &smddp::Collective::send_finished, "Whether it may now retire.")
      .def(
          "release",
          [](smddp::Collective& c, long long local_rank, const std::string& who) {
            bool retire = false;
            check(c.release(local_of(local_rank, who), who, &retire));
            return retire;
          },
          "local_rank"_a, "who"_a, "Whether it may now retire.")
      .def(
          "lacks_from",
          [](const smddp::Collective& c, long long node) {
            return node >= 0 && node <= static_cast<long long>(UINT32_MAX) &&
                   c.lacks_from(static_cast<std::uint32_t>(node));
          },
          "node"_a, "Whether a frame from that node is still due.")
      .def(
          "submitted_by",
          [](const smddp::Collective& c, long long local_rank) {
            return local_rank >= 0 && local_rank <= static_cast<long long>(UINT32_MAX) &&
                   c.submitted_by(static_cast<std::uint32_t>(local_rank));
          },
          "local_rank"_a, "Whether that rank submitted.")
      .def("late_nodes", &smddp::Collective::late_nodes, "The nodes whose part is missing.");

  nb::class_<smddp::NodeState>(m, "NodeState",
                               "The daemon's collectives in flight and the job-wide rules around them "
                               "(smddp/engine/node_state.h). Verdicts raise smddp.errors: ProtocolError, "
                               "CollectiveMismatchError or PeerLostError.")
      .def("__init__", &node_state_init, "node"_a, "nnodes"_a, "local_size"_a, "world"_a, "chunk_bytes"_a,
           "replicate_bytes"_a, "node_names"_a, "rank_names"_a)
      .def("__len__", &smddp::NodeState::size)
      .def(
          "name_rank",
          [](smddp::NodeState& s, long long local, const std::string& name) { s.name_rank(local_rank(s, local), name); },
          "local"_a, "name"_a, "How the rank is named from now on.")
      .def(
          "op_for",
          [](smddp::NodeState& s, long long seq, long long kind, long long dtype, long long itemsize, bool widened,
             long long count, long long op, long long root, const std::string& who) -> CollectivePtr {
            const smddp::Spec spec = spec_of(seq, kind, dtype, itemsize, widened, count, op, root);
            CollectivePtr c;
            bool created = false;
            verdict(s.op_for(spec, who, &c, &created));
            return created ? c : nullptr;
          },
          "seq"_a, "kind"_a, "dtype"_a, "itemsize"_a, "widened"_a, "count"_a, "op"_a, "root"_a, "who"_a,
          "The new Collective, or None when it existed (with the same fingerprint).")
      .def(
          "submit",
          [](smddp::NodeState& s, long long local, long long seq, long long kind, long long dtype, long long itemsize,
             bool widened, long long count, long long op, long long root, bool node_summed) {
            const std::uint32_t i = local_rank(s, local);
            smddp::Spec spec = spec_of(seq, kind, dtype, itemsize, widened, count, op, root);
            spec.node_summed = node_summed;
            CollectivePtr c;
            bool created = false, all_in = false;
            verdict(s.submit(i, spec, &c, &created, &all_in));
            return std::make_pair(created ? c : nullptr, all_in);
          },
          "local"_a, "seq"_a, "kind"_a, "dtype"_a, "itemsize"_a, "widened"_a, "count"_a, "op"_a, "root"_a,
          "node_summed"_a = false,
          "(the new Collective or None, whether every local rank is in); node_summed: the SUBMIT's "
          "kSubmitNodeSummed.")
      .def(
          "release",
          [](smddp::NodeState& s, long long local, long long seq) {
            const std::uint32_t i = local_rank(s, local);
            non_negative({seq});
            bool retire = false;
            verdict(s.release(i, static_cast<std::uint64_t>(seq), &retire));
            return retire;
          },
          "local"_a, "seq"_a, "Whether it left the table.")
      .def(
          "send_finished",
          [](smddp::NodeState& s, long long seq) { return seq >= 0 && s.send_finished(static_cast<std::uint64_t>(seq)); },
          "seq"_a, "Whether it left the table.")
      .def(
          "rank_said_bye", [](smddp::NodeState& s, long long local) { verdict(s.rank_said_bye(local_rank(s, local))); },
          "local"_a, "Raises when a collective still needed it.")
      .def(
          "peer_said_bye",
          [](smddp::NodeState& s, long long node) {
            non_negative({node});
            if (node > static_cast<long long>(UINT32_MAX)) raise_error(Err::kProtocol, "node out of range");
            verdict(s.peer_said_bye(static_cast<std::uint32_t>(node)));
          },
          "node"_a, "Raises when a collective still waited for it.")
      .def(
          "rank_left_early",
          [](smddp::NodeState& s, long long local, bool joined, const std::string& reason) {
            bool recorded = false;
            verdict(s.rank_left_early(local_rank(s, local), joined, reason, &recorded));
            return recorded;
          },
          "local"_a, "joined"_a, "reason"_a, "Whether it was recorded; raises when a collective waits for it.")
      .def("all_ranks_gone", &smddp::NodeState::all_ranks_gone, "Every local rank said BYE or left early.")
      .def(
          "left_early", [](smddp::NodeState& s, long long local) { return s.left_early(local_rank(s, local)); },
          "local"_a, "Whether its process ended without joining.");

  nb::class_<DaemonEnd>(m, "DaemonChannel",
                        "The daemon's end of a worker's rings, for a stand-in daemon (smddp/engine/ring.h).")
      .def("__init__", &daemon_channel_init, "fd"_a, "size"_a, "side"_a)
      .def("pop", &daemon_channel_pop, "timeout_s"_a,
           "The next header of the submit ring (ATTACHes taken in on the way), or None.")
      .def("push", &daemon_channel_push, "header"_a, "timeout_s"_a, nb::sig("def push(self, header: bytes, timeout_s: float) -> None"),
           "Onto the done ring.")
      .def("send_segment", &daemon_channel_send_segment, "fd"_a, "id"_a, "size"_a, "node"_a, "timeout_s"_a,
           "The fd on the side socket, then SEGMENT on the done ring.");
}
