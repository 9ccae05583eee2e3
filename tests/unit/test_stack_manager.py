"""The local stack's manager: port choice, crash reasons, restarts (no real servers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from launch.stack import manager
from launch.stack.components import Component
from launch.stack.manager import ExitedDuringStartup, Stack, StackPorts, free_port_block


def test_port_block_stays_below_the_ephemeral_range(monkeypatch):
    monkeypatch.setattr(manager, "ephemeral_port_range", lambda: (25000, 60999))
    for _ in range(50):
        base = free_port_block(10)
        assert 20000 <= base and base + 10 <= 25000


def test_no_room_outside_the_ephemeral_range_warns_and_still_gives_ports(monkeypatch):
    monkeypatch.setattr(manager, "ephemeral_port_range", lambda: (1024, 65535))
    with pytest.warns(UserWarning, match="outside the ephemeral range 1024-65535"):
        base = free_port_block(10)
    assert 1024 <= base < 65535 - 10


def test_the_reason_of_a_go_crash_leads_the_log_tail(tmp_path):
    log = tmp_path / "s3.log"
    dump = [f"\tgithub.com/seaweedfs/x.go:{i} +0x25" for i in range(200)]
    log.write_text(
        "\n".join(["I1201 starting", "panic: runtime error: index out of range", "goroutine 1 [running]:", *dump, "I1201 last"])
    )
    tail = manager._tail(str(log), lines=5)
    assert tail.splitlines()[0] == "panic: runtime error: index out of range"
    assert tail.splitlines()[-1] == "I1201 last"
    assert "panic:" not in manager._tail(str(log), lines=300).splitlines()[-1]


def _flaky_component(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """A server that crashes at start-up while ``crash`` exists (removing it), else serves."""
    crash, up = tmp_path / "crash", tmp_path / "up"
    script = (
        "import pathlib, sys, time\n"
        f"crash, up = pathlib.Path({str(crash)!r}), pathlib.Path({str(up)!r})\n"
        "if crash.exists():\n"
        "    crash.unlink(); print('panic: left half a write', flush=True); sys.exit(2)\n"
        "up.write_text('ok'); time.sleep(120)\n"
    )

    def build(ports: StackPorts, data_dir: Path) -> Component:
        return Component(name="flaky", argv=[sys.executable, "-c", script], ports=[], endpoint=str(up))

    def check(endpoint: str, timeout_s: float = 3.0) -> None:
        Path(endpoint).read_text()  # FileNotFoundError until it serves

    monkeypatch.setitem(manager.BUILDERS, "flaky", build)
    monkeypatch.setitem(manager.HEALTH_CHECKS, "flaky", check)
    return crash, up


@pytest.fixture
def flaky(tmp_path, monkeypatch):
    """A running stack of the flaky component; ``kill(crash_next=...)`` kills it for a restart."""
    crash, up = _flaky_component(tmp_path, monkeypatch)
    st = Stack(tmp_path / "stack")
    st.up(["flaky"], timeout_s=30)

    def kill(crash_next: bool) -> None:
        st.kill("flaky")
        up.unlink()
        if crash_next:
            crash.write_text("x")

    try:
        yield st, kill
    finally:
        st.down(grace_s=1)


def test_restart_starts_again_after_a_crash_during_startup(flaky):
    st, kill = flaky
    first = st.read_state()["flaky"].pid
    kill(crash_next=True)
    comp = st.restart("flaky", timeout_s=30)
    assert comp.pid != first and manager.pid_alive(comp.pid)
    assert len(st.restart_failures) == 1 and "panic: left half a write" in st.restart_failures[0]


def test_restart_gives_up_after_its_attempts(flaky):
    st, kill = flaky
    kill(crash_next=True)
    with pytest.raises(ExitedDuringStartup, match="panic: left half a write"):
        st.restart("flaky", timeout_s=30, attempts=1)


def test_ensure_healthy_restarts_only_what_is_down(flaky):
    st, kill = flaky
    assert st.ensure_healthy("flaky") is False
    kill(crash_next=False)
    assert st.ensure_healthy("flaky", timeout_s=30) is True
    assert st.ensure_healthy("flaky") is False


def test_stack_up_warns_about_ports_in_the_ephemeral_range(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from launch.cli.stack import app

    monkeypatch.setattr(manager, "ephemeral_port_range", lambda: (32768, 60999))
    args = ["up", "--state-dir", str(tmp_path), "--only", "nothing"]  # refused before anything starts
    inside = CliRunner().invoke(app, [*args, "--base-port", "40000"])
    assert "ports 40000-40009 are in this machine's ephemeral range 32768-60999" in inside.output
    below = CliRunner().invoke(app, [*args, "--base-port", "20000"])
    assert "ephemeral" not in below.output and "unknown component(s) nothing" in below.output
