"""Types of smddp._engine, the compiled engine (smddp/engine/module.cc); every error is a ProtocolError."""

HEADER_SIZE: int

def decode_header(
    data: bytes | bytearray | memoryview, /
) -> tuple[int, int, int, int, int, int, int, int, int, int, int, int]: ...
def encode_header(
    type: int,
    sender: int,
    seq: int,
    shard: int,
    aux: int,
    offset: int,
    length: int,
    count: int,
    dtype: int,
    op: int,
    kind: int,
    /,
) -> bytes: ...
def shard_range(count: int, nshards: int, shard: int, /) -> tuple[int, int]: ...
def locate_reduce(
    count: int,
    itemsize: int,
    nshards: int,
    chunk_elems: int,
    shard: int,
    byte_offset: int,
    byte_length: int,
    /,
) -> tuple[int, int, int]: ...
def locate_block(start: int, end: int, chunk_bytes: int, byte_offset: int, byte_length: int, /) -> int: ...
def reduce16(kind: int, op: int, inputs: list, out: object, divisor: float, /) -> list[int]: ...
def reduce(dtype: int, op: int, inputs: list, out: object, divisor: int, /) -> None: ...
def has_f16c() -> bool: ...

BLOCK: int

class Collective:
    """One collective as a daemon sees it: the state machine without I/O (smddp/engine/collective.h)."""

    def __new__(
        cls,
        who: str,
        seq: int,
        kind: int,
        itemsize: int,
        widened: bool,
        count: int,
        has_op: bool,
        root: int,
        node: int,
        nnodes: int,
        local_size: int,
        world: int,
        chunk_bytes: int,
        replicate_bytes: int,
    ) -> Collective: ...
    @property
    def replicated(self) -> bool: ...
    @property
    def own_in_input(self) -> bool: ...
    @property
    def is_gather(self) -> bool: ...
    @property
    def done(self) -> bool: ...
    @property
    def may_retire(self) -> bool: ...
    @property
    def server_live(self) -> bool: ...
    @property
    def submitted(self) -> int: ...
    @property
    def server_rows(self) -> int: ...
    @property
    def result_bytes(self) -> int: ...
    @property
    def own_range(self) -> tuple[int, int]: ...
    def submit(self, local_rank: int, who: str, /) -> bool: ...
    def local_tasks(self) -> list[tuple[int, int, int, int]]: ...
    def own_chunk(self, index: int, /) -> tuple[int, int, int, int]: ...
    def locate_partial(
        self, node: int, shard: int, offset: int, length: int, who: str, me: str, /
    ) -> tuple[int, int, int]: ...
    def partial_arrived(self, index: int, node: int, who: str, /) -> bool: ...
    def locate_result(
        self, node: int, shard: int, offset: int, length: int, who: str, /
    ) -> tuple[int, int, int]: ...
    def locate_block(self, node: int, offset: int, length: int, who: str, /) -> tuple[int, int, int]: ...
    def chunk_completed(self) -> bool: ...
    def send_started(self) -> None: ...
    def send_finished(self) -> bool: ...
    def release(self, local_rank: int, who: str, /) -> bool: ...
    def lacks_from(self, node: int, /) -> bool: ...
    def submitted_by(self, local_rank: int, /) -> bool: ...
    def late_nodes(self) -> list[int]: ...

class NodeState:
    """The daemon's collectives in flight and the job-wide rules around them (smddp/engine/node_state.h).

    Verdicts raise smddp.errors: ProtocolError, CollectiveMismatchError or PeerLostError.
    """

    def __new__(
        cls,
        node: int,
        nnodes: int,
        local_size: int,
        world: int,
        chunk_bytes: int,
        replicate_bytes: int,
        node_names: list[str],
        rank_names: list[str],
    ) -> NodeState: ...
    def __len__(self) -> int: ...
    def name_rank(self, local: int, name: str, /) -> None: ...
    def op_for(
        self,
        seq: int,
        kind: int,
        dtype: int,
        itemsize: int,
        widened: bool,
        count: int,
        op: int,
        root: int,
        who: str,
        /,
    ) -> Collective | None: ...
    def submit(
        self,
        local: int,
        seq: int,
        kind: int,
        dtype: int,
        itemsize: int,
        widened: bool,
        count: int,
        op: int,
        root: int,
        /,
    ) -> tuple[Collective | None, bool]: ...
    def release(self, local: int, seq: int, /) -> bool: ...
    def send_finished(self, seq: int, /) -> bool: ...
    def rank_said_bye(self, local: int, /) -> None: ...
    def peer_said_bye(self, node: int, /) -> None: ...
    def rank_left_early(self, local: int, joined: bool, reason: str, /) -> bool: ...
    def all_ranks_gone(self) -> bool: ...
    def left_early(self, local: int, /) -> bool: ...
