"""How long S3 (SeaweedFS) takes to answer again after a SIGKILL, with the stack's
1-s raft election timeout against SeaweedFS's default (10 s), in one run.

Each round: start a stack with S3 only, write objects from three threads while
it is killed and restarted ``--cycles`` times (``Stack.kill``/``Stack.restart``,
what the chaos tests use), timing each restart until ListBuckets answers and
a write succeeds.

    python bench/stack_restart.py [--cycles 4]

Ends with ``FIGURE s3_restart_s`` (median, the stack's setting) and
``FIGURE s3_restart_speedup`` (default election timeout / the stack's).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import os
import statistics
import tempfile
import threading
import time


def restart_times(cycles: int, election_flag: bool) -> list[float]:
    from conveyor.config import S3StoreConfig
    from conveyor.objectstore import S3ObjectStore
    from launch.stack import components, manager
    from launch.stack.components import LOCAL_S3_ACCESS_KEY, LOCAL_S3_SECRET_KEY

    build = components.s3_component

    def s3(ports, data_dir):
        comp = build(ports, data_dir)
        argv = comp.argv if election_flag else [a for a in comp.argv if not a.startswith("-master.electionTimeout")]
        return components.Component(comp.name, argv, comp.ports, comp.endpoint, comp.env)

    manager.BUILDERS["s3"] = s3
    stack = manager.Stack(tempfile.mkdtemp(prefix="conveyor-restart-"), manager.StackPorts.from_base(manager.free_port_block()))
    stack.up(["s3"], timeout_s=90)
    cfg = S3StoreConfig(endpoint_url=stack.endpoints()["s3"], bucket="conveyor-bench", access_key_id=LOCAL_S3_ACCESS_KEY,
                        secret_access_key=LOCAL_S3_SECRET_KEY, max_attempts=2, connect_timeout_s=1.0)  # fmt: skip
    stop = threading.Event()

    def writer(k: int) -> None:
        store, i = S3ObjectStore(cfg.model_copy(update={"prefix": f"w{k}/"})), 0
        while not stop.is_set():
            try:
                store.put_if_absent(f"o{i}", os.urandom(200_000))
                i += 1
            except Exception:  # noqa: BLE001 - S3 is down on purpose
                time.sleep(0.05)

    threads = [threading.Thread(target=writer, args=(k,), daemon=True) for k in range(3)]
    for t in threads:
        t.start()
    times = []
    try:
        for cycle in range(cycles):
            time.sleep(3)
            stack.kill("s3")
            time.sleep(3)
            t0 = time.monotonic()
            stack.restart("s3", 120.0)
            S3ObjectStore(cfg.model_copy(update={"prefix": "check/", "max_attempts": 10})).put_if_absent(f"c{cycle}", b"x")
            times.append(time.monotonic() - t0)
            print(f"  election flag {election_flag}: restart {cycle} answered in {times[-1]:.1f} s", flush=True)
    finally:
        stop.set()
        manager.BUILDERS["s3"] = build
        stack.down(grace_s=3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=4)
    args = ap.parse_args()
    default = restart_times(args.cycles, election_flag=False)
    ours = restart_times(args.cycles, election_flag=True)
    print(f"default election timeout: median {statistics.median(default):.1f} s, max {max(default):.1f} s")
    print(f"-master.electionTimeout=1s: median {statistics.median(ours):.1f} s, max {max(ours):.1f} s")
    print(f"FIGURE s3_restart_s {statistics.median(ours):.1f} s")
    print(f"FIGURE s3_restart_speedup {statistics.median(default) / statistics.median(ours):.2f} x")


if __name__ == "__main__":
    main()
