"""Anonymous shared memory: sealed memfd segments passed as fds, and a first-fit arena over them."""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

from smddp.errors import ProtocolError

ALIGN = 64  # a cache line: keeps every slot aligned for SIMD loads and away from its neighbours' lines
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Segment:
    """One memfd mapping. Nothing is named in /dev/shm: the memory lives as long as an fd or mapping."""

    def __init__(self, seg_id: int, fd: int, size: int, writable: bool) -> None:
        self.id = seg_id
        self.fd = fd
        self.size = size
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        # A zero-length mapping is not allowed; an empty segment maps one page it never uses.
        self._map = mmap.mmap(fd, max(size, 1), mmap.MAP_SHARED, prot)
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=size)
        if not writable:
            self.array.flags.writeable = False

    @classmethod
    def create(cls, seg_id: int, size: int, name: str = "smddp") -> Segment:
        """A new sealed segment of `size` bytes (pages are allocated only when touched)."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, max(size, 1))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            return cls(seg_id, fd, size, writable=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, seg_id: int, fd: int, size: int, writable: bool) -> Segment:
        """Map a segment received from a peer, after checking it cannot shrink under us (SIGBUS)."""
        try:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            os.close(fd)
            raise ProtocolError(f"segment {seg_id}: fd is not a sealed memfd ({e})") from None
        if seals & fcntl.F_SEAL_SHRINK == 0 or st.st_size < size:
            os.close(fd)
            raise ProtocolError(
                f"segment {seg_id}: not sealed against shrinking or smaller than {size} bytes"
            )
        return cls(seg_id, fd, size, writable)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if not (offset >= 0 and nbytes >= 0 and offset + nbytes <= self.size):
            raise ProtocolError(
                f"segment {self.id}: range [{offset}, +{nbytes}) outside its {self.size} bytes"
            )
        return self.array[offset : offset + nbytes]

    def close(self) -> None:
        del self.array
        try:
            self._map.close()
        except BufferError:
            # A numpy view still points here; the mapping goes when the last view does.
            pass
        os.close(self.fd)


@dataclass(frozen=True)
class Slot:
    """A range handed out by an Arena."""

    segment: int
    offset: int
    nbytes: int


class Arena:
    """First-fit allocator over growing segments, thread-safe; one per owner of shared memory."""

    def __init__(self, segment_bytes: int, name: str) -> None:
        self.segment_bytes = segment_bytes
        self.name = name
        self.segments: dict[int, Segment] = {}
        self._free: dict[int, list[tuple[int, int]]] = {}  # segment -> sorted (offset, size)
        self._lock = threading.Lock()
        self._next_id = 0
        self._live: dict[tuple[int, int], int] = {}  # (segment, offset) -> bytes, to catch double frees
        self.in_use = 0

    def alloc(self, nbytes: int) -> tuple[Slot, Segment | None]:
        """A slot of `nbytes`; the second value is a newly created segment the peers must be told of."""
        size = _round_up(max(nbytes, 1), ALIGN)
        with self._lock:
            for seg_id, free in self._free.items():
                for i, (off, avail) in enumerate(free):
                    if avail >= size:
                        if avail == size:
                            free.pop(i)
                        else:
                            free[i] = (off + size, avail - size)
                        self.in_use += size
                        self._live[(seg_id, off)] = size
                        return Slot(seg_id, off, nbytes), None
            seg_size = max(self.segment_bytes, _round_up(size, mmap.PAGESIZE))
            seg = Segment.create(self._next_id, seg_size, self.name)
            self._next_id += 1
            self.segments[seg.id] = seg
            self._free[seg.id] = [(size, seg_size - size)] if seg_size > size else []
            self.in_use += size
            self._live[(seg.id, 0)] = size
            return Slot(seg.id, 0, nbytes), seg

    def free(self, slot: Slot) -> None:
        size = _round_up(max(slot.nbytes, 1), ALIGN)
        with self._lock:
            if self._live.pop((slot.segment, slot.offset), None) != size:
                raise ValueError(f"{self.name}: slot {slot} is not allocated (double free?)")
            free = self._free[slot.segment]
            self.in_use -= size
            # insert keeping order, then merge with neighbours
            lo = 0
            while lo < len(free) and free[lo][0] < slot.offset:
                lo += 1
            free.insert(lo, (slot.offset, size))
            if lo + 1 < len(free) and free[lo][0] + free[lo][1] == free[lo + 1][0]:
                free[lo] = (free[lo][0], free[lo][1] + free[lo + 1][1])
                free.pop(lo + 1)
            if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == free[lo][0]:
                free[lo - 1] = (free[lo - 1][0], free[lo - 1][1] + free[lo][1])
                free.pop(lo)

    def view(self, slot: Slot) -> np.ndarray:
        return self.segments[slot.segment].view(slot.offset, slot.nbytes)

    def close(self) -> None:
        with self._lock:
            for seg in self.segments.values():
                seg.close()
            self.segments.clear()
            self._free.clear()
            self._live.clear()


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k
