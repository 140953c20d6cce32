"""Choosing the address a daemon listens on: by interface name, by CIDR, or the first real interface."""

from __future__ import annotations

import fcntl
import ipaddress
import random
import socket
import struct
from dataclasses import dataclass

from smddp.errors import ConfigError

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8


@dataclass(frozen=True)
class Interface:
    name: str
    address: str
    netmask: str
    up: bool
    loopback: bool

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.address}/{self.netmask}", strict=False)


def interfaces() -> list[Interface]:
    """IPv4 interfaces of this network namespace, in kernel index order (ioctl: no extra dependency)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, req)[20:24])
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)[16:18])[0]
            except OSError:
                continue  # no IPv4 address on this interface
            out.append(Interface(name, addr, mask, bool(flags & _IFF_UP), bool(flags & _IFF_LOOPBACK)))
    return out


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def service_port(attempts: int = 200) -> int:
    """A TCP port free on this host now and outside the kernel's ephemeral range, for a server that
    another process will bind later (torch.distributed's store: MASTER_PORT).

    A port the kernel handed out for ("", 0) is released when we close it, and the kernel may hand it
    out again before its real owner binds it: to a daemon's listener (bound to port 0), whose peers
    then take the store's connections (seen in CI: a TCPStore read the daemon's magic), or to an
    outgoing connection. Ports outside the ephemeral range are never handed out by the kernel.
    """
    lo, hi = _ephemeral_range()
    below, above = (10000, lo) if lo > 10000 else (1024, lo)
    pool = list(range(below, above)) + list(range(hi + 1, 65536))
    rng = random.Random()  # its own generator: a job's seeded `random` must not pick the same ports
    for port in rng.sample(pool, min(attempts, len(pool))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise ConfigError(f"no free TCP port outside the ephemeral range {lo}-{hi} after {attempts} tries")


def resolve_bind_address(spec: str, single_host: bool) -> str:
    """The IPv4 address to listen on for `spec` (interface name, CIDR, address, or "" for the default).

    The default is loopback when the whole job is on one host, else the first interface that is up
    and not loopback: the same rule on every node, and never an address that only this host knows.
    """
    spec = spec.strip()
    if not spec:
        if single_host:
            return "127.0.0.1"
        for itf in interfaces():
            if itf.up and not itf.loopback:
                return itf.address
        raise ConfigError("no network interface is up besides loopback; choose one with --iface")
    try:
        return str(ipaddress.IPv4Address(spec))
    except ValueError:
        pass
    if "/" in spec:
        try:
            net = ipaddress.IPv4Network(spec, strict=False)
        except ValueError:
            raise ConfigError(f"--iface {spec!r} is neither an interface name nor a valid CIDR") from None
        for itf in interfaces():
            if itf.up and ipaddress.IPv4Address(itf.address) in net:
                return itf.address
        raise ConfigError(f"no interface of this host has an address in {spec}")
    for itf in interfaces():
        if itf.name == spec:
            if not itf.up:
                raise ConfigError(f"interface {spec} is down")
            return itf.address
    names = ", ".join(i.name for i in interfaces()) or "none"
    raise ConfigError(f"no interface named {spec!r} with an IPv4 address here (have: {names})")
