"""The engine's wire codes (smddp/engine/wire.h) are what smddp/proto generates, and the engine built from them agrees."""

from __future__ import annotations

import os

import pytest
from smddp_rigs import wire_header

from smddp import _engine
from smddp.errors import ProtocolError
from smddp.proto.dtypes import DType, Kind, ReduceOp
from smddp.proto.frames import (
    FINGERPRINTED,
    HEADER_OFFSETS,
    HEADER_SIZE,
    Header,
    MsgType,
    encode_header,
    payload_limit,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_committed_header_is_what_proto_generates() -> None:
    with open(os.path.join(ROOT, wire_header.PATH)) as f:
        committed = f.read()
    assert committed == wire_header.render(), "smddp/engine/wire.h is stale: run `make wire-header`"


def test_a_changed_spec_changes_the_header(monkeypatch: pytest.MonkeyPatch) -> None:
    """The generator reads the spec, not a copy of it: another limit gives another header."""
    before = wire_header.render()
    monkeypatch.setattr(wire_header, "MAX_CONTROL_PAYLOAD", 1234)
    after = wire_header.render()
    assert "kMaxControlPayload = 1234;" in after and after != before


@pytest.mark.parametrize("t", list(MsgType), ids=lambda t: t.name)
def test_the_engine_takes_every_message_at_its_limit_and_refuses_one_byte_more(t: MsgType) -> None:
    """The built engine's limits and fingerprint rules, per message type, are the spec's."""
    extra = {"dtype": DType.FLOAT16, "kind": Kind.ALLREDUCE, "op": ReduceOp.AVG} if t in FINGERPRINTED else {}
    limit = payload_limit(t)
    wire = encode_header(Header(t, length=limit, **extra))  # type: ignore[arg-type]
    assert len(wire) == HEADER_SIZE
    assert _engine.decode_header(wire)[0] == int(t)
    over = bytearray(wire)
    at = HEADER_OFFSETS["length"]
    over[at : at + 8] = (limit + 1).to_bytes(8, "little")
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        _engine.decode_header(bytes(over))


def test_the_engine_names_every_dtype_op_and_kind_as_proto_does() -> None:
    """Codes outside the spec are refused by both codecs; every code inside it is taken by both."""
    for code in range(256):
        wire = bytearray(encode_header(Header(MsgType.DONE, dtype=DType.UINT8, kind=Kind.BARRIER)))
        wire[HEADER_OFFSETS["dtype"]] = code
        known = code in {int(d) for d in DType}
        if known:
            assert _engine.decode_header(bytes(wire))[2] == code
        else:
            with pytest.raises(ProtocolError, match="unknown dtype"):
                _engine.decode_header(bytes(wire))
        wire[HEADER_OFFSETS["dtype"]] = int(DType.UINT8)
        wire[HEADER_OFFSETS["kind"]] = code
        if code in {int(k) for k in Kind}:
            assert _engine.decode_header(bytes(wire))[4] == code
        else:
            with pytest.raises(ProtocolError, match="unknown dtype"):
                _engine.decode_header(bytes(wire))
