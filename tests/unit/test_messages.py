"""Typed messages encode to exactly the bytes the raw header did, and read back to the same values."""

from __future__ import annotations

import pytest

from smddp.errors import ProtocolError
from smddp.proto.dtypes import DType, Kind, ReduceOp
from smddp.proto.frames import Header, MsgType, decode_header
from smddp.proto.messages import (
    Attach,
    Bye,
    Channel,
    Done,
    Exited,
    Heartbeat,
    Release,
    Report,
    SegmentMsg,
    StatusRequest,
    Submit,
)

F = {"count": 1000, "dtype": DType.BFLOAT16, "op": ReduceOp.MAX, "kind": Kind.ALLREDUCE}

# (typed message, the header spelled field by field as the wire format has it)
CASES = [
    (Attach(3, segment=7, size=1 << 26), Header(MsgType.ATTACH, sender=3, shard=7, offset=1 << 26)),
    (SegmentMsg(1, segment=2, size=1 << 28), Header(MsgType.SEGMENT, sender=1, shard=2, offset=1 << 28)),
    (Channel(4, segment=0, size=33280), Header(MsgType.CHANNEL, sender=4, shard=0, offset=33280)),
    (
        Submit(5, 9, segment=4, offset=4096, root=2, **F),
        Header(MsgType.SUBMIT, sender=5, seq=9, shard=4, offset=4096, aux=2, **F),
    ),
    (
        Done(1, 9, segment=0, offset=8192, root=2, **F),
        Header(MsgType.DONE, sender=1, seq=9, shard=0, offset=8192, aux=2, **F),
    ),
    (Release(5, 9), Header(MsgType.RELEASE, sender=5, seq=9)),
    (Exited(6, status=3), Header(MsgType.EXITED, sender=6, aux=3)),
    (Exited(6, status=143, torn_down=True), Header(MsgType.EXITED, sender=6, seq=1, aux=143)),
    (StatusRequest(2, request=11), Header(MsgType.STATUS, sender=2, seq=11)),
    (Report(2, request=11, length=300), Header(MsgType.REPORT, sender=2, seq=11, length=300)),
    (Heartbeat(4), Header(MsgType.HEARTBEAT, sender=4)),
    (Bye(4), Header(MsgType.BYE, sender=4)),
]


@pytest.mark.parametrize(("msg", "raw"), CASES, ids=lambda x: type(x).__name__)
def test_same_bytes_and_back(msg, raw):
    wire = msg.header().encode()
    assert wire == raw.encode()
    of = getattr(type(msg), "of", None)
    if of is not None:
        assert of(decode_header(wire)) == msg


def test_exited_refuses_what_it_does_not_define():
    with pytest.raises(ProtocolError, match="seq 0 or 1"):
        Exited.of(Header(MsgType.EXITED, sender=6, seq=2, aux=3))
    with pytest.raises(ProtocolError, match="aux 0-255"):
        Exited.of(Header(MsgType.EXITED, sender=6, aux=256))


def test_a_message_refuses_another_types_header():
    with pytest.raises(TypeError, match="SUBMIT"):
        Attach.of(Submit(0, 0, 0, 0, 0, **F).header())
