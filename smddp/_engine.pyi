from collections.abc import Sequence
import enum
from typing import Any, TypeVar

import smddp.daemon.config
import smddp.proto.dtypes


def decode_header(data: bytes | bytearray | memoryview) -> tuple[int, int, int, int, int, int, int, int, int, int, int, int]:
    """
    One header's fields (type, flags, dtype, op, kind, sender, seq, shard, aux, offset, length, count), every one checked (smddp/engine/frame.cc); ProtocolError naming what is wrong.
    """

def encode_header(type: int, flags: int, dtype: int, op: int, kind: int, sender: int, seq: int, shard: int, aux: int, offset: int, length: int, count: int) -> bytes:
    """
    The 56 bytes of a header; refuses what decode_header would refuse, naming the field.
    """

def has_f16c() -> bool:
    """Whether float16 can be reduced here (x86-64 with AVX2 and F16C)."""

CHANNEL_BYTES: int = 33536

SLOT_ALIGN: int = 64

MAX_IN_FLIGHT: int = 112

class Slot:
    """Where a slot lies: nbytes at offset of segment segment."""

    def __init__(self, segment: int, offset: int, nbytes: int) -> None: ...

    @property
    def segment(self) -> int:
        """its segment's id"""

    __match_args__: tuple = ('segment', 'offset', 'nbytes')

    @property
    def offset(self) -> int:
        """its offset in that segment"""

    @property
    def nbytes(self) -> int:
        """its length"""

    def __eq__(self, other: object, /) -> bool: ...

    def __hash__(self) -> int: ...

    def __repr__(self) -> str: ...

class Allocated:
    """A slot an arena gave (Arena.alloc, WorkerChannel.alloc)."""

    @property
    def segment(self) -> int:
        """its segment's id"""

    __match_args__: tuple = ('segment', 'offset', 'fresh')

    @property
    def offset(self) -> int:
        """its offset in that segment"""

    @property
    def fresh(self) -> Segment:
        """the segment made for it, or None"""

class PeerFrame:
    """A control frame from a peer daemon (next_event)."""

    @property
    def node(self) -> int:
        """the peer node that sent it"""

    __match_args__: tuple = ('node', 'type', 'seq', 'aux', 'payload')

    @property
    def type(self) -> int:
        """its message type (the wire code: STATUS, REPORT, ERROR or BYE)"""

    @property
    def seq(self) -> int:
        """its header's seq"""

    @property
    def aux(self) -> int:
        """its header's aux"""

    @property
    def payload(self) -> bytes:
        """its payload, whole"""

class PlaneFailure:
    """The plane's own failure, with its fault (next_event)."""

    @property
    def fault(self) -> str:
        """
        what failed: 'protocol', 'mismatch' or 'peer_lost' (the smddp.errors class to raise)
        """

    __match_args__: tuple = ('fault', 'why')

    @property
    def why(self) -> str:
        """the message every rank prints"""

class PeerCounters:
    """One peer daemon's link as the plane counts it (peer_counters)."""

    @property
    def node(self) -> int:
        """the peer node"""

    __match_args__: tuple = ('node', 'up', 'bytes_in', 'bytes_out', 'queued')

    @property
    def up(self) -> bool:
        """its link is handed over and not down"""

    @property
    def bytes_in(self) -> int:
        """data frames' bytes received from it, headers included"""

    @property
    def bytes_out(self) -> int:
        """data frames' bytes sent to it, headers included"""

    @property
    def queued(self) -> int:
        """frames queued to it that have not left yet"""

class WorkerDeviceCounts:
    """
    One local worker's copies between its devices and smddp's memory, as its engine counts them (device_counts): shown, never trusted.
    """

    @property
    def rank(self) -> int:
        """the worker's rank"""

    __match_args__: tuple = ...

    @property
    def d2h_bytes(self) -> int:
        """bytes copied device to host (into input slots)"""

    @property
    def h2d_bytes(self) -> int:
        """bytes copied host to device (results back)"""

    @property
    def d2h_copies(self) -> int:
        """copies device to host"""

    @property
    def h2d_copies(self) -> int:
        """copies host to device"""

    @property
    def node_reduce(self) -> int:
        """
        where its device all-reduces are summed: 0 not decided, 1 host, 2 the GPU step, 3 host (the step could not be had)
        """

class Waiting:
    """A collective in flight and not done (waiting)."""

    @property
    def seq(self) -> int:
        """the collective's sequence number"""

    __match_args__: tuple = ('seq', 'age_s', 'what', 'late', 'late_nodes')

    @property
    def age_s(self) -> float:
        """seconds since this daemon first saw it"""

    @property
    def what(self) -> str:
        """its fingerprint as messages spell it"""

    @property
    def late(self) -> list[int]:
        """the local ranks that have not submitted it"""

    @property
    def late_nodes(self) -> list[int]:
        """the peer nodes whose part has not come"""

class Completion:
    """
    Collectives completed here, summed by kind, dtype, size class and latency bucket (take_completions).
    """

    @property
    def kind(self) -> int:
        """the collectives' kind (wire code)"""

    __match_args__: tuple = ...

    @property
    def dtype(self) -> int:
        """their dtype (wire code)"""

    @property
    def size_class(self) -> int:
        """
        their size class: an index into PlaneConfig.size_limits (its length: larger than all)
        """

    @property
    def bucket(self) -> int:
        """
        their latency bucket: an index into PlaneConfig.latency_buckets (its length: slower than all)
        """

    @property
    def completed(self) -> int:
        """how many completed"""

    @property
    def seconds(self) -> float:
        """their latencies (first sight here to DONE), summed"""

class Trace:
    """A retired collective's phases (take_traces)."""

    @property
    def seq(self) -> int:
        """the collective's sequence number"""

    __match_args__: tuple = ('seq', 'what', 'phases')

    @property
    def what(self) -> str:
        """its fingerprint as messages spell it"""

    @property
    def phases(self) -> list[tuple[str, float, float]]:
        """[(phase name, start, end)] in wall-clock seconds"""

class PlaneCounters:
    """The plane's running totals (counters)."""

    @property
    def collectives(self) -> int:
        """collectives completed"""

    __match_args__: tuple = ...

    @property
    def reduced_bytes(self) -> int:
        """input bytes the reductions read"""

    @property
    def reduce_seconds(self) -> float:
        """seconds the reductions took"""

class WorkerTrace:
    """A fast collective's phases on its worker (WorkerChannel.take_traces)."""

    @property
    def seq(self) -> int:
        """the collective's sequence number"""

    __match_args__: tuple = ...

    @property
    def kind(self) -> int:
        """its kind (wire code)"""

    @property
    def dtype(self) -> int:
        """its dtype (wire code)"""

    @property
    def elements(self) -> int:
        """its SUBMIT's count"""

    @property
    def start(self) -> float:
        """when its start began (wall-clock seconds): the copy in"""

    @property
    def submitted(self) -> float:
        """when its SUBMIT was on the ring"""

    @property
    def done(self) -> float:
        """when its DONE was taken up"""

    @property
    def copied(self) -> float:
        """when its result was copied out"""

class Completed:
    """A collected collective the engine completed in a pop()."""

    @property
    def seq(self) -> int:
        """its sequence number"""

    __match_args__: tuple = ('seq', 'error')

    @property
    def error(self) -> str | None:
        """a device one's copy back that could not be enqueued: why; else None"""

class Unmatched:
    """A DONE pop() had nobody for: the general way's, or the daemon's fault."""

    @property
    def header(self) -> bytes:
        """its 56-byte header"""

    __match_args__: tuple = ('header',)

class RunEnd(enum.Enum):
    """How WorkerChannel.run() ended."""

    DONE = 0
    """complete: its result is in place"""

    CLOSED = 1
    """nothing done: starts are closed (shutting down); go the general way"""

    PARKED = 2
    """not complete in time: parked (resume, or adopt)"""

class Ran:
    """What WorkerChannel.run() did."""

    @property
    def end(self) -> RunEnd:
        """how it ended"""

    __match_args__: tuple = ('end', 'seq', 'slot')

    @property
    def seq(self) -> int:
        """PARKED: its sequence number (0 otherwise)"""

    @property
    def slot(self) -> Slot | None:
        """PARKED: its input slot (None otherwise)"""

RAN_DONE: Ran = ...

RAN_CLOSED: Ran = ...

class Segment:
    """
    A sealed memfd segment, mapped (smddp/engine/arena.h); its buffer is the mapping.
    """

    @property
    def id(self) -> int:
        """its id within its owner"""

    @property
    def size(self) -> int:
        """bytes"""

    @property
    def fd(self) -> int:
        """its memfd (-1 once closed)"""

    @property
    def writable(self) -> bool:
        """mapped read-write"""

    def check(self, offset: int, nbytes: int) -> None:
        """Raises ProtocolError unless the range lies inside the segment."""

    def close_fd(self) -> None:
        """The fd goes now, the mapping with its last holder."""

    def __buffer__(self, flags: int, /) -> memoryview: ...

def segment_create(id: int, size: int, name: str) -> Segment:
    """A new sealed memfd, mapped read-write."""

def segment_attach(id: int, fd: int, size: int, writable: bool) -> Segment:
    """
    A segment mapped from `fd`, which it takes over (closed on a refusal too).
    """

class Arena:
    """
    First fit over growing memfd segments (smddp/engine/arena.h); thread-safe.
    """

    def __init__(self, name: str, segment_bytes: int) -> None: ...

    @property
    def in_use(self) -> int:
        """bytes in live slots (rounded to the slot alignment)"""

    def alloc(self, nbytes: int) -> Allocated:
        """A slot of nbytes, and the segment made for it if one was."""

    def free(self, segment: int, offset: int, nbytes: int) -> None:
        """ValueError unless it is exactly a live slot."""

    def segment(self, id: int) -> Segment:
        """The arena's segment `id`, or None."""

    def close(self) -> None:
        """Drop every segment and slot."""

class LocalPlane:
    """
    The daemon's data plane: rings, reductions, the shard exchange (smddp/engine/local_plane.h).
    """

    def __init__(self, config: smddp.daemon.config.PlaneConfig, results: Arena, scratch: Arena | None = None) -> None: ...

    def __len__(self) -> int: ...

    def add_worker(self, local: int, rank: int, name: str, channel: object | None, side: int) -> None:
        """
        Its ring is polled from now on (the plane owns the fd side, closed on failure too).
        """

    def remove_worker(self, local: int) -> bool:
        """Whether it said BYE (its ring handled first)."""

    def rank_left_early(self, local: int, joined: bool, reason: str) -> bool:
        """Recorded; raises when a collective waits for it."""

    def left_early(self, local: int) -> bool:
        """Its process ended without joining."""

    def all_ranks_gone(self) -> bool:
        """Every local rank said BYE or left early."""

    def name_rank(self, local: int, name: str) -> None: ...

    def waiting(self) -> list[Waiting]:
        """The collectives in flight and not done."""

    def abort(self) -> None:
        """The job failed: handle nothing more."""

    def next_event(self, timeout_s: float) -> PeerFrame | PlaneFailure | None:
        """
        A peer's control frame; the plane's own failure; None: nothing in time.
        """

    def take_completions(self) -> list[Completion]:
        """What completed since the last take, summed."""

    def add_peer(self, node: int, fd: int) -> None:
        """
        The plane owns the authenticated stream `fd` from now on (closed on failure too).
        """

    def send_control(self, node: int, header: bytes, payload: bytes | None = None) -> str:
        r"""\'\' or why not: a control frame after what is queued to that peer."""

    def flush(self, timeout_s: float) -> bool:
        """Every control frame left (or its link went down)."""

    def fabric(self) -> tuple[str, dict[str, int]]:
        r"""
        The fabric to the other daemons and its counters (\'\' and {} on one node).
        """

    def peer_counters(self) -> list[PeerCounters]:
        """Each peer daemon's link."""

    def device_counts(self) -> list[WorkerDeviceCounts]:
        """
        Each local worker's device copies (its channel's counts), by local rank.
        """

    def take_traces(self) -> list[Trace]:
        """The retired collectives' phases."""

    def queued_tasks(self) -> tuple[int, int]:
        """(local, server): chunks waiting for a compute thread."""

    def counters(self) -> PlaneCounters:
        """The plane's running totals."""

    def close(self) -> None:
        """Stop every thread."""

class Started:
    """
    A fast collective started asynchronously (WorkerChannel.begin), and its handle.
    """

    def wait(self, timeout: float | None = None, stream: Any = None) -> Any:
        """Its result once in place (else the handle's _settle says what)."""

    def _wait(self, timeout_s: float, /) -> Any:
        """wait(timeout_s), for smddp's own callers."""

    def collect(self, drop: bool = False) -> bool | None:
        """
        None (finished already) or whether the channel took it: whoever takes its DONE completes it; drop: its result goes nowhere.
        """

    def give(self, timeout_s: float | None = None) -> None:
        """A reserved record's SUBMIT goes, in its place on the ring."""

    def _complete(self, failed: bool) -> None:
        """Finished other than by its own wait."""

    def _device_order(self, stream: int) -> None:
        """A device record's: `stream`'s later work waits for its copy back."""

    def _device_done(self) -> bool:
        """A device record's: whether its copy back has landed."""

    def _device_synchronize(self, timeout_s: float) -> bool:
        """
        A device record's: wait for its copy back to land; whether it did in time.
        """

    @property
    def seq(self) -> int:
        """its sequence number"""

    @property
    def kind(self) -> smddp.proto.dtypes.Kind:
        """its kind (smddp.proto.dtypes.Kind)"""

    @property
    def dtype(self) -> smddp.proto.dtypes.DType:
        """its dtype (smddp.proto.dtypes.DType)"""

    @property
    def count(self) -> int:
        """its SUBMIT's count"""

    @property
    def slot(self) -> Slot | None:
        """its input slot, or None"""

    @property
    def finished(self) -> bool:
        """complete: its result in place, or failed"""

    @property
    def _client(self) -> Any:
        """the ctx its channel was bound with"""

    @property
    def _value(self) -> Any:
        """what its wait returns"""

_S = TypeVar("_S", bound=Started)

class WorkerChannel:
    """A worker's rings to its daemon (smddp/engine/channel.h)."""

    def __init__(self, name: str) -> None: ...

    @property
    def segment(self) -> Segment:
        """the channel's segment (pass its fd to the daemon)"""

    @property
    def daemon_end(self) -> int:
        """the daemon's end of the side socket (pass it with CHANNEL)"""

    def push(self, header: bytes, timeout_s: float, spin_us: float) -> None:
        """A descriptor onto the submit ring."""

    def pop(self, timeout_s: float, spin_us: float) -> Completed | Unmatched | None:
        """
        What the done ring gave: a collected collective completed here, a DONE nobody had, or None (nothing in time; the fast path's waits go first).
        """

    def abort(self) -> None:
        """Pops return None from now on."""

    def release(self, rank: int, seq: int, nbytes: int, batch_bytes: int, timeout_s: float, spin_us: float) -> None:
        """
        RELEASE a result slot (small ones held back to go with the next SUBMIT).
        """

    def bind(self, arena: Arena, rank: int, batch_bytes: int, timeout_s: float, spin_us: float, handle_type: type[Started], ctx: Any) -> None:
        """What every begin() shares."""

    def begin(self, kind: int, src: Any, count: int, dtype: int, op: int, root: int, dst: Any, src_offset: int, result_bytes: int, owner: Any, result: Any, keepalive: Any) -> Any:
        """
        A record of bind()'s handle_type, or None (starts are closed): an asynchronous fast collective's slot, copy-in and SUBMIT under the next seq.
        """

    def begin_allreduce(self, src: Any, dtype: int, count: int, op: int, result: Any, keep: Any, /) -> Any:
        """
        begin() of an all-reduce in place, in one piece: a record of bind()'s handle_type, or None.
        """

    def live(self) -> list:
        """What begin() made and nothing has finished yet."""

    def unbind(self) -> None:
        """Let go of what bind() gave, and the live table."""

    def run(self, kind: int, buf: Any, count: int, dtype: int, op: int, timeout_s: float, /) -> Ran:
        """A blocking fast collective whole, its result in place."""

    def reserve_record(self, kind: int, count: int, dtype: int, op: int, root: int, slot: Slot | None, result_bytes: int, result: Any, keepalive: Any, handle_type: type[_S], node_summed: bool = False) -> _S:
        """
        A record whose SUBMIT goes with give() and whose result its way back (DeviceEngine.deliver_to) takes on; node_summed: its SUBMIT says the node's ranks summed it on their GPUs (each slot holds its slice).
        """

    def close_starts(self) -> None:
        """No fast collective starts from now on."""

    def blocking(self) -> list[int]:
        """The blocking fast collectives not finished."""

    def alloc(self, arena: Arena, nbytes: int, rank: int, timeout_s: float, spin_us: float) -> Allocated:
        """A slot, its segment ATTACHed first when new."""

    def adopt(self, seq: int) -> bytes | None:
        """
        A parked fast collective goes the general way: the DONE that came, or None.
        """

    def resume(self, seq: int, slot: Slot, kind: int, count: int, dtype: int, op: int, dst: Any, result: Any) -> Any:
        """
        A parked blocking collective as an asynchronous one: its record, or None.
        """

    def set_trace(self, on: bool) -> None:
        """Keep each fast collective's phases (take_traces), or stop."""

    def set_node_reduce(self, code: int) -> None:
        """
        Where this worker's device all-reduces are summed (0 not decided, 1 host, 2 the GPU step, 3 host after the step could not be had), for its daemon to show.
        """

    def set_stream(self, on: bool) -> None:
        """
        Large all-reduces stream through the channel's stream block (a job of one node).
        """

    def streamed(self) -> tuple[int, int]:
        """
        (copied in as it went, copied out before the DONE): bytes, since the channel began.
        """

    def take_traces(self) -> tuple[list[WorkerTrace], int]:
        """
        (the fast collectives' phases since the last take, how many were not kept).
        """

    def attach(self, segment: Segment, rank: int, timeout_s: float, spin_us: float) -> None:
        """ATTACH an input segment (its fd on the side socket)."""

    def result(self, id: int) -> Segment:
        """The result segment the daemon sent as `id`, or None."""

    def close_daemon_end(self) -> None:
        """The daemon's end of the side socket is closed here (once passed)."""

class NativeApi:
    """
    A bound channel's C function table for native front ends (smddp/engine/capi.h).
    """

    def __init__(self, channel: WorkerChannel, world: int, piece_bytes: int) -> None:
        """
        The table over `channel` (bound: its rank, arena, RELEASE batch, timeout and spin) in a job of `world` ranks, whose all-reduces go in pieces of `piece_bytes` (0: whole).
        """

    def capsule(self) -> object:
        """
        A capsule named smddp._engine.capi whose pointer is the table (a const smddp_capi*), valid while the capsule lives.
        """

    def fail_all(self, error_class: str, why: str) -> None:
        """
        Every work not complete fails with `why` (its callback called, nothing more written); starts are refused from now on.
        """

    def pending(self) -> int:
        """Works started and not complete."""

    def use_device(self, engine: object) -> None:
        """
        The table's device route (start_device) runs on `engine`'s path from now on; the table holds it.
        """

    def take_failure(self) -> tuple[str, str] | None:
        """
        The failure a start or wait met that fails the whole client, once: (error class, why), or None.
        """

class CopyIn:
    """
    A device collective's copy into its input slot, enqueued by the engine (DeviceEngine.copy_in).
    """

    def done(self) -> bool:
        """
        Whether the copy has landed; DeviceError for one that failed on the device.
        """

    def wait(self, timeout_s: float) -> bool:
        """
        Wait (polled, GIL released) up to `timeout_s` for the copy to land; whether it did. DeviceError for one that failed on the device.
        """

class Mark:
    """
    A point of a caller's stream (DeviceEngine.mark): the event a collective's copies wait for.
    """

    @property
    def device(self) -> int:
        """the device whose stream it was recorded on"""

class DeviceEngine:
    """
    A client's device path in the engine: held SUBMITs given once their copy-ins land, results copied back and RELEASEd.
    """

    def __init__(self, channel: WorkerChannel, library: str, spin_us: float) -> None:
        """
        The CUDA driver `library` loaded (OSError naming why not), for `channel`'s records.
        """

    def capturing(self, device: int, stream: int) -> bool:
        """
        Whether `stream` of `device` is capturing a CUDA graph (active or invalidated); DeviceError if the driver refuses to say.
        """

    def mark(self, device: int, stream: int) -> Mark:
        """
        An event recorded now on `stream` of `device` (a caller's): what a collective's copies wait for. DeviceError if refused.
        """

    def copy_in(self, arena: Arena, segment: int, offset: int, nbytes: int, device: int, src: int, stream: int, before: Mark | None) -> CopyIn:
        """
        Enqueue the copy of `nbytes` from device address `src` into the arena's slot (segment, offset) on `stream`, after `before` (None: nothing); the segment page-locked once. DeviceError if refused.
        """

    def give_when(self, record: Started, copy: CopyIn) -> bool:
        """
        Give the record's SUBMIT once its copy-in has landed; False once stopped.
        """

    def deliver_to(self, record: Started, device: int, stream: int, before: Mark | None, parts: Sequence[tuple[int, int, int]], hold: Any, then: tuple[int, int] | None = None) -> None:
        """
        The record's result goes to the device at its DONE: (address, offset, bytes) parts on `stream`, after `before` (None: nothing), then (`then`: (address, value)) a 32-bit device word written, then an event of the engine's recorded; `hold` kept until they land.
        """

    def failure(self) -> tuple[int, str] | None:
        """
        None, or (1: a device copy failed, 2: the daemon's ring; why) for the first failure.
        """

    def pending(self) -> int:
        """Watches not yet ended: copies in and back in flight."""

    def reap(self) -> list[str]:
        """
        Let go of what landed copies held; what the engine would log since the last call.
        """

    def settle(self, timeout_s: float) -> bool:
        """
        Wait for every copy in and back in flight to end; whether they did in time.
        """

    @property
    def driver_version(self) -> int:
        """the driver's cuDriverGetVersion (1000 * major + 10 * minor)"""

    def stop(self, unpin: bool) -> None:
        """
        End every watch (nothing is given or RELEASEd from now on); unpin: and let go of the result segments' page-locking (only once nothing copies from them).
        """

class StepDone:
    """A node collective's end on the device (DeviceStep.allreduce)."""

    def done(self) -> bool:
        """Whether it has ended; DeviceError for one that failed on the device."""

    def wait(self, timeout_s: float) -> bool:
        """
        Wait (polled, GIL released) up to `timeout_s` for its end; whether it came. DeviceError for a failure.
        """

    def order(self, stream: int) -> None:
        """`stream`'s later work waits for its end (on the device)."""

class DeviceStep:
    """
    One rank's GPU step: the node's ranks sum on their GPUs through each other's staging memory (smddp/engine/device_step.h).
    """

    def __init__(self, library: str, device: int, local_rank: int, local_size: int, slot_bytes: int) -> None:
        """
        The CUDA driver `library`; staging memory of two slots of `slot_bytes` on `device`, lanes and kernels. DeviceError naming why not.
        """

    max_ranks: int = ...
    """the most ranks of a node it takes"""

    card_bytes: int = ...
    """the bytes of a card"""

    def card(self) -> bytes:
        """What the node's other ranks need to open this rank's staging memory."""

    def join(self, cards: Sequence[bytes]) -> None:
        """
        Every local rank's card, in local-rank order: the others' staging memory opened; DeviceError why not.
        """

    def allreduce(self, buf: int, n: int, dtype: int, op: int, divisor: int, stream: int | None) -> StepDone:
        """
        Enqueue the node's all-reduce of `n` elements at device address `buf` (in place), after the work already on `stream` (None: the buffer is ready now); an average divided by `divisor`.
        """

    def reduce_scatter(self, input: int, out: int, part: int, dtype: int, op: int, divisor: int, stream: int | None) -> StepDone:
        """
        Enqueue the node's reduce-scatter (one node: the job) of local_size blocks of `part` elements at device address `input`, this rank's block of the result to `out`; as allreduce otherwise.
        """

    def allgather(self, input: int, out: int, n: int, dtype: int, stream: int | None) -> StepDone:
        """
        Enqueue the node's all-gather (one node: the job) of each rank's `n` elements at `input` into `out` (local_size x n, local rank order): copies alone.
        """

    def broadcast(self, buf: int, n: int, dtype: int, root: int, stream: int | None) -> StepDone:
        """
        Enqueue the node's broadcast (one node: the job) of local rank `root`'s `n` elements at `buf`.
        """

    def close(self, timeout_s: float) -> bool:
        """
        Wait up to `timeout_s` for its lanes and its peers' reads of its slots to end, then let go of its memory, lanes and kernels: whether it could (else they stay until the process ends).
        """

    def allreduce_across(self, engine: object, arena: Arena, slots: Sequence[tuple[int, int]], buf: int, n: int, dtype: int, op: int, stream: int | None) -> tuple[StepDone, list[CopyIn], list[tuple[int, int, int, int, int, int]]]:
        """
        Across nodes: enqueue the node's partial of each piece, its slice copied to the host into its slot (segment, offset: the slice alone) by the engine's device path; (end, copy-ins, (number, count, back address, back offset in the piece's result, back bytes, out_ready address) per piece).
        """

    def allgather_across(self, engine: object, arena: Arena, slots: Sequence[tuple[int, int]], input: int, out: int, n: int, dtype: int, world: int, stream: int | None) -> tuple[StepDone, list[CopyIn], list[tuple[int, int, int, int, int, int]]]:
        """
        Across nodes: enqueue an all-gather of `world` ranks' `n` elements each, each piece of `input` copied to the host into its slot; the node gathers the rows each rank brings back into `out`; as allreduce_across's otherwise.
        """

    def reduce_scatter_across(self, engine: object, arena: Arena, slots: Sequence[tuple[int, int]], input: int, out: int, part: int, dtype: int, op: int, world: int, rank: int, stream: int | None) -> tuple[StepDone, list[CopyIn], list[tuple[int, int, int, int, int, int]]]:
        """
        Across nodes: enqueue a reduce-scatter of `world` ranks' blocks of `part` elements, the node's partial of each piece summed on the GPUs, this rank's slice of it copied to the host into its slot; block `rank` of each piece's result comes back into `out`; as allreduce_across's otherwise.
        """

    def broadcast_across(self, engine: object, arena: Arena, slots: Sequence[tuple[int, int]], buf: int, n: int, dtype: int, root: bool, stream: int | None) -> tuple[StepDone, list[CopyIn], list[tuple[int, int, int, int, int, int]]]:
        """
        Across nodes: enqueue a broadcast, each piece copied to the host into its slot where `root` (this rank is the job's root; elsewhere every slot is (-1, 0): nothing is sent); the node gathers the slices each rank brings back into `buf`; as allreduce_across's otherwise.
        """

    def piece_counts(self, n: int, itemsize: int) -> list[int]:
        """The elements of each piece a buffer of `n` elements goes in."""

    @property
    def back_lane(self) -> int:
        """the stream its slices' results come back on (across nodes)"""

    @property
    def pieces(self) -> int:
        """pieces enqueued so far"""

    @property
    def slot_bytes(self) -> int:
        """bytes of each slot"""

def ofi_providers(library: str) -> list[str]:
    """
    The providers of that libfabric with reliable-datagram tagged messages.
    """
