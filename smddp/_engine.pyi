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
