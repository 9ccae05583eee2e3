"""`conveyor stack` and `conveyor topics` as a user runs them (subprocesses)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys

from launch.stack.manager import free_port_block


def conveyor(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_help_and_config_validate(tmp_path):
    assert conveyor("--help").returncode == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_id: x\ntransport:\n  type: kafka\n  bootstrap_server: h:1\n")
    res = conveyor("config", "validate", str(bad))
    assert res.returncode == 2
    assert "transport.kafka.bootstrap_server" in res.stderr


def test_up_status_twice_down(tmp_path):
    base = free_port_block()
    state = str(tmp_path / "st")
    up = conveyor("stack", "up", "--state-dir", state, "--base-port", str(base))
    assert up.returncode == 0, up.stderr
    try:
        assert f"127.0.0.1:{base}" in up.stdout  # kafka
        assert f"http://127.0.0.1:{base + 1}" in up.stdout  # s3
        assert f"redis://127.0.0.1:{base + 2}/0" in up.stdout
        status = conveyor("stack", "status", "--state-dir", state, "--json")
        assert status.returncode == 0, status.stdout
        report = json.loads(status.stdout)
        assert set(report) == {"kafka", "s3", "redis"} and all(c["healthy"] for c in report.values())

        again = conveyor("stack", "up", "--state-dir", state, "--base-port", str(base))
        assert again.returncode == 10
        assert "already running" in again.stderr
    finally:
        down = conveyor("stack", "down", "--state-dir", state, "--grace", "3")
    assert down.returncode == 0, down.stderr
    for pid in (c["pid"] for c in report.values()):
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"
    assert conveyor("stack", "status", "--state-dir", state).returncode == 14
    assert conveyor("stack", "down", "--state-dir", state).returncode == 14


def test_port_in_use_is_refused_with_the_port_named(tmp_path):
    base = free_port_block()
    with socket.socket() as s:
        s.bind(("127.0.0.1", base))
        s.listen()
        res = conveyor("stack", "up", "--state-dir", str(tmp_path), "--base-port", str(base), "--only", "kafka")
    assert res.returncode == 11
    assert str(base) in res.stderr


def test_missing_binary_is_named(tmp_path):
    res = conveyor(
        "stack",
        "up",
        "--state-dir",
        str(tmp_path),
        "--base-port",
        str(free_port_block()),
        "--only",
        "kafka",
        env={"CONVEYOR_TANSU_BIN": str(tmp_path / "no-such-tansu")},
    )
    assert res.returncode == 12
    assert "no-such-tansu" in res.stderr


def test_topics_list_and_tail_decode_messages(kafka_cfg):
    from conveyor.contracts import Task, encode
    from conveyor.transport import TopicSpec
    from conveyor.transport.kafka import KafkaTransport

    topic = f"conveyor.cli{os.getpid()}.tasks"

    async def publish():
        transport = KafkaTransport(kafka_cfg)
        await transport.create_topics([TopicSpec(topic, 1)])
        producer = transport.producer()
        await producer.start()
        await producer.send_and_wait(topic, encode(Task(task_id="t-1", run_id="cli", prompt="2+2=")), b"t-1")
        await producer.send_and_wait(topic, b"\x00garbage", b"bad")
        await producer.close()

    asyncio.run(publish())
    server = kafka_cfg.bootstrap_servers
    listed = conveyor("topics", "list", "--bootstrap", server)
    assert listed.returncode == 0 and topic in listed.stdout.split()

    tail = conveyor("topics", "tail", topic, "--bootstrap", server, "-n", "2", "--idle-timeout", "20")
    assert tail.returncode == 0, tail.stderr
    lines = [json.loads(line) for line in tail.stdout.splitlines()]
    assert lines[0]["key"] == "t-1" and lines[0]["value"]["prompt"] == "2+2="
    assert lines[1]["key"] == "bad" and "not a valid Task" in lines[1]["error"]


def test_topics_list_without_broker_fails_clearly():
    res = conveyor("topics", "list", "--bootstrap", f"127.0.0.1:{free_port_block(1)}", timeout=60)
    assert res.returncode == 3
    assert "unavailable" in res.stderr
