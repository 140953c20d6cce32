"""Where a job runs: host lists from -H, hostfiles (Open MPI and MPICH formats) and Slurm allocations."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from smddp.errors import ConfigError


@dataclass(frozen=True)
class Host:
    name: str
    slots: int  # worker processes on this host


def parse_host_list(spec: str) -> list[Host]:
    """`host1:2,host2:2` (slots default to 1), as Open MPI's -H takes it."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, slots = item.partition(":")
        hosts.append(Host(name.strip(), _slots(slots or "1", item)))
    return _checked(hosts, f"-H {spec!r}")


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Open MPI (`host slots=N [max_slots=M]`) and MPICH (`host:N`) hostfiles; `#` starts a comment."""
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        words = line.split()
        name = words[0]
        slots = 1
        if ":" in name:  # MPICH: host:N
            name, _, n = name.partition(":")
            slots = _slots(n, where)
        for word in words[1:]:
            key, eq, value = word.partition("=")
            if not eq:
                raise ConfigError(f"{where}: cannot read {word!r} (expected key=value)")
            if key in ("slots", "cpu", "cpus"):
                slots = _slots(value, where)
            elif key not in ("max_slots", "max-slots"):
                raise ConfigError(f"{where}: unknown attribute {key!r}")
        hosts.append(Host(name, slots))
    return _checked(hosts, source)


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed node list: `gpu[01-03,07],cpu5` -> gpu01 gpu02 gpu03 gpu07 cpu5."""
    names: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not m:
            names.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ConfigError(f"SLURM_JOB_NODELIST: cannot read range {part!r} in {nodelist!r}")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{prefix}{i:0{width}d}{suffix}")
    return names


def expand_tasks_per_node(spec: str, count: int) -> list[int]:
    """Slurm's `2(x3),1` -> [2, 2, 2, 1], checked against the number of nodes."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ConfigError(f"SLURM_TASKS_PER_NODE: cannot read {spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    if len(out) == 1:
        out *= count
    if len(out) != count:
        raise ConfigError(f"SLURM_TASKS_PER_NODE {spec!r} does not match {count} nodes")
    return out


def slurm_hosts(env: Mapping[str, str]) -> list[Host] | None:
    """The allocation smddp-launch runs inside, or None when not inside one."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    names = expand_nodelist(nodelist)
    per = env.get("SLURM_NTASKS_PER_NODE")
    if per:
        slots = [_slots(per, "SLURM_NTASKS_PER_NODE")] * len(names)
    elif env.get("SLURM_TASKS_PER_NODE"):
        slots = expand_tasks_per_node(env["SLURM_TASKS_PER_NODE"], len(names))
    else:
        slots = [1] * len(names)
    return _checked([Host(n, s) for n, s in zip(names, slots, strict=True)], "the Slurm allocation")


def _slots(text: str, where: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"{where}: slots must be a number, got {text!r}") from None
    if n < 1:
        raise ConfigError(f"{where}: slots must be at least 1")
    return n


def _checked(hosts: list[Host], source: str) -> list[Host]:
    if not hosts:
        raise ConfigError(f"{source} names no hosts")
    seen: set[str] = set()
    for h in hosts:
        if not h.name or h.name in seen:
            raise ConfigError(f"{source}: host {h.name!r} is empty or listed twice")
        seen.add(h.name)
    return hosts
