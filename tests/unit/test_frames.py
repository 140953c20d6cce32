"""The 56-byte frame header: round trips, and every malformed header refused with ProtocolError."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smddp.errors import ProtocolError
from smddp.proto import HEADER_SIZE, DType, Header, Kind, MsgType, ReduceOp, decode_header, encode_header
from smddp.proto.frames import (
    MAGIC,
    MAX_CONTROL_PAYLOAD,
    MAX_DATA_PAYLOAD,
    MAX_REPORT_PAYLOAD,
    SUBMIT_NODE_SUMMED,
    VERSION,
    allowed_flags,
    error_frame,
)

LAYOUT = struct.Struct("<4sBBHBBBBIQIIQQQ")
U32 = 2**32 - 1
U63 = 2**63 - 1

CONTROL = [MsgType.CHALLENGE, MsgType.HELLO, MsgType.WELCOME, MsgType.ERROR]
DATA = [MsgType.PARTIAL, MsgType.RESULT, MsgType.BLOCK]
EMPTY = [
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
]
REPORT = [MsgType.REPORT]  # a JSON status report: larger than a control frame, far smaller than data
FINGERPRINTED = [MsgType.SUBMIT, MsgType.DONE, *DATA]


def limit_of(t: MsgType) -> int:
    if t in EMPTY:
        return 0
    if t in CONTROL:
        return MAX_CONTROL_PAYLOAD
    if t in REPORT:
        return MAX_REPORT_PAYLOAD
    return MAX_DATA_PAYLOAD


def test_message_classes_cover_every_type():
    assert set(CONTROL) | set(DATA) | set(EMPTY) | set(REPORT) == set(MsgType)
    assert HEADER_SIZE == 56 == LAYOUT.size


def raw(
    mtype=int(MsgType.HEARTBEAT),
    magic=MAGIC,
    version=VERSION,
    flags=0,
    dtype=0,
    op=0,
    kind=0,
    reserved=0,
    sender=0,
    seq=0,
    shard=0,
    aux=0,
    offset=0,
    length=0,
    count=0,
) -> bytes:
    return LAYOUT.pack(
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
    )


def valid_raw(t: MsgType, **kw) -> bytes:
    """A header that decodes, with `kw` overriding fields."""
    fields = {"mtype": int(t)}
    if t in FINGERPRINTED:
        fields.update(dtype=int(DType.FLOAT32), kind=int(Kind.ALLREDUCE), op=int(ReduceOp.SUM))
    fields.update(kw)
    return raw(**fields)


@st.composite
def headers(draw, t: MsgType | None = None) -> Header:
    if t is None:
        t = draw(st.sampled_from(list(MsgType)))
    dtype = op = kind = None
    if t in FINGERPRINTED:
        dtype = draw(st.sampled_from(list(DType)))
        kind = draw(st.sampled_from(list(Kind)))
        op = draw(st.none() | st.sampled_from(list(ReduceOp)))
    return Header(
        type=t,
        sender=draw(st.integers(0, U32)),
        seq=draw(st.integers(0, U63)),
        shard=draw(st.integers(0, U32)),
        aux=draw(st.integers(0, U32)),
        offset=draw(st.integers(0, U63)),
        length=draw(st.integers(0, limit_of(t))),
        count=draw(st.integers(0, U63)),
        dtype=dtype,
        op=op,
        kind=kind,
    )


@pytest.mark.parametrize("t", list(MsgType), ids=lambda t: t.name)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_round_trip_every_type(t, data):
    h = data.draw(headers(t))
    wire = encode_header(h)
    assert len(wire) == HEADER_SIZE
    assert wire[:4] == MAGIC
    back = decode_header(wire)
    assert back == h
    assert decode_header(bytearray(wire)) == h
    assert decode_header(memoryview(wire)) == h
    assert h.encode() == wire


def test_round_trip_extremes():
    for t in FINGERPRINTED:
        h = Header(
            t,
            sender=U32,
            seq=U63,
            shard=U32,
            aux=U32,
            offset=U63,
            length=limit_of(t),
            count=U63,
            dtype=DType.FLOAT64,
            op=ReduceOp.MAX,
            kind=Kind.BARRIER,
        )
        assert decode_header(encode_header(h)) == h


def test_field_positions_on_the_wire():
    h = Header(
        MsgType.PARTIAL,
        sender=7,
        seq=9,
        shard=3,
        aux=5,
        offset=4096,
        length=1024,
        count=77,
        dtype=DType.BFLOAT16,
        op=ReduceOp.AVG,
        kind=Kind.REDUCE_SCATTER,
    )
    fields = LAYOUT.unpack(encode_header(h))
    assert fields == (MAGIC, VERSION, 30, 0, 5, 2, 4, 0, 7, 9, 3, 5, 4096, 1024, 77)


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 55, 57, 112])
def test_wrong_size(size):
    good = valid_raw(MsgType.BYE)
    data = (good * 3)[:size]
    with pytest.raises(ProtocolError):
        decode_header(data)


@pytest.mark.parametrize("magic", [b"SMDQ", b"\0\0\0\0", b"smdp", b"PMDS"])
def test_bad_magic(magic):
    with pytest.raises(ProtocolError, match="magic"):
        decode_header(valid_raw(MsgType.BYE, magic=magic))


@pytest.mark.parametrize("version", [0, 2, 255])
def test_wrong_version(version):
    with pytest.raises(ProtocolError, match="version"):
        decode_header(valid_raw(MsgType.BYE, version=version))


@pytest.mark.parametrize("mtype", sorted(set(range(256)) - {int(t) for t in MsgType}))
def test_unknown_type(mtype):
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode_header(raw(mtype=mtype))


@pytest.mark.parametrize(
    "t", [MsgType.BYE, MsgType.HELLO, MsgType.PARTIAL, MsgType.SUBMIT], ids=lambda t: t.name
)
@pytest.mark.parametrize("field,value", [("flags", 2), ("flags", 0x8000), ("reserved", 1), ("reserved", 255)])
def test_reserved_or_flags_set(t, field, value):
    with pytest.raises(ProtocolError, match="reserved"):
        decode_header(valid_raw(t, **{field: value}))


def test_only_submit_may_say_its_node_summed_on_the_gpus():
    """SUBMIT_NODE_SUMMED is SUBMIT's one flag: it round-trips there and is refused on any other."""
    h = decode_header(valid_raw(MsgType.SUBMIT, flags=SUBMIT_NODE_SUMMED))
    assert h.flags == SUBMIT_NODE_SUMMED and encode_header(h) == valid_raw(
        MsgType.SUBMIT, flags=SUBMIT_NODE_SUMMED
    )
    for t in (MsgType.DONE, MsgType.PARTIAL, MsgType.BYE):
        with pytest.raises(ProtocolError, match="reserved"):
            decode_header(valid_raw(t, flags=SUBMIT_NODE_SUMMED))


@pytest.mark.parametrize("t", FINGERPRINTED, ids=lambda t: t.name)
def test_fingerprinted_unknown_dtype_kind_op(t):
    for bad in (0, 8, 255):
        with pytest.raises(ProtocolError):
            decode_header(valid_raw(t, dtype=bad))
    for bad in (0, 6, 255):
        with pytest.raises(ProtocolError):
            decode_header(valid_raw(t, kind=bad))
    for bad in (5, 255):
        with pytest.raises(ProtocolError):
            decode_header(valid_raw(t, op=bad))
    # op 0 means "no op" (a gather); that is fine
    assert decode_header(valid_raw(t, op=0)).op is None


@pytest.mark.parametrize("t", [t for t in MsgType if t not in FINGERPRINTED], ids=lambda t: t.name)
@pytest.mark.parametrize("field", ["dtype", "op", "kind"])
def test_nonzero_dtype_op_kind_on_unfingerprinted(t, field):
    assert t not in FINGERPRINTED
    with pytest.raises(ProtocolError, match="must be zero"):
        decode_header(valid_raw(t, **{field: 1}))


@pytest.mark.parametrize("t", list(MsgType), ids=lambda t: t.name)
def test_payload_length_limit(t):
    limit = limit_of(t)
    assert decode_header(valid_raw(t, length=limit)).length == limit
    for bad in (limit + 1, 2**40, 2**64 - 1):
        with pytest.raises(ProtocolError, match="length"):
            decode_header(valid_raw(t, length=bad))


@pytest.mark.parametrize("field", ["seq", "offset", "count"])
def test_u64_fields_beyond_2_63(field):
    assert getattr(decode_header(valid_raw(MsgType.PARTIAL, **{field: U63})), field) == U63
    for bad in (2**63, 2**64 - 1):
        with pytest.raises(ProtocolError):
            decode_header(valid_raw(MsgType.PARTIAL, **{field: bad}))


FIELDS = ("magic", "version", "mtype", "flags", "dtype", "op", "kind", "reserved", "sender", "seq")
FIELDS += ("shard", "aux", "offset", "length", "count")


def _values(enum: type) -> set[int]:
    return {int(v) for v in enum}  # type: ignore[attr-defined]


@st.composite
def broken(draw) -> tuple[Header, str, bytes, str]:
    """A valid header, one of its fields set to a value no decoder may accept, the bytes, and the words
    the refusal must say."""
    h = draw(headers())
    t = h.type
    fp = t in FINGERPRINTED
    bad = {
        "magic": (st.binary(min_size=4, max_size=4).filter(lambda b: b != MAGIC), "bad magic"),
        "version": (st.integers(0, 255).filter(lambda v: v != VERSION), "protocol version"),
        "mtype": (st.integers(0, 255).filter(lambda v: v not in _values(MsgType)), "unknown message type"),
        "flags": (
            st.integers(1, 2**16 - 1).filter(lambda v: v & ~allowed_flags(t) != 0),
            "reserved bits set",
        ),
        "reserved": (st.integers(1, 255), "reserved bits set"),
        "seq": (st.integers(2**63, 2**64 - 1), r"beyond 2\*\*63"),
        "offset": (st.integers(2**63, 2**64 - 1), r"beyond 2\*\*63"),
        "count": (st.integers(2**63, 2**64 - 1), r"beyond 2\*\*63"),
        "length": (st.integers(limit_of(t) + 1, 2**64 - 1), "length"),
        "dtype": (st.integers(0, 255).filter(lambda v: v not in _values(DType)), "unknown dtype")
        if fp
        else (st.integers(1, 255), "must be zero"),
        "kind": (st.integers(0, 255).filter(lambda v: v not in _values(Kind)), "unknown dtype .* or kind")
        if fp
        else (st.integers(1, 255), "must be zero"),
        "op": (st.integers(1, 255).filter(lambda v: v not in _values(ReduceOp)), "unknown reduce op")
        if fp
        else (st.integers(1, 255), "must be zero"),
    }
    field = draw(st.sampled_from(sorted(bad)))
    values = list(LAYOUT.unpack(encode_header(h)))
    values[FIELDS.index(field)] = draw(bad[field][0])
    return h, field, LAYOUT.pack(*values), bad[field][1]


@settings(max_examples=600, deadline=None)
@given(broken())
def test_a_valid_header_with_any_one_field_broken_is_refused_by_name(case):
    """Every check is reached: the frame is valid but for one field (random bytes almost always stop at
    the magic), and the refusal names what is wrong with that field."""
    h, _field, data, words = case
    assert decode_header(encode_header(h)) == h  # the header itself is valid
    with pytest.raises(ProtocolError, match=words):
        decode_header(data)


def test_broken_headers_reach_every_check():
    """The generator breaks every field, of fingerprinted and other messages alike."""
    seen: set[tuple[str, bool]] = set()

    @settings(max_examples=600, deadline=None, database=None)
    @given(broken())
    def collect(case):
        seen.add((case[1], case[0].type in FINGERPRINTED))

    collect()
    expect = {"magic", "version", "mtype", "flags", "reserved", "seq", "offset", "count", "length"}
    expect |= {"dtype", "op", "kind"}
    assert {f for f, _ in seen} == expect and {fp for _, fp in seen} == {True, False}


@settings(max_examples=300, deadline=None)
@given(headers())
def test_every_valid_header_round_trips_through_bytes(h):
    data = encode_header(h)
    assert (
        len(data) == HEADER_SIZE and decode_header(data) == h and encode_header(decode_header(data)) == data
    )


# -- encode refuses what it must not send ------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("sender", -1),
        ("sender", 2**32),
        ("shard", -1),
        ("shard", 2**32),
        ("aux", -1),
        ("aux", 2**32),
        ("seq", -1),
        ("seq", 2**63),
        ("offset", -1),
        ("offset", 2**63),
        ("count", -1),
        ("count", 2**63),
        ("length", -1),
    ],
)
def test_encode_refuses_out_of_range(field, value):
    h = Header(MsgType.PARTIAL, dtype=DType.FLOAT32, kind=Kind.ALLREDUCE, op=ReduceOp.SUM, **{field: value})
    with pytest.raises(ProtocolError):
        encode_header(h)


@pytest.mark.parametrize("t", list(MsgType), ids=lambda t: t.name)
def test_encode_refuses_length_over_limit(t):
    kw = {"dtype": DType.UINT8, "kind": Kind.ALLGATHER} if t in FINGERPRINTED else {}
    encode_header(Header(t, length=limit_of(t), **kw))
    with pytest.raises(ProtocolError):
        encode_header(Header(t, length=limit_of(t) + 1, **kw))


@st.composite
def any_headers(draw) -> Header:
    """Headers whose dtype/op/kind/flags need not fit the message type."""
    t = draw(st.sampled_from(list(MsgType)))
    return Header(
        type=t,
        sender=draw(st.integers(0, 8)),
        length=draw(st.integers(0, 2)),
        dtype=draw(st.none() | st.sampled_from(list(DType))),
        op=draw(st.none() | st.sampled_from(list(ReduceOp))),
        kind=draw(st.none() | st.sampled_from(list(Kind))),
        flags=draw(st.sampled_from([0, 0, 1, 0x100])),
    )


@settings(max_examples=300, deadline=None)
@given(any_headers())
def test_encode_refuses_what_decode_refuses(h):
    """encode_header promises never to send a header the decoder would refuse, and to refuse nothing it
    would take: for any Header, encoding refuses exactly when decoding its fields' bytes does, and
    otherwise encodes exactly those bytes, which decode back to it."""
    fields = _pack_unchecked(h)
    try:
        decoded: Header | None = decode_header(fields)
    except ProtocolError:
        decoded = None
    if decoded is None:
        with pytest.raises(ProtocolError):
            encode_header(h)
    else:
        assert encode_header(h) == fields and decoded == h


@pytest.mark.parametrize(
    "h",
    [
        Header(MsgType.BYE, flags=1),
        Header(MsgType.HELLO, dtype=DType.FLOAT32),
        Header(MsgType.HEARTBEAT, kind=Kind.ALLREDUCE),
        Header(MsgType.PARTIAL),  # fingerprinted without dtype/kind
    ],
    ids=["flags", "dtype-on-control", "kind-on-empty", "fingerprint-missing"],
)
def test_encode_refuses_headers_decode_would_refuse(h):
    with pytest.raises(ProtocolError):
        decode_header(_pack_unchecked(h))
    with pytest.raises(ProtocolError):
        encode_header(h)


def _pack_unchecked(h: Header) -> bytes:
    return raw(
        mtype=int(h.type),
        flags=h.flags,
        dtype=int(h.dtype or 0),
        op=int(h.op or 0),
        kind=int(h.kind or 0),
        sender=h.sender,
        length=h.length,
    )


def test_error_frame():
    wire = error_frame("boom ü", sender=3)
    h = decode_header(wire[:HEADER_SIZE])
    assert h.type is MsgType.ERROR and h.sender == 3
    assert wire[HEADER_SIZE:] == "boom ü".encode()
    assert h.length == len("boom ü".encode())
    big = error_frame("x" * (MAX_CONTROL_PAYLOAD + 100))
    hb = decode_header(big[:HEADER_SIZE])
    assert hb.length == MAX_CONTROL_PAYLOAD == len(big) - HEADER_SIZE
