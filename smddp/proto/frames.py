"""The frame: a fixed 56-byte binary header and a raw payload, encoded and checked without sockets."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from smddp.errors import ProtocolError
from smddp.proto.dtypes import DType, Kind, ReduceOp

MAGIC = b"SMDP"
VERSION = 1

# The header's fields in wire order, each with its struct code (little-endian, no padding). This
# module and dtypes.py are the one definition of the wire: the engine's codes, offsets and limits
# (smddp/engine/wire.h) are generated from them (`make wire-header`; a test fails when it is stale).
HEADER_FIELDS = (
    ("magic", "4s"),
    ("version", "B"),
    ("type", "B"),
    ("flags", "H"),
    ("dtype", "B"),
    ("op", "B"),
    ("kind", "B"),
    ("reserved", "B"),
    ("sender", "I"),
    ("seq", "Q"),
    ("shard", "I"),
    ("aux", "I"),
    ("offset", "Q"),
    ("length", "Q"),
    ("count", "Q"),
)
_HEADER = struct.Struct("<" + "".join(code for _, code in HEADER_FIELDS))
HEADER_SIZE = _HEADER.size  # 56
# Byte offset of each field in the header.
HEADER_OFFSETS = {
    name: struct.calcsize("<" + "".join(code for _, code in HEADER_FIELDS[:i]))
    for i, (name, _) in enumerate(HEADER_FIELDS)
}

# A control payload (handshake, error text) is small; anything larger is an attack or a bug.
MAX_CONTROL_PAYLOAD = 64 * 1024
# A status report (JSON) of every daemon of a job.
MAX_REPORT_PAYLOAD = 1 << 20
# A data frame never carries more than one pipelining chunk; this is the hard ceiling.
MAX_DATA_PAYLOAD = 256 * 1024 * 1024
MAX_U32 = 2**32 - 1
MAX_U63 = 2**63 - 1


class MsgType(enum.IntEnum):
    """Every message of the protocol; docs/protocol.md describes each field by field."""

    # handshake (any connection)
    CHALLENGE = 1
    HELLO = 2
    WELCOME = 3
    # worker -> daemon (unix socket)
    ATTACH = 10
    SUBMIT = 11
    RELEASE = 12
    CHANNEL = 13
    # daemon -> worker (unix socket)
    SEGMENT = 20
    DONE = 21
    # daemon <-> daemon (TCP)
    PARTIAL = 30
    RESULT = 31
    BLOCK = 32
    HEARTBEAT = 33
    # any direction
    ERROR = 40
    BYE = 41
    # status: a control client (smddp status) or a daemon asks, a daemon answers with JSON
    STATUS = 42
    REPORT = 43
    # launcher wrapper -> daemon (control connection): rank `sender`'s process ended with status `aux`
    EXITED = 44


class Role(enum.IntEnum):
    """Who is on the other end of a connection, stated in HELLO."""

    WORKER = 1
    DAEMON = 2
    CONTROL = 3


class Flags(enum.IntFlag):
    NONE = 0


_CONTROL = {MsgType.CHALLENGE, MsgType.HELLO, MsgType.WELCOME, MsgType.ERROR}
_DATA = {MsgType.PARTIAL, MsgType.RESULT, MsgType.BLOCK}
_EMPTY = {
    MsgType.ATTACH,
    MsgType.SUBMIT,
    MsgType.RELEASE,
    MsgType.CHANNEL,
    MsgType.SEGMENT,
    MsgType.DONE,
    MsgType.HEARTBEAT,
    MsgType.BYE,
    MsgType.STATUS,
    MsgType.EXITED,
}
# Messages that describe a collective carry its fingerprint: kind, dtype, op, count, root.
FINGERPRINTED = frozenset({MsgType.SUBMIT, MsgType.DONE} | _DATA)
# Wire value -> member. A dict lookup costs a tenth of calling the enum, and every frame pays it.
_TYPES = {int(t): t for t in MsgType}
_DTYPES = {int(d): d for d in DType}
_KINDS = {int(k): k for k in Kind}
_OPS = {int(o): o for o in ReduceOp}


@dataclass(frozen=True, slots=True)
class Header:
    """One decoded header; `length` bytes of payload follow it on the wire."""

    type: MsgType
    sender: int = 0
    seq: int = 0
    shard: int = 0
    aux: int = 0
    offset: int = 0
    length: int = 0
    count: int = 0
    dtype: DType | None = None
    op: ReduceOp | None = None
    kind: Kind | None = None
    flags: int = 0

    def encode(self) -> bytes:
        return encode_header(self)


def encode_header(h: Header) -> bytes:
    """Pack a header; refuses values that the decoder would refuse, so we never send garbage."""
    for name, value, limit in (
        ("sender", h.sender, MAX_U32),
        ("shard", h.shard, MAX_U32),
        ("aux", h.aux, MAX_U32),
        ("seq", h.seq, MAX_U63),
        ("offset", h.offset, MAX_U63),
        ("count", h.count, MAX_U63),
    ):
        if not 0 <= value <= limit:
            raise ProtocolError(f"cannot encode {h.type.name}: field {name}={value} out of range")
    _check_length(h.type, h.length)
    if h.flags != 0:
        raise ProtocolError(f"cannot encode {h.type.name}: no flags are defined in version {VERSION}")
    if h.type in FINGERPRINTED:
        if h.dtype is None or h.kind is None:
            raise ProtocolError(f"cannot encode {h.type.name} without its dtype and kind")
    elif h.dtype is not None or h.op is not None or h.kind is not None:
        raise ProtocolError(f"cannot encode {h.type.name} with a dtype, op or kind")
    return _HEADER.pack(
        MAGIC,
        VERSION,
        int(h.type),
        int(h.flags),
        int(h.dtype) if h.dtype is not None else 0,
        int(h.op) if h.op is not None else 0,
        int(h.kind) if h.kind is not None else 0,
        0,
        h.sender,
        h.seq,
        h.shard,
        h.aux,
        h.offset,
        h.length,
        h.count,
    )


def decode_header(data: bytes | bytearray | memoryview) -> Header:
    """Unpack and validate one header; every field is checked before anyone trusts it."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"header must be {HEADER_SIZE} bytes, got {len(data)}")
    (
        magic,
        version,
        mtype,
        flags,
        dtype,
        op,
        kind,
        reserved,
        sender,
        seq,
        shard,
        aux,
        offset,
        length,
        count,
    ) = _HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (not an smddp peer)")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    t = _TYPES.get(mtype)
    if t is None:
        raise ProtocolError(f"unknown message type {mtype}")
    if reserved != 0 or flags != 0:
        raise ProtocolError(f"{t.name}: reserved bits set (flags={flags:#x}, reserved={reserved})")
    if seq > MAX_U63 or offset > MAX_U63 or count > MAX_U63:
        raise ProtocolError(f"{t.name}: seq/offset/count beyond 2**63")
    _check_length(t, length)
    d = o = k = None
    if t in FINGERPRINTED:
        d = _DTYPES.get(dtype)
        k = _KINDS.get(kind)
        if d is None or k is None:
            raise ProtocolError(f"{t.name}: unknown dtype {dtype} or kind {kind}")
        if op != 0:
            o = _OPS.get(op)
            if o is None:
                raise ProtocolError(f"{t.name}: unknown reduce op {op}")
    elif dtype or op or kind:
        raise ProtocolError(f"{t.name}: dtype/op/kind must be zero on this message")
    return Header(
        type=t,
        sender=sender,
        seq=seq,
        shard=shard,
        aux=aux,
        offset=offset,
        length=length,
        count=count,
        dtype=d,
        op=o,
        kind=k,
        flags=flags,
    )


def payload_limit(t: MsgType) -> int:
    """The most payload bytes a message of type `t` may carry."""
    if t in _EMPTY:
        return 0
    if t is MsgType.REPORT:
        return MAX_REPORT_PAYLOAD
    if t in _CONTROL:
        return MAX_CONTROL_PAYLOAD
    return MAX_DATA_PAYLOAD


def _check_length(t: MsgType, length: int) -> None:
    limit = payload_limit(t)
    if not 0 <= length <= limit:
        raise ProtocolError(f"{t.name}: payload length {length} exceeds the limit of {limit} bytes")


def error_frame(text: str, sender: int = 0, aux: int = 0) -> bytes:
    """An ERROR frame with its UTF-8 reason, cut to fit the control limit (`aux`: see proto.failure)."""
    body = text.encode("utf-8", "replace")[:MAX_CONTROL_PAYLOAD]
    return encode_header(Header(MsgType.ERROR, sender=sender, aux=aux, length=len(body))) + body
