"""The engine's frame decoder against the Python reference: the same bytes taken, the same refused, no crash."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smddp_rigs import _engine_testing

from smddp.errors import ProtocolError
from smddp.proto.dtypes import DType, Kind, ReduceOp
from smddp.proto.frames import HEADER_SIZE, Header, MsgType, decode_header

_LAYOUT = struct.Struct("<4sBBHBBBBIQIIQQQ")
_FIELDS = (
    "type",
    "flags",
    "dtype",
    "op",
    "kind",
    "sender",
    "seq",
    "shard",
    "aux",
    "offset",
    "length",
    "count",
)
# Values near every bound the decoder checks, so that random headers land on both sides of each.
_EDGES = [
    0,
    1,
    2,
    7,
    8,
    255,
    256,
    65535,
    65536,
    2**20,
    2**20 + 1,
    2**28,
    2**28 + 1,
    2**32 - 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
]


def _reference(data: bytes) -> tuple[int, ...] | None:
    """proto/frames.py's verdict as the engine's tuple, or None where it refuses the bytes."""
    try:
        h = decode_header(data)
    except ProtocolError:
        return None
    return (
        int(h.type), h.flags, int(h.dtype or 0), int(h.op or 0), int(h.kind or 0),
        h.sender, h.seq, h.shard, h.aux, h.offset, h.length, h.count,
    )  # fmt: skip


def _engine_verdict(data: bytes) -> tuple[int, ...] | None:
    try:
        return tuple(_engine_testing.decode_header(data))
    except ProtocolError:
        return None


def _near(limit: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([e for e in _EDGES if e <= limit]), st.integers(0, limit))


@st.composite
def _headers(draw: st.DrawFn) -> bytes:
    magic = draw(st.sampled_from([b"SMDP", b"SMDP", b"SMDP", b"SMDQ", b"\0\0\0\0"]))
    version = draw(st.sampled_from([1, 1, 1, 0, 2, 255]))
    mtype = draw(st.one_of(st.sampled_from([int(t) for t in MsgType]), st.integers(0, 255)))
    small = st.one_of(st.just(0), st.integers(0, 9), st.integers(0, 255))
    flags = draw(st.one_of(st.just(0), st.just(0), st.integers(0, 65535)))
    dtype, op, kind = draw(small), draw(small), draw(small)
    reserved = draw(st.one_of(st.just(0), st.just(0), st.integers(0, 255)))
    u32, u64 = 2**32 - 1, 2**64 - 1
    return _LAYOUT.pack(
        magic, version, mtype, flags, dtype, op, kind, reserved,
        draw(_near(u32)), draw(_near(u64)), draw(_near(u32)), draw(_near(u32)),
        draw(_near(u64)), draw(_near(u64)), draw(_near(u64)),
    )  # fmt: skip


# 1500 here; the decoder is also fuzzed by libFuzzer (make engine-fuzz, make fuzz) and its own drivers.
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_headers())
def test_same_verdict_on_structured_headers(data):
    assert _engine_verdict(data) == _reference(data)


@settings(max_examples=2000, deadline=None)
@given(st.binary(min_size=0, max_size=200))
def test_any_bytes_are_a_header_or_a_protocol_error(data):
    assert _engine_verdict(data) == _reference(data)


def test_every_valid_message_round_trips():
    for t in MsgType:
        fp = t in (MsgType.SUBMIT, MsgType.DONE, MsgType.PARTIAL, MsgType.RESULT, MsgType.BLOCK)
        h = Header(t, sender=3, seq=2**63 - 1, shard=7, aux=2, offset=4096, count=10)
        args = (int(t), 3, 2**63 - 1, 7, 2, 4096, 0, 10, 6 if fp else 0, 1 if fp else 0, 1 if fp else 0)
        wire = _engine_testing.encode_header(*args)
        if fp:
            h = Header(t, sender=3, seq=2**63 - 1, shard=7, aux=2, offset=4096, count=10,
                       dtype=DType(6), op=ReduceOp(1), kind=Kind(1))  # fmt: skip
        assert wire == h.encode() and len(wire) == HEADER_SIZE == _engine_testing.HEADER_SIZE
        assert _engine_testing.decode_header(wire) == _reference(wire)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ((99, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), "unknown message type"),
        ((int(MsgType.BYE), 0, 2**63, 0, 0, 0, 0, 0, 0, 0, 0), "beyond 2\\*\\*63"),
        ((int(MsgType.BYE), 0, 0, 0, 0, 0, 1, 0, 0, 0, 0), "exceeds the limit"),
        ((int(MsgType.SUBMIT), 0, 0, 0, 0, 0, 0, 1, 0, 0, 0), "without its dtype and kind"),
        ((int(MsgType.BYE), 0, 0, 0, 0, 0, 0, 0, 6, 0, 0), "with a dtype"),
        ((int(MsgType.BYE), 2**32, 0, 0, 0, 0, 0, 0, 0, 0, 0), "out of range"),
    ],
)
def test_encode_refuses_what_decode_would(args, why):
    with pytest.raises(ProtocolError, match=why):
        _engine_testing.encode_header(*args)
