"""What the benches count about the whole machine."""

from __future__ import annotations


def busy_cpu_s() -> float:
    """CPU seconds the whole machine spent busy so far (all but idle and iowait): every process
    counted, the short-lived ones (sandboxed programs) included."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal
