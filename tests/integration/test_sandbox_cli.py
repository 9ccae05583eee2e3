"""``conveyor sandbox exec``, from outside, as an operator runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import service_unavailable


def sandbox_exec(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    res = subprocess.run([sys.executable, "-m", "launch.cli.main", "sandbox", "exec", *map(str, args)],
                         capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    if res.returncode == 3:
        service_unavailable(f"bubblewrap sandbox: {res.stderr.strip()}")
    return res.returncode, json.loads(res.stdout.strip().splitlines()[-1])


def test_result_is_one_json_object_and_the_environment_stays_outside(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("import os\nprint(sorted(os.environ))\nprint(os.environ.get('MY_TOKEN'))\n")
    rc, result = sandbox_exec(prog, env_extra={"MY_TOKEN": "s3cr3t"})
    assert rc == 0
    assert {"verdict", "exit_code", "stdout", "stderr", "duration_s", "peak_memory_mb"} <= result.keys()
    assert result["verdict"] == "pass" and result["exit_code"] == 0
    assert "s3cr3t" not in result["stdout"] and "MY_TOKEN" not in result["stdout"]


@pytest.mark.parametrize(
    "src,args,verdict",
    [
        ("while True:\n    pass\n", ["--timeout", "0.5"], "timeout"),
        ("x = bytearray(200 << 20)\n", ["--memory-mb", "64"], "memory"),
        ("raise ValueError('nope')\n", [], "error"),
    ],
)
def test_limits_and_verdicts(tmp_path, src, args, verdict):
    prog = tmp_path / "p.py"
    prog.write_text(src)
    rc, result = sandbox_exec(prog, *args)
    assert rc == 1 and result["verdict"] == verdict


def test_workspace_is_visible_and_never_written(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "data.txt").write_text("41")
    prog = tmp_path / "p.py"
    prog.write_text("n = int(open('data.txt').read())\nopen('data.txt', 'w').write(str(n + 1))\nprint(open('data.txt').read())\n")
    rc, result = sandbox_exec(prog, "--workspace", ws)
    assert rc == 0 and result["stdout"].strip() == "42"
    assert (ws / "data.txt").read_text() == "41"
