"""The frame: a fixed 56-byte binary header and a raw payload, encoded and checked without sockets."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from smddp import _engine
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
# A worker's SUBMITs may reach its daemon out of sequence order, each at most this far past the
# lowest it has not sent yet: a device collective's goes once its copy to the host lands, and the
# collectives after it do not wait for it (docs/protocol.md, "Sequence numbers").
SUBMIT_WINDOW = 128
# A SUBMIT's flag: the node's ranks summed this all-reduce on their GPUs (the GPU step, docs/gpu.md),
# and each rank's slot holds only its slice of the node's sum (slice l of G: elements
# [count*l//G, count*(l+1)//G)), from the slot's start; the daemon takes each element from its
# slice's owner instead of folding the node's inputs. Every rank of a node sets it alike.
SUBMIT_NODE_SUMMED = 0x0001
# Where a worker's device all-reduces are summed, as it writes it in its channel's device counts for
# its daemon to show (code -> label): not decided yet, the host path, the GPU step, the host path
# because the GPU step could not be had (the worker's log says why).
NODE_REDUCE_LABELS = ("", "host", "gpu", "host (fallback)")
# The flag bits each message may carry (none: any set bit is refused as reserved).
FLAGS = {"SUBMIT": SUBMIT_NODE_SUMMED}


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
    """Pack a header; refuses values that the decoder would refuse, so we never send garbage. The
    engine's codec does both (smddp/engine/frame.cc: the one codec, this side's and the engine's)."""
    return _engine.encode_header(
        h.type,
        h.flags,
        0 if h.dtype is None else h.dtype,
        0 if h.op is None else h.op,
        0 if h.kind is None else h.kind,
        h.sender,
        h.seq,
        h.shard,
        h.aux,
        h.offset,
        h.length,
        h.count,
    )


def decode_header(data: bytes | bytearray | memoryview) -> Header:
    """Unpack and validate one header; every field is checked before anyone trusts it (by the engine's
    codec, smddp/engine/frame.cc)."""
    mtype, flags, dtype, op, kind, sender, seq, shard, aux, offset, length, count = _engine.decode_header(
        data
    )
    t = _TYPES[mtype]
    fingerprinted = t in FINGERPRINTED
    return Header(
        type=t,
        sender=sender,
        seq=seq,
        shard=shard,
        aux=aux,
        offset=offset,
        length=length,
        count=count,
        dtype=_DTYPES[dtype] if fingerprinted else None,
        op=_OPS[op] if fingerprinted and op else None,
        kind=_KINDS[kind] if fingerprinted else None,
        flags=flags,
    )


def allowed_flags(t: MsgType) -> int:
    """The flag bits a message of type `t` may carry."""
    return FLAGS.get(t.name, 0)


def payload_limit(t: MsgType) -> int:
    """The most payload bytes a message of type `t` may carry."""
    if t in _EMPTY:
        return 0
    if t is MsgType.REPORT:
        return MAX_REPORT_PAYLOAD
    if t in _CONTROL:
        return MAX_CONTROL_PAYLOAD
    return MAX_DATA_PAYLOAD


def error_frame(text: str, sender: int = 0, aux: int = 0) -> bytes:
    """An ERROR frame with its UTF-8 reason, cut to fit the control limit (`aux`: see proto.failure)."""
    body = text.encode("utf-8", "replace")[:MAX_CONTROL_PAYLOAD]
    return encode_header(Header(MsgType.ERROR, sender=sender, aux=aux, length=len(body))) + body
