"""The distributed run's supervisor and config resolution, with stand-in processes."""

from __future__ import annotations

import sys
import time

from conveyor.config import parse_run_config
from launch.supervisor import STOP_ORDER, Supervisor, resolve_for_stack


def test_config_is_pointed_at_the_local_stack():
    cfg = parse_run_config({"run_id": "x", "learner": {"batch_groups": 4}})
    data = resolve_for_stack(cfg, {"kafka": "127.0.0.1:1", "s3": "http://127.0.0.1:2", "redis": "redis://127.0.0.1:3/0"})
    resolved = parse_run_config(data)
    assert resolved.transport.type == "kafka" and resolved.transport.bootstrap_servers == "127.0.0.1:1"
    assert resolved.object_store.type == "s3" and resolved.object_store.endpoint_url == "http://127.0.0.1:2"
    assert resolved.celery.type == "redis" and resolved.celery.visibility_timeout_s > resolved.reward.hard_time_limit_s
    assert resolved.learner.batch_groups == 4


def test_crashed_roles_restart_a_finished_producer_does_not(tmp_path):
    sup = Supervisor(tmp_path, tmp_path / "run.yaml", tmp_path)
    py = sys.executable
    for role in sup.roles.values():
        role.argv = [py, "-c", "import time; time.sleep(60)"]
    sup.roles["producer"].argv = [py, "-c", "pass"]  # finishes its suite
    sup.roles["learner"].argv = [py, "-c", "import sys; sys.exit(3)"]  # crashes
    sup.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sup.roles["learner"].restarts < 2:
        sup.tick()
        time.sleep(0.1)
    assert sup.roles["learner"].restarts >= 2 and 3 in sup.roles["learner"].history
    assert sup.roles["producer"].done and sup.roles["producer"].restarts == 0
    assert sup.roles["storage-sink"].pid is not None and sup.roles["storage-sink"].restarts == 0
    codes = sup.stop(grace_s=5)
    assert codes["storage-sink"] == -15  # SIGTERM
    kinds = [n.rsplit("-", 1)[0] if n[-1].isdigit() else n for n in codes]
    assert kinds == [k for k in STOP_ORDER if k != "evaluator"]  # drained front to back, each kind once


def test_the_evaluator_is_stopped_and_a_refused_start_is_not_retried(tmp_path):
    sup = Supervisor(tmp_path, tmp_path / "run.yaml", tmp_path, evaluator=True)
    py = sys.executable
    for role in sup.roles.values():
        role.argv = [py, "-c", "import time; time.sleep(60)"]
    sup.roles["reward-bridge"].argv = [py, "-c", "import sys; sys.exit(2)"]  # refuses its config
    sup.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not sup.roles["reward-bridge"].done:
        sup.tick()
        time.sleep(0.1)
    assert sup.roles["reward-bridge"].done and sup.roles["reward-bridge"].restarts == 0
    codes = sup.stop(grace_s=5)
    assert codes["evaluator"] == -15 and codes["reward-bridge"] == 2  # stopped; reported as it exited


def test_a_childs_config_carries_the_secrets_in_clear_and_no_broker_security_for_the_local_stack():
    from conveyor.config import parse_run_config
    from launch.supervisor import resolve_for_stack

    cfg = parse_run_config(
        {"run_id": "sec", "celery": {"type": "redis", "url": "redis://reward:s3cret@redis.example:6379/0"},
         "transport": {"type": "kafka", "bootstrap_servers": "kafka.example:9093", "security_protocol": "SASL_SSL",
                       "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "u", "sasl_password": "p4ss"}},
        "test",
    )  # fmt: skip
    data = resolve_for_stack(cfg, {"kafka": "127.0.0.1:1", "s3": "http://127.0.0.1:2"})
    assert data["celery"]["password"] == "s3cret"  # not **********: the child must connect with it
    assert data["transport"]["security_protocol"] == "PLAINTEXT" and "sasl_password" not in data["transport"]
    parse_run_config(data, "child")  # and the child can load it


def test_each_role_gets_its_own_metrics_port_and_the_config_takes_it(tmp_path, monkeypatch):
    sup = Supervisor(tmp_path, tmp_path / "run.yaml", tmp_path, rollout_workers=2, reward_workers=2, metrics_port_base=9500)
    ports = sup.metrics_ports
    assert set(ports) == set(sup.roles) and sorted(ports.values()) == list(range(9500, 9500 + len(sup.roles)))
    out = tmp_path / "port"
    role = sup.roles["rollout-worker-1"]
    role.argv = [sys.executable, "-c", f"import os; open({str(out)!r}, 'w').write(os.environ['CONVEYOR_METRICS__PORT'])"]
    role.start()
    role.proc.wait(10)
    assert int(out.read_text()) == ports["rollout-worker-1"]
    monkeypatch.setenv("CONVEYOR_METRICS__PORT", out.read_text())  # what `conveyor serve` then reads, over the file's
    assert parse_run_config({"run_id": "x", "metrics": {"port": 9400}}).metrics.port == ports["rollout-worker-1"]
    assert Supervisor(tmp_path, tmp_path / "run.yaml", tmp_path).metrics_ports == {}  # none given: the config's
