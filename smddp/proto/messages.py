"""Typed messages: each frame's header fields under the names they mean, encoding to the same 56 bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeVar

from smddp.errors import ProtocolError
from smddp.proto.dtypes import DType, Kind, ReduceOp
from smddp.proto.frames import Header, MsgType

# A SUBMIT or DONE names the arena segment of its buffer in the header field `shard`, the byte
# offset in that segment in `offset`, the root rank (or node) in `aux`. ATTACH and SEGMENT name
# a segment in `shard` and its size in `offset`. Data frames (daemon to daemon) are the engine's
# alone (smddp/engine/frame.cc): they use `shard`, `offset` and `aux` as what they are called, the
# shard, the byte offset in it, the root. docs/protocol.md has the table.


def _check(h: Header, t: MsgType) -> None:
    if h.type is not t:
        raise TypeError(f"a {h.type.name} header is not {t.name}")


@dataclass(frozen=True, slots=True)
class _SegmentNotice:
    """A memfd passed with this frame is segment `segment` of `size` bytes."""

    TYPE: ClassVar[MsgType]
    sender: int
    segment: int
    size: int

    def header(self) -> Header:
        return Header(self.TYPE, sender=self.sender, shard=self.segment, offset=self.size)

    @classmethod
    def of(cls: type[_SN], h: Header) -> _SN:
        _check(h, cls.TYPE)
        return cls(h.sender, h.shard, h.offset)


_SN = TypeVar("_SN", bound=_SegmentNotice)


class Attach(_SegmentNotice):
    """worker (rank `sender`) -> daemon: the memfd passed with this frame is input segment `segment`."""

    TYPE = MsgType.ATTACH


class Channel(_SegmentNotice):
    """worker (rank `sender`) -> daemon: the memfd passed with this frame is the worker's channel (the
    engine data plane's submit and done rings, smddp/engine/local_plane.h); `segment` is 0."""

    TYPE = MsgType.CHANNEL


class SegmentMsg(_SegmentNotice):
    """daemon (node `sender`) -> worker: the memfd passed with this frame is result segment `segment`."""

    TYPE = MsgType.SEGMENT


@dataclass(frozen=True, slots=True)
class _CollectiveNotice:
    """Collective `seq`, its fingerprint, and its buffer: `segment` at byte `offset`."""

    TYPE: ClassVar[MsgType]
    sender: int
    seq: int
    segment: int
    offset: int
    root: int
    count: int
    dtype: DType
    op: ReduceOp | None
    kind: Kind

    def header(self) -> Header:
        return Header(
            self.TYPE,
            sender=self.sender,
            seq=self.seq,
            shard=self.segment,
            offset=self.offset,
            aux=self.root,
            count=self.count,
            dtype=self.dtype,
            op=self.op,
            kind=self.kind,
        )

    @classmethod
    def of(cls: type[_CN], h: Header) -> _CN:
        _check(h, cls.TYPE)
        assert h.dtype is not None and h.kind is not None  # decode_header checked them
        return cls(h.sender, h.seq, h.shard, h.offset, h.aux, h.count, h.dtype, h.op, h.kind)


_CN = TypeVar("_CN", bound=_CollectiveNotice)


class Submit(_CollectiveNotice):
    """worker (rank `sender`) -> daemon: collective `seq`; its input is `segment` at `offset`
    (NO_SEGMENT: this rank sends no data)."""

    TYPE = MsgType.SUBMIT


class Done(_CollectiveNotice):
    """daemon (node `sender`) -> worker: collective `seq` is complete; its result is in result
    segment `segment` at `offset`."""

    TYPE = MsgType.DONE


@dataclass(frozen=True, slots=True)
class Release:
    """worker -> daemon: the result slot of collective `seq` may be reused."""

    sender: int
    seq: int

    def header(self) -> Header:
        return Header(MsgType.RELEASE, sender=self.sender, seq=self.seq)


@dataclass(frozen=True, slots=True)
class Exited:
    """launcher wrapper -> daemon: rank `rank`'s process ended with `status` without joining the job,
    or after joining it with a non-zero status. `torn_down`: the wrapper was told to end (SIGTERM,
    SIGINT or SIGHUP: mpirun or the scheduler tearing the job down), so this end is a consequence of
    another, not a cause (`seq` 1; 0 otherwise)."""

    rank: int
    status: int  # 0-255
    torn_down: bool = False

    def header(self) -> Header:
        return Header(MsgType.EXITED, sender=self.rank, seq=int(self.torn_down), aux=self.status)

    @classmethod
    def of(cls, h: Header) -> Exited:
        _check(h, MsgType.EXITED)
        if h.seq not in (0, 1) or h.aux > 255:
            raise ProtocolError(f"EXITED with seq {h.seq} and aux {h.aux} (seq 0 or 1, aux 0-255)")
        return cls(h.sender, h.aux, bool(h.seq))


@dataclass(frozen=True, slots=True)
class StatusRequest:
    """control client or daemon -> daemon: report; `request` numbers the question (echoed in REPORT)."""

    sender: int = 0
    request: int = 0

    def header(self) -> Header:
        return Header(MsgType.STATUS, sender=self.sender, seq=self.request)


@dataclass(frozen=True, slots=True)
class Report:
    """daemon -> asker: the answer to STATUS `request`, `length` bytes of JSON after the header."""

    sender: int
    request: int
    length: int

    def header(self) -> Header:
        return Header(MsgType.REPORT, sender=self.sender, seq=self.request, length=self.length)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """daemon -> daemon, daemon -> worker: still here."""

    sender: int

    def header(self) -> Header:
        return Header(MsgType.HEARTBEAT, sender=self.sender)


@dataclass(frozen=True, slots=True)
class Bye:
    """any direction: this side is done and will close."""

    sender: int = 0

    def header(self) -> Header:
        return Header(MsgType.BYE, sender=self.sender)
