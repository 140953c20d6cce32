"""Sealed memfd segments and the first-fit arena over them."""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import random

import numpy as np
import pytest

from smddp.errors import ProtocolError
from smddp.transport.shm import ALIGN, Arena, Segment, Slot


@pytest.fixture
def arena():
    a = Arena(segment_bytes=64 * 1024, name="smddp-unit-test")
    yield a
    a.close()


def fd_closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_alignment_is_a_cache_line():
    assert ALIGN == 64


def test_segment_create_is_sealed_and_zeroed():
    seg = Segment.create(3, 10000, "smddp-unit-test")
    try:
        assert seg.id == 3 and seg.size == 10000
        assert os.fstat(seg.fd).st_size >= 10000
        seals = fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        assert seg.array.shape == (10000,) and seg.array.dtype == np.uint8
        assert not seg.array.any()
        with pytest.raises(OSError):
            os.ftruncate(seg.fd, 10)  # sealed against shrinking
    finally:
        seg.close()


def test_segment_attach_shares_memory():
    seg = Segment.create(0, 8192, "smddp-unit-test")
    peer = Segment.attach(0, os.dup(seg.fd), 8192, writable=True)
    ro = Segment.attach(0, os.dup(seg.fd), 4096, writable=False)
    try:
        seg.view(100, 4)[:] = [1, 2, 3, 4]
        assert peer.view(100, 4).tolist() == [1, 2, 3, 4]
        peer.view(8000, 2)[:] = 9
        assert seg.array[8000:8002].tolist() == [9, 9]
        assert ro.view(100, 4).tolist() == [1, 2, 3, 4]
        assert not ro.view(0, 10).flags.writeable
        with pytest.raises(ValueError):
            ro.view(0, 1)[0] = 1
    finally:
        ro.close()
        peer.close()
        seg.close()


def test_attach_refuses_an_unsealed_memfd():
    fd = os.memfd_create("smddp-unit-unsealed", os.MFD_CLOEXEC)  # no MFD_ALLOW_SEALING: no seals
    os.ftruncate(fd, 4096)
    with pytest.raises(ProtocolError, match="sealed"):
        Segment.attach(1, fd, 4096, writable=True)
    assert fd_closed(fd), "a refused fd must be closed, not leaked"


def test_attach_refuses_a_sealable_memfd_without_seals():
    fd = os.memfd_create("smddp-unit-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)  # grow-sealed only: it could still shrink
    with pytest.raises(ProtocolError):
        Segment.attach(1, fd, 4096, writable=True)
    assert fd_closed(fd)


def test_attach_refuses_a_segment_smaller_than_claimed():
    seg = Segment.create(0, 4096, "smddp-unit-test")
    try:
        fd = os.dup(seg.fd)
        with pytest.raises(ProtocolError, match="smaller"):
            Segment.attach(0, fd, 4096 * 4, writable=True)
        assert fd_closed(fd)
    finally:
        seg.close()


def test_attach_refuses_what_is_not_a_memfd():
    r, w = os.pipe()
    try:
        with pytest.raises(ProtocolError):
            Segment.attach(0, r, 16, writable=False)
        assert fd_closed(r)
    finally:
        os.close(w)


def test_segment_view_bounds():
    seg = Segment.create(7, 1000, "smddp-unit-test")
    try:
        assert seg.view(0, 1000).shape == (1000,)
        assert seg.view(999, 1).shape == (1,)
        assert seg.view(1000, 0).shape == (0,)
        for off, n in [(-1, 1), (0, 1001), (1, 1000), (1000, 1), (2**40, 8), (-64, 64)]:
            with pytest.raises(ProtocolError):
                seg.view(off, n)
    finally:
        seg.close()


def test_arena_first_alloc_creates_a_segment(arena):
    slot, seg = arena.alloc(100)
    assert seg is not None and seg.id == slot.segment == 0
    assert slot.offset == 0 and slot.nbytes == 100
    assert seg.size == 64 * 1024
    assert arena.segments == {0: seg}
    assert arena.view(slot).shape == (100,)
    assert arena.in_use == 128  # rounded up to the alignment


def test_arena_alignment_and_disjoint_slots(arena):
    slots = []
    for n in [1, 63, 64, 65, 100, 0, 4096, 7]:
        slot, _ = arena.alloc(n)
        assert slot.offset % ALIGN == 0
        assert slot.nbytes == n
        slots.append(slot)
    for i, s in enumerate(slots):
        arena.view(s)[:] = i + 1
    for i, s in enumerate(slots):
        assert (arena.view(s) == i + 1).all(), f"slot {s} was overwritten by a neighbour"
    ranges = sorted((s.offset, s.offset + max(s.nbytes, 1)) for s in slots)
    for (_, e), (b, _) in itertools.pairwise(ranges):
        assert e <= b


def test_arena_grows_a_new_segment_when_full(arena):
    _, seg_a = arena.alloc(40 * 1024)
    b, seg_b = arena.alloc(40 * 1024)  # does not fit in what is left of segment 0
    assert seg_a is not None and seg_b is not None
    assert b.segment == 1 and b.offset == 0 and seg_b.id == 1
    c, seg_c = arena.alloc(20 * 1024)  # fits in the rest of segment 0
    assert seg_c is None and c.segment == 0 and c.offset == 40 * 1024
    big, seg_big = arena.alloc(1_000_000)  # larger than a segment: a segment of its own, page-rounded
    assert seg_big is not None and big.offset == 0
    assert seg_big.size >= 1_000_000 and seg_big.size % mmap.PAGESIZE == 0
    assert arena.view(big).shape == (1_000_000,)


def test_arena_coalesces_freed_neighbours(arena):
    total = 64 * 1024
    slots = [arena.alloc(total // 4)[0] for _ in range(4)]
    assert {s.segment for s in slots} == {0}
    assert arena.in_use == total
    # free out of order: middle ones first, then the ends
    for i in (1, 2, 0, 3):
        arena.free(slots[i])
    assert arena.in_use == 0
    whole, new = arena.alloc(total)
    assert new is None, "the freed quarters were not merged back into one range"
    assert whole == Slot(0, 0, total)


def test_arena_reuses_a_freed_hole(arena):
    a, _ = arena.alloc(1000)
    b, _ = arena.alloc(1000)
    arena.free(a)
    c, new = arena.alloc(960)
    assert new is None and c.segment == 0 and c.offset == a.offset
    assert b.offset == 1024


def test_arena_random_alloc_free():
    rnd = random.Random(1)
    arena = Arena(segment_bytes=32 * 1024, name="smddp-unit-test")
    try:
        live: dict[Slot, int] = {}
        for step in range(1500):
            if live and rnd.random() < 0.45:
                slot = rnd.choice(list(live))
                assert (arena.view(slot) == live.pop(slot)).all()
                arena.free(slot)
            else:
                slot, _ = arena.alloc(rnd.choice([0, 1, 64, 100, 1000, 5000, 20000]))
                assert slot.offset % ALIGN == 0
                assert slot.offset + slot.nbytes <= arena.segments[slot.segment].size
                mark = step % 251 + 1
                arena.view(slot)[:] = mark
                live[slot] = mark
            expect = sum(-(-max(s.nbytes, 1) // ALIGN) * ALIGN for s in live)
            assert arena.in_use == expect
        for slot, mark in live.items():
            assert (arena.view(slot) == mark).all()
        for slot in list(live):
            arena.free(slot)
        nseg = len(arena.segments)
        # everything coalesced again: every segment can hand out its whole size without growing
        for seg_id, seg in list(arena.segments.items()):
            slot, new = arena.alloc(seg.size)
            assert new is None and slot.offset == 0, (seg_id, slot)
        assert len(arena.segments) == nseg
    finally:
        arena.close()


def test_arena_close_releases_fds():
    arena = Arena(segment_bytes=4096, name="smddp-unit-test")
    fds = [arena.alloc(4096)[1].fd for _ in range(3)]
    arena.close()
    assert all(fd_closed(fd) for fd in fds)
    assert arena.segments == {}
