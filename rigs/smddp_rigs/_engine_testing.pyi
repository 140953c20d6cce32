from collections.abc import Sequence
from typing import Any


HEADER_SIZE: int = 56

BLOCK: int = 2048

def shard_range(count: int, nshards: int, shard: int) -> tuple[int, int]:
    """
    (start, end): shard `shard` of `count` elements cut in `nshards` balanced shards.
    """

def locate_reduce(count: int, itemsize: int, nshards: int, chunk_elems: int, shard: int, byte_offset: int, byte_length: int) -> tuple[int, int, int]:
    """(index, start, end) of the chunk a frame of a reduction carries."""

def locate_block(start: int, end: int, chunk_bytes: int, byte_offset: int, byte_length: int) -> int:
    """The index of the block a frame of a gather carries."""

def reduce16(kind: int, op: int, inputs: Sequence[Any], out: Any, divisor: float, portable: bool = False) -> list[int]:
    """
    The 16-bit block kernel alone: the block indices (NaN) left for the caller.
    """

def reduce(dtype: int, op: int, inputs: Sequence[Any], out: Any, divisor: int) -> None:
    """The daemon's kernel, any wire dtype."""

class Collective:
    """
    One collective as a daemon sees it: the state machine without I/O (smddp/engine/collective.h).
    """

    def __init__(self, who: str, seq: int, kind: int, itemsize: int, widened: bool, count: int, has_op: bool, root: int, node: int, nnodes: int, local_size: int, world: int, chunk_bytes: int, replicate_bytes: int) -> None: ...

    @property
    def replicated(self) -> bool:
        """every node serves the whole buffer (one network step)"""

    @property
    def own_in_input(self) -> bool:
        """the one local input is the node partial as it is"""

    @property
    def is_gather(self) -> bool:
        """a broadcast or all-gather"""

    @property
    def done(self) -> bool:
        """every chunk is complete"""

    @property
    def may_retire(self) -> bool:
        """done, released by every local rank, every send left"""

    @property
    def server_live(self) -> bool:
        """its server rows are still in use"""

    @property
    def submitted(self) -> int:
        """how many local ranks submitted"""

    @property
    def server_rows(self) -> int:
        """rows of own_range() held for every node's partial (0: none)"""

    @property
    def result_bytes(self) -> int:
        """bytes of the result every local rank reads"""

    @property
    def own_range(self) -> tuple[int, int]:
        """(start, end): the elements (or block bytes) this node serves"""

    def submit(self, local_rank: int, who: str) -> bool:
        """Whether every local rank is in now."""

    def local_tasks(self) -> list[tuple[int, int, int, int]]:
        """
        [(shard, index, start, end)]: the chunks the local ranks' inputs reduce to.
        """

    def own_chunk(self, index: int) -> tuple[int, int, int, int]:
        """(shard, index, start, end) of a chunk this node serves."""

    def locate_partial(self, node: int, shard: int, offset: int, length: int, who: str, me: str) -> tuple[int, int, int]:
        """(index, start, end) of the chunk a PARTIAL from `node` carries."""

    def partial_arrived(self, index: int, node: int, who: str) -> bool:
        """Whether every node's partial of the chunk is in."""

    def locate_result(self, node: int, shard: int, offset: int, length: int, who: str) -> tuple[int, int, int]:
        """(index, start, end), marked as arriving."""

    def locate_block(self, node: int, offset: int, length: int, who: str) -> tuple[int, int, int]:
        """(index, start, end) in bytes, marked as arriving."""

    def chunk_completed(self) -> bool:
        """Whether it just became done."""

    def send_started(self) -> None: ...

    def send_finished(self) -> bool:
        """Whether it may now retire."""

    def release(self, local_rank: int, who: str) -> bool:
        """Whether it may now retire."""

    def lacks_from(self, node: int) -> bool:
        """Whether a frame from that node is still due."""

    def submitted_by(self, local_rank: int) -> bool:
        """Whether that rank submitted."""

    def late_nodes(self) -> list[int]:
        """The nodes whose part is missing."""

class NodeState:
    """
    The daemon's collectives in flight and the job-wide rules around them (smddp/engine/node_state.h). Verdicts raise smddp.errors: ProtocolError, CollectiveMismatchError or PeerLostError.
    """

    def __init__(self, node: int, nnodes: int, local_size: int, world: int, chunk_bytes: int, replicate_bytes: int, node_names: Sequence[str], rank_names: Sequence[str]) -> None: ...

    def __len__(self) -> int: ...

    def name_rank(self, local: int, name: str) -> None:
        """How the rank is named from now on."""

    def op_for(self, seq: int, kind: int, dtype: int, itemsize: int, widened: bool, count: int, op: int, root: int, who: str) -> Collective:
        """
        The new Collective, or None when it existed (with the same fingerprint).
        """

    def submit(self, local: int, seq: int, kind: int, dtype: int, itemsize: int, widened: bool, count: int, op: int, root: int, node_summed: bool = False) -> tuple[Collective, bool]:
        """
        (the new Collective or None, whether every local rank is in); node_summed: the SUBMIT's kSubmitNodeSummed.
        """

    def release(self, local: int, seq: int) -> bool:
        """Whether it left the table."""

    def send_finished(self, seq: int) -> bool:
        """Whether it left the table."""

    def rank_said_bye(self, local: int) -> None:
        """Raises when a collective still needed it."""

    def peer_said_bye(self, node: int) -> None:
        """Raises when a collective still waited for it."""

    def rank_left_early(self, local: int, joined: bool, reason: str) -> bool:
        """Whether it was recorded; raises when a collective waits for it."""

    def all_ranks_gone(self) -> bool:
        """Every local rank said BYE or left early."""

    def left_early(self, local: int) -> bool:
        """Whether its process ended without joining."""

class DaemonChannel:
    """
    The daemon's end of a worker's rings, for a stand-in daemon (smddp/engine/ring.h).
    """

    def __init__(self, fd: int, size: int, side: int) -> None: ...

    def pop(self, timeout_s: float) -> bytes | None:
        """
        The next header of the submit ring (ATTACHes taken in on the way), or None.
        """

    def push(self, header: bytes, timeout_s: float) -> None:
        """Onto the done ring."""

    def send_segment(self, fd: int, id: int, size: int, node: int, timeout_s: float) -> None:
        """The fd on the side socket, then SEGMENT on the done ring."""
