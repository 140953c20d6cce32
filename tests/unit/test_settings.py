"""The settings table: the configs, the flags, the environment and docs/configuration.md all come from it."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import pytest

from smddp import settings
from smddp.client.session import ClientConfig
from smddp.daemon.config import DaemonConfig
from smddp.errors import ConfigError
from smddp.launcher.cli import _launch_parser
from smddp.launcher.mpirun import LaunchConfig, build_commands

REPO = Path(__file__).resolve().parents[2]


def test_configuration_doc_is_the_table():
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert doc == settings.markdown(), "docs/configuration.md is stale: run `make configuration-doc`"
    for s in settings.SETTINGS:
        assert f"| {s.name} |" in doc


def test_names_flags_and_env_are_unique():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names))
    for program in (settings.LAUNCH, settings.DAEMON):
        flags = [f for s in settings.SETTINGS if program in s.programs for f in s.flags]
        assert len(flags) == len(set(flags)), program
    envs = [s.env for s in settings.SETTINGS if s.env]
    assert len(envs) == len(set(envs)) and all(e.startswith("SMDDP_") for e in envs)


def test_config_defaults_are_the_tables():
    launch = LaunchConfig(np=1, command=("true",))
    daemon, client = DaemonConfig(), ClientConfig()
    fields = {f.name for f in dataclasses.fields(LaunchConfig)} - {"np", "job_id", "hosts", "mpi_args"}
    for s in settings.SETTINGS:
        if settings.LAUNCH in s.programs and s.name in fields:  # (hosts, mpi_args: parsed into tuples)
            assert getattr(launch, s.name) == s.default, s.name
    assert daemon.chunk_bytes == settings.default("chunk_kb") * 1024
    assert daemon.replicate_bytes == settings.default("replicate_kb") * 1024
    for name in ("threads", "heartbeat_timeout_s", "connect_timeout_s", "stall_warning_s", "log_level"):
        assert getattr(daemon, name) == settings.default(name), name
    assert client.fusion_bytes == int(settings.default("fusion_mb") * (1 << 20))
    assert client.pipeline_bytes == settings.default("pipeline_kb") * 1024
    for name in ("timeout_s", "heartbeat_timeout_s", "log_level", "device_runtime"):
        assert getattr(client, name) == settings.default(name), name


def test_every_launch_flag_parses_to_its_setting():
    p = _launch_parser()
    dests = {a.dest for a in p._actions}
    for s in settings.SETTINGS:
        if settings.LAUNCH in s.programs and s.flags:
            assert s.name in dests, s.name
    a = p.parse_args(["-np", "2", "--heartbeat-timeout", "7.5", "--no-tag-output", "--", "x"])
    assert a.np == 2 and a.heartbeat_timeout_s == 7.5 and a.tag_output is False
    assert p.parse_args(["-np", "1", "x"]).tag_output is True


def test_environment_is_the_flags_default_and_a_bad_value_is_named():
    p = argparse.ArgumentParser()
    settings.add_flags(p, settings.LAUNCH, env={"SMDDP_TIMEOUT_S": "42", "SMDDP_LOG_LEVEL": "DEBUG"})
    a = p.parse_args([])
    assert a.timeout_s == 42.0 and a.log_level == "DEBUG"
    assert p.parse_args(["--timeout", "3"]).timeout_s == 3.0  # the flag wins over the environment
    with pytest.raises(ConfigError, match=r"SMDDP_TIMEOUT_S='soon'"):
        settings.add_flags(argparse.ArgumentParser(), settings.LAUNCH, env={"SMDDP_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match=r"SMDDP_PIPELINE_KB='lots'"):
        ClientConfig.from_env({"SMDDP_PIPELINE_KB": "lots"})
    with pytest.raises(ConfigError, match=r"--restart-on='often': expected one of crash, any"):
        settings.setting("restart_on").parse("often", "--restart-on")


def test_what_the_launcher_exports_is_what_workers_read():
    cfg = LaunchConfig(
        np=2, command=("true",), fusion_mb=12.5, pipeline_kb=512, timeout_s=33.0, heartbeat_timeout_s=4.0
    )
    cmds = build_commands(cfg)
    env = {}
    for i, arg in enumerate(cmds.workers):
        if arg == "-x":
            k, _, v = cmds.workers[i + 1].partition("=")
            env[k] = v
    c = ClientConfig.from_env(env)
    assert c.fusion_bytes == int(12.5 * (1 << 20)) and c.pipeline_bytes == 512 * 1024
    assert c.timeout_s == 33.0 and c.heartbeat_timeout_s == 4.0 and c.job_id_hex == cfg.job_id


def test_what_the_launcher_passes_is_what_the_daemon_parses():
    cfg = LaunchConfig(
        np=4, command=("true",), local_nodes=2, chunk_kb=256, threads=3, heartbeat_timeout_s=5.0,
        stall_warning_s=9.0, replicate_kb=0, log_level="INFO",
    )  # fmt: skip
    daemon = build_commands(cfg).daemons
    argv = daemon[daemon.index("--workers-per-node") :]
    p = argparse.ArgumentParser()
    settings.add_flags(p, settings.DAEMON, env={})
    a = p.parse_args(argv)
    assert (a.local_size, a.chunk_kb, a.threads, a.replicate_kb) == (2, 256, 3, 0)
    assert (a.heartbeat_timeout_s, a.stall_warning_s, a.log_level) == (5.0, 9.0, "INFO")


def test_daemon_config_errors_are_config_errors():
    with pytest.raises(ConfigError, match="chunk_bytes"):
        DaemonConfig(chunk_bytes=10)
    with pytest.raises(ConfigError, match="heartbeat"):
        DaemonConfig(heartbeat_timeout_s=0.0)
    with pytest.raises(ConfigError, match="threads"):
        DaemonConfig(threads=-1)


def test_auto_threads_are_the_cores_the_workers_leave_from_2_to_8():
    # (cores, workers) -> threads: CI's 2 cores keep 2; a GPU host's 16 cores and 4 workers give 8.
    cases = {(2, 4): 2, (2, 1): 2, (4, 1): 3, (8, 2): 6, (16, 4): 8, (96, 8): 8}
    for (cores, workers), want in cases.items():
        assert DaemonConfig(local_size=workers).compute_threads(cores) == want, (cores, workers)
    assert DaemonConfig(local_size=4, threads=3).compute_threads(64) == 3  # given: as given
    assert 2 <= DaemonConfig().compute_threads() <= 8  # this host's affinity


def test_multi_host_jobs_forward_the_launching_environment(monkeypatch):
    from smddp.launcher.hosts import Host
    from smddp.launcher.mpirun import forwarded_names

    env = {"PATH": "/v/bin:/usr/bin", "VIRTUAL_ENV": "/v", "HOME": "/root", "SMDDP_X": "1", "FI_PROVIDER": "tcp",
           "NCCL_DEBUG": "INFO", "MY_VAR": "2", "MY_VARIANT": "3", "SMDDP_JOB_ID": "a" * 32}  # fmt: skip
    assert forwarded_names(env, "") == ["FI_PROVIDER", "PATH", "SMDDP_JOB_ID", "SMDDP_X", "VIRTUAL_ENV"]
    got = forwarded_names(env, "NCCL_*, MY_VAR", exclude=["SMDDP_JOB_ID"])
    assert got == ["FI_PROVIDER", "MY_VAR", "NCCL_DEBUG", "PATH", "SMDDP_X", "VIRTUAL_ENV"]
    for k in list(os.environ):
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    hosts = (Host("a", 1), Host("b", 1))
    cmds = build_commands(
        LaunchConfig(np=2, command=("t",), hosts=hosts, forward_env="MY_*", job_id="b" * 32)
    )
    for line in (cmds.daemons, cmds.workers):
        named = [line[i + 1] for i, a in enumerate(line) if a == "-x" and "=" not in line[i + 1]]
        # By name (mpirun takes the values from its environment); the job's own settings set, not forwarded.
        assert named == ["FI_PROVIDER", "MY_VAR", "MY_VARIANT", "PATH", "SMDDP_X", "VIRTUAL_ENV"]
        assert f"SMDDP_JOB_ID={'b' * 32}" in line
    # One host: mpirun's local children inherit the environment; nothing is added.
    one = build_commands(LaunchConfig(np=2, command=("t",), job_id="b" * 32))
    assert "PATH" not in one.workers
    with pytest.raises(ConfigError, match="--forward-env"):
        LaunchConfig(np=2, command=("t",), forward_env="OK,NOT OK")
