"""The warm sandbox (one long-lived bubblewrap serving batches over a pipe) when its
harness hangs: the call returns ``infra`` verdicts by its deadline, the request
write included, and the next call gets a fresh harness."""

from __future__ import annotations

import signal
import threading

import psutil
from conftest import open_sandbox


def test_a_hung_harness_fails_the_call_by_its_deadline_and_is_replaced():
    sb = open_sandbox(timeout_s=0.5, parallel=1, warm=True)
    assert sb.run_batch(["print('up')"])[0].verdict == "pass"  # the harness is serving
    bwrap = psutil.Process(sb._warm_proc.pid)
    try:
        sb.warm_grace_s = 1.0
        for p in bwrap.children(recursive=True):  # the harness stops reading its stdin
            p.send_signal(signal.SIGSTOP)
        big = "# " + "x" * (256 << 10) + "\nprint('late')\n"  # more than a pipe holds: the write itself blocks
        results: list = []
        call = threading.Thread(target=lambda: results.extend(sb.run_batch([big])), daemon=True)
        call.start()
        call.join(30)
        assert not call.is_alive(), "the call to a hung harness did not return"
        assert [r.verdict for r in results] == ["infra"] and "did not answer" in (sb.last_error or "")
        assert not bwrap.is_running() or bwrap.status() == psutil.STATUS_ZOMBIE  # the hung one is gone
        assert sb.run_batch(["print('again')"])[0].verdict == "pass"  # a fresh harness serves
    finally:
        for p in [bwrap, *bwrap.children(recursive=True)] if bwrap.is_running() else []:  # a call still blocked ends
            p.send_signal(signal.SIGKILL)
        sb.close()
