"""The daemons' bootstrap relayed through a store (torchrun's path), without processes: daemons and workers as threads over real socket pairs and torch's HashStore."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from smddp.errors import BootstrapCancelled, BootstrapError
from smddp.launcher.elastic import EarlyDaemon, ElasticPlace, agree_job, place_ranks, rank_record
from smddp.transport.bootstrap import Membership, bootstrap_daemons, job_secret, read_secret_file
from smddp.transport.relay import LineConn, RelayComm, StoreRelay
from tests.conftest import need_module

torch = need_module("torch", "pip install -e '.[torch]'")
dist = torch.distributed

JOB = "0123456789abcdef0123456789abcdef"


def _run(n: int, secrets_: list[bytes | None] | None = None, sabotage: Any = None, timeout: float = 10.0):
    """n daemons (threads) bootstrapping through n relays (threads) over one store.

    Returns (what each daemon got: a Membership or its BootstrapError, what each relay raised or None)."""
    store = dist.HashStore()
    daemons: list[Any] = [None] * n
    relays: list[Any] = [None] * n
    threads = []
    for node in range(n):
        mine, theirs = socket.socketpair()

        def daemon(node: int = node, fd: int = theirs.detach()) -> None:
            try:
                comm = RelayComm(fd, timeout)
                if sabotage is not None and sabotage[0] == node:
                    sabotage[1](comm)
                    return
                user = secrets_[node] if secrets_ else None
                daemons[node] = bootstrap_daemons(
                    comm, lambda nd, _job, _one: ("127.0.0.1", 5000 + nd, f"/s{nd}"), 2, JOB, user
                )
            except BootstrapError as e:
                daemons[node] = e

        def relay(node: int = node, sock: socket.socket = mine) -> None:
            r = StoreRelay(store, "boot/", node, n, timeout)
            try:
                r.serve(LineConn(sock, f"daemon {node}"), lambda: "exited")
            except BootstrapError as e:
                relays[node] = e
            finally:
                sock.close()

        threads += [threading.Thread(target=daemon), threading.Thread(target=relay)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    return daemons, relays


def test_three_daemons_agree_on_one_job() -> None:
    daemons, relays = _run(3)
    assert relays == [None] * 3
    assert all(isinstance(d, Membership) for d in daemons)
    jobs = [d.job for d in daemons]
    assert [d.node for d in daemons] == [0, 1, 2]
    assert jobs[0].job_hex == JOB and len(jobs[0].secret) == 32
    assert all(j == jobs[0] and j.secret == jobs[0].secret for j in jobs)
    assert [(e.tcp_port, e.socket_path) for e in jobs[0].daemons] == [
        (5000, "/s0"),
        (5001, "/s1"),
        (5002, "/s2"),
    ]
    assert jobs[0].size == 6


def test_a_secret_file_is_derived_per_job_and_never_sent() -> None:
    key = os.urandom(40)
    daemons, _ = _run(2, [key, key])
    assert all(isinstance(d, Membership) for d in daemons)
    assert daemons[0].job.secret == daemons[1].job.secret == job_secret(key, bytes.fromhex(JOB))
    assert job_secret(key, bytes(16)) != job_secret(key, bytes.fromhex(JOB))


@pytest.mark.parametrize("which", ["different", "missing"])
def test_secret_files_that_differ_fail_every_daemon(which: str) -> None:
    secrets_: list[bytes | None] = [os.urandom(32), os.urandom(32) if which == "different" else None]
    daemons, relays = _run(2, secrets_)
    why = (
        "secret differs between node 0 and node(s) 1"
        if which == "different"
        else "node 1 has no --secret-file but node 0 has one"
    )
    # Every daemon refuses the job with the same cause, and each tells the worker relaying for it.
    for d, r in zip(daemons, relays, strict=True):
        assert isinstance(d, BootstrapError) and why in str(d), d
        assert isinstance(r, BootstrapError) and why in str(r), r


def test_a_daemon_that_dies_fails_every_node_with_its_cause() -> None:
    def die(comm: RelayComm) -> None:
        comm.allgather([socket.gethostname(), 1])
        comm._conn.close()  # gone after the first collective, as a crashed daemon

    daemons, relays = _run(3, sabotage=(1, die))
    for node in (0, 2):
        assert isinstance(daemons[node], BootstrapError)
        assert "the smddp-daemon of node 1 exited during the bootstrap" in str(daemons[node])
        assert "the smddp-daemon of node 1 exited during the bootstrap" in str(relays[node])
    assert "the smddp-daemon of node 1 exited during the bootstrap" in str(relays[1])


def test_a_daemon_asking_nonsense_is_named() -> None:
    def garbage(comm: RelayComm) -> None:
        comm._conn.sock.sendall(b"not json\n")

    daemons, relays = _run(2, sabotage=(0, garbage))
    assert "sent something that is not JSON" in str(relays[0])
    assert isinstance(daemons[1], BootstrapError) and "node 0" in str(daemons[1])


def test_garbage_in_the_store_is_refused_by_name() -> None:
    store = dist.HashStore()
    store.set("boot/0/1", b"\x00garbage")
    store.set("boot/0/0", b'{"v": 1}')
    r = StoreRelay(store, "boot/", 0, 2, 2.0)
    with pytest.raises(BootstrapError, match="malformed bootstrap value for node 1"):
        r._get("boot/0/1", "node 1")


def test_a_node_that_never_comes_is_bounded() -> None:
    store = dist.HashStore()
    r = StoreRelay(store, "boot/", 0, 2, 0.5)
    with pytest.raises(BootstrapError, match=r"node 1 did not take part in the smddp bootstrap within 0\.5s"):
        r._get("boot/0/1", "node 1")


def test_secret_file_checks(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_bytes(os.urandom(32))
    f.chmod(0o600)
    assert len(read_secret_file(str(f))) == 32
    f.chmod(0o640)
    with pytest.raises(BootstrapError, match="only its owner can read"):
        read_secret_file(str(f))
    f.chmod(0o600)
    f.write_bytes(b"short")
    with pytest.raises(BootstrapError, match="holds 5 bytes; at least 32"):
        read_secret_file(str(f))
    with pytest.raises(BootstrapError, match="cannot read the secret file"):
        read_secret_file(str(tmp_path / "none"))
    # A link is followed (Kubernetes mounts a Secret's files as links); the file it reaches is checked.
    f.write_bytes(os.urandom(32))
    (tmp_path / "link").symlink_to(f)
    assert read_secret_file(str(tmp_path / "link")) == f.read_bytes()
    f.chmod(0o644)
    with pytest.raises(BootstrapError, match="only its owner can read"):
        read_secret_file(str(tmp_path / "link"))


def _env(**kw: str) -> dict[str, str]:
    return {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", **kw}


def test_elastic_place_from_torchrun_variables() -> None:
    p = ElasticPlace.from_env({**_env(), "TORCHELASTIC_RESTART_COUNT": "3"}, 3, 4)
    assert (p.node, p.nnodes, p.local_rank, p.local_size, p.restart_count) == (1, 2, 1, 2, 3)
    assert p.worker_env("ab")["SMDDP_RANK"] == "3" and p.worker_env("ab")["SMDDP_NNODES"] == "2"
    # Without GROUP_RANK (an env:// launcher that is not torchrun): the node from the rank.
    assert ElasticPlace.from_env({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, 2, 4).node == 1


@pytest.mark.parametrize(
    ("env", "rank", "size", "match"),
    [
        ({"LOCAL_RANK": "0"}, 0, 2, "LOCAL_WORLD_SIZE not set"),
        (_env(LOCAL_WORLD_SIZE="3"), 3, 4, "the same number of workers on every node"),
        (_env(GROUP_RANK="0"), 3, 4, "ranks contiguous per node"),
        (_env(LOCAL_RANK="x"), 3, 4, "malformed torch launcher variable"),
    ],
)
def test_elastic_place_refuses_what_smddp_cannot_run(
    env: dict[str, str], rank: int, size: int, match: str
) -> None:
    with pytest.raises(BootstrapError, match=match):
        ElasticPlace.from_env(env, rank, size)


def _record(host: str = "h0", world: int = 2, **env: str) -> dict[str, Any]:
    return {"world": world, "host": host, "hostname": host, "pid": 1, "env": env}


def _agree(
    store: Any, size: int, delays: list[float], records: list[Any] | None = None, timeout: float = 10.0
) -> list[Any]:
    """agree_job on `size` threads, each after its delay: each rank's job id (or its BootstrapError)."""
    got: list[Any] = [None] * size
    places: list[Any] = [None] * size

    def rank(r: int) -> None:
        time.sleep(delays[r])
        record = records[r] if records else _record(world=size)
        try:
            got[r], places[r] = agree_job(
                store, r, size if records is None else record["world"], timeout, record
            )
            assert places[r][r].rank == r
        except BootstrapError as e:
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


@pytest.mark.parametrize("rank0_late", [False, True], ids=["rank0-first", "rank0-last"])
def test_every_rank_gets_this_attempts_job_id_never_a_stale_one(rank0_late: bool) -> None:
    """torch elastic keeps one store across restarts: an earlier attempt's keys are still there."""
    store = dist.HashStore()
    first = _agree(store, 3, [0.0, 0.0, 0.0])
    assert len(set(first)) == 1 and isinstance(first[0], str) and len(first[0]) == 32
    # The next attempt, on the same store, with rank 0 arriving before or after the others.
    delays = [0.3, 0.0, 0.05] if rank0_late else [0.0, 0.2, 0.3]
    second = _agree(store, 3, delays)
    assert len(set(second)) == 1 and isinstance(second[0], str), second
    assert second[0] != first[0]


def test_a_rank_that_never_asks_is_named_by_rank_0() -> None:
    store = dist.HashStore()
    with pytest.raises(BootstrapError, match=r"rank\(s\) 1 did not join the smddp job within 0\.3s"):
        agree_job(store, 0, 2, 0.3, _record())


def test_a_store_nobody_else_reaches_is_bounded_and_said() -> None:
    """Each rank alone in its store (file:// paths that differ): rank 0 names the ranks that never came,
    the others say rank 0 never answered and what to check, each within its timeout."""
    with pytest.raises(BootstrapError, match=r"rank\(s\) 1-3 did not join.*do they reach the same store"):
        agree_job(dist.HashStore(), 0, 4, 0.3, _record(world=4))
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match=r"rank 2: rank 0 gave no smddp job id within 0\.3s.*same store"):
        agree_job(dist.HashStore(), 2, 4, 0.3, _record(world=4))
    assert time.monotonic() - t0 < 5.0  # bounded by the timeout given (generous: a loaded host)


def test_ranks_that_disagree_on_the_world_size_all_say_so() -> None:
    """Rank 1 says 2 ranks, ranks 0 and 2 say 3: every rank that reached the store fails naming the sizes,
    rank 1 from rank 0's answer, rank 2 from rank 0's table."""
    records = [_record(world=3), _record(world=2), _record(world=3)]
    got = _agree(dist.HashStore(), 3, [0.0, 0.0, 0.1], records)
    for r in range(3):
        assert isinstance(got[r], BootstrapError), got
        assert "rank 1 has a world of 2 ranks and rank 0 one of 3" in str(got[r]), (r, got[r])


def test_two_processes_claiming_one_rank_are_told() -> None:
    """Two processes both rank 1 (rank 0 not there yet): the one whose question was replaced says so at
    once instead of waiting out its timeout."""
    store = dist.HashStore()
    errors: list[Any] = []

    def second() -> None:
        time.sleep(0.1)
        try:
            agree_job(store, 1, 2, 5.0, _record())
        except BootstrapError as e:
            errors.append(e)

    t = threading.Thread(target=second)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match="another process asked for the smddp job as rank 1"):
        agree_job(store, 1, 2, 5.0, _record())
    assert time.monotonic() - t0 < 4.0  # before its own 5 s timeout
    # The other (whose question stands) is answered once rank 0 comes.
    job, places = agree_job(store, 0, 2, 5.0, _record())
    t.join(10)
    assert not errors and len(job) == 32 and [p.node for p in places] == [0, 0]


def test_without_a_launcher_the_ranks_of_one_host_form_a_node() -> None:
    recs = [_record(h, 6) for h in ("a", "a", "a", "b", "b", "b")]
    places = place_ranks(recs, 6)
    assert [(p.node, p.local_rank, p.local_size, p.nnodes) for p in places] == [
        (n, lr, 3, 2) for n in range(2) for lr in range(3)
    ]
    # Through the store, on one host (what mp.spawn gives): one node of every rank.
    got = _agree(dist.HashStore(), 3, [0.0, 0.0, 0.0], [rank_record(os.environ, 3)] * 3)
    assert len(set(got)) == 1 and isinstance(got[0], str), got


@pytest.mark.parametrize(
    ("records", "match"),
    [
        (
            [_record("a", 3), _record("a", 3), _record("b", 3)],
            r"same number of ranks on every host.*2 on a \(ranks 0-1\); 1 on b",
        ),
        (
            [_record("a", 4), _record("b", 4), _record("a", 4), _record("b", 4)],
            r"numbered consecutively.*has ranks 0, 2",
        ),
        (
            [_record("a", 2, LOCAL_RANK="0", LOCAL_WORLD_SIZE="2"), _record("a", 2)],
            r"LOCAL_RANK is set for rank\(s\) 0 but not for rank\(s\) 1",
        ),
        (
            [_record("a", 2, LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")] * 2,
            r"rank 0 \(a, pid 1\) and rank 1 \(a, pid 1\) both claim local rank 0",
        ),
        (
            [_record(h, 2, LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2") for r, h in enumerate("ab")],
            r"rank 0 \(a, pid 1\) and rank 1 \(b, pid 1\) are on different hosts, yet their launcher put both on node 0",
        ),
        (
            # Each rank's variables fit its own rank, but not each other's.
            [_record("a", 4, LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2" if r < 2 else "4") for r in range(4)],
            r"disagree on LOCAL_WORLD_SIZE \(rank 0: 2, rank 1: 2, rank 2: 4",
        ),
    ],
    ids=[
        "uneven-hosts",
        "not-contiguous",
        "local-rank-on-some",
        "same-local-rank",
        "node-across-hosts",
        "local-sizes",
    ],
)
def test_what_smddp_cannot_place_is_refused_by_name(records: list[Any], match: str) -> None:
    with pytest.raises(BootstrapError, match=match):
        place_ranks(records, len(records))


def test_a_launchers_nodes_are_kept_and_may_share_a_host() -> None:
    """torchrun agents as nodes of one host (a simulated cluster): two nodes on host a, as GROUP_RANK says."""
    recs = [
        _record("a", 4, LOCAL_RANK=str(r % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(r // 2)) for r in range(4)
    ]
    assert [(p.node, p.local_rank) for p in place_ranks(recs, 4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # Every rank of the store's view agrees with what each was told by its launcher.
    got = _agree(dist.HashStore(), 4, [0.0] * 4, recs)
    assert len(set(got)) == 1 and isinstance(got[0], str), got


def test_the_greeting_gives_a_daemon_started_ahead_its_job() -> None:
    """A daemon started before its job was known (EarlyDaemon) learns the id from the greeting; one whose
    worker hangs up first is cancelled, not failed; a malformed id is refused by name."""
    store = dist.HashStore()
    mine, theirs = socket.socketpair()
    got: list[Any] = []

    def daemon() -> None:
        try:
            comm = RelayComm(theirs.detach(), 0.1)  # 0.1 s bounds each answer, not the greeting
        except BootstrapError as e:
            got.append(e)
            return
        got.append(comm.job)
        comm.close()

    t = threading.Thread(target=daemon)
    t.start()
    time.sleep(0.5)  # the daemon waits for the greeting however long the worker takes
    StoreRelay(store, "boot/", 0, 1, 10.0, job=JOB).serve(LineConn(mine, "daemon 0"), lambda: "exited")
    t.join(10)
    assert got == [JOB]

    mine, theirs = socket.socketpair()
    mine.close()
    with pytest.raises(BootstrapCancelled, match="gave it no job"):
        RelayComm(theirs.detach(), 10.0)

    mine, theirs = socket.socketpair()
    mine.sendall(b'{"node": 0, "nnodes": 1, "job": "not hex"}\n')
    with pytest.raises(BootstrapError, match="malformed job id"):
        RelayComm(theirs.detach(), 10.0)
    mine.close()


def _torchrun_env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMDDP_")}
    env.update({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", **more})
    return env


def test_an_early_daemon_is_taken_only_for_what_it_was_started_with() -> None:
    """`import smddp.torch` on a node's first worker under torchrun starts a real smddp-daemon that waits
    for its job (EarlyDaemon). The first group takes it while smddp's variables are unchanged; one started
    with other variables is ended (status 0: it had no job) and the group starts a fresh one. Other local
    ranks, smddp-launch's workers and SMDDP_DAEMON_AT_IMPORT=0 start none."""
    env = _torchrun_env()
    place = ElasticPlace.from_env(env, 0, 2)
    early = EarlyDaemon()
    early.start(env)
    child = early.take(place, env)
    assert child is not None and child.proc.poll() is None  # alive, waiting for its job
    assert early.take(place, env) is None  # taken once
    t0 = time.monotonic()
    child.wait_exit(10.0)  # never given a job: it ends as soon as its pair closes
    assert child.proc.returncode == 0 and time.monotonic() - t0 < 5.0

    early.start(env)
    stale = early._child
    assert stale is not None
    assert early.take(place, {**env, "SMDDP_THREADS": "3"}) is None  # set after the import
    assert stale.proc.wait(5.0) == 0

    for other in (
        _torchrun_env(LOCAL_RANK="1", RANK="1"),
        _torchrun_env(SMDDP_DAEMON_AT_IMPORT="0"),
        {**env, "SMDDP_JOB_ID": JOB, "SMDDP_RANK": "0"},  # under smddp-launch
        {k: v for k, v in env.items() if k != "LOCAL_RANK"},  # no launcher
    ):
        early.start(other)
        assert early._child is None, other
