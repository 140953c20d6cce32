"""Anonymous shared memory: sealed memfd segments passed as fds, and a first-fit arena over them."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from smddp import _engine

if TYPE_CHECKING:
    import numpy as np

ALIGN = _engine.SLOT_ALIGN  # a cache line: slots aligned for SIMD loads, away from their neighbours' lines


class Segment:
    """One memfd mapping, owned by the engine (smddp/engine/arena.h). Nothing is named in /dev/shm: the
    memory lives as long as an fd or a mapping; `array` (and every view of it) keeps the mapping."""

    def __init__(self, native: _engine.Segment) -> None:
        self._native = native
        self.id = native.id
        self.size = native.size
        self._array: np.ndarray | None = None
        self._closed = False

    @property
    def array(self) -> np.ndarray:
        """The engine's buffer, the whole mapping (read-only where the segment is), as bytes. Made on
        first use: the daemon, which never reads a segment in Python, then never imports numpy."""
        a = self._array
        if a is None:
            if self._closed:
                raise AttributeError(f"segment {self.id} is closed")
            import numpy as np

            a = self._array = np.frombuffer(memoryview(self._native), dtype=np.uint8, count=self.size)
        return a

    @property
    def fd(self) -> int:
        return self._native.fd

    @property
    def native(self) -> _engine.Segment:
        """The engine's segment, for the engine's own users of it (the data plane)."""
        return self._native

    @classmethod
    def create(cls, seg_id: int, size: int, name: str = "smddp") -> Segment:
        """A new sealed segment of `size` bytes (pages are allocated only when touched)."""
        return cls(_engine.segment_create(seg_id, size, name))

    @classmethod
    def attach(cls, seg_id: int, fd: int, size: int, writable: bool) -> Segment:
        """Map a segment received from a peer, after checking it cannot shrink under us (SIGBUS);
        takes `fd` over (closed on a refusal too)."""
        return cls(_engine.segment_attach(seg_id, fd, size, writable))

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        self._native.check(offset, nbytes)  # ProtocolError naming the segment and the range
        return self.array[offset : offset + nbytes]

    def close(self) -> None:
        """The fd goes now; the mapping when the last view of it does."""
        self._array, self._closed = None, True
        self._native.close_fd()


#: A range handed out by an Arena: the engine's record (segment, offset, nbytes; frozen, hashable),
#: the one type for a slot on both sides of the binding.
Slot = _engine.Slot


class Arena:
    """First fit over growing segments, thread-safe; one per owner of shared memory (the engine's
    Arena, smddp/engine/arena.h: slots of ALIGN bytes, double frees refused)."""

    def __init__(self, segment_bytes: int, name: str) -> None:
        self.segment_bytes = segment_bytes
        self.name = name
        self._native = _engine.Arena(name, segment_bytes)
        self.segments: dict[int, Segment] = {}
        # Held across the engine's alloc and the new segment's entry here, so that no thread sees a
        # slot in a segment this dict does not have yet.
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return self._native.in_use

    def alloc(self, nbytes: int) -> tuple[Slot, Segment | None]:
        """A slot of `nbytes`; the second value is a newly created segment the peers must be told of."""
        with self._lock:
            got = self._native.alloc(nbytes)
            seg = None
            if got.fresh is not None:
                seg = self.segments[got.segment] = Segment(got.fresh)
        return Slot(got.segment, got.offset, nbytes), seg

    @property
    def native(self) -> _engine.Arena:
        """The engine's arena, for the engine's own users of it (the data plane allocates from it)."""
        return self._native

    def adopt(self, native: _engine.Segment) -> Segment:
        """The Segment for one the engine made in this arena (the data plane's alloc), entered once."""
        with self._lock:
            seg = self.segments.get(native.id)
            if seg is None:
                seg = self.segments[native.id] = Segment(native)
            return seg

    def segment(self, seg_id: int) -> Segment:
        """Segment `seg_id`, entered here on first use when the engine made it (the worker channel's
        alloc and start take slots from the engine's arena directly); KeyError if it has none."""
        seg = self.segments.get(seg_id)
        if seg is None:
            native = self._native.segment(seg_id)
            if native is None:
                raise KeyError(seg_id)
            seg = self.adopt(native)
        return seg

    def free(self, slot: Slot) -> None:
        """Give a slot back; ValueError unless it is exactly a live slot (a double free)."""
        self._native.free(slot.segment, slot.offset, slot.nbytes)

    def view(self, slot: Slot) -> np.ndarray:
        return self.segment(slot.segment).view(slot.offset, slot.nbytes)

    def close(self) -> None:
        with self._lock:
            self._native.close()
            for seg in self.segments.values():
                seg.close()
            self.segments.clear()
