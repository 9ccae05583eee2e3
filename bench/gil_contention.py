"""Two small-model torch loops side by side: threads of one process against two processes.

The demo's model is tiny (335k parameters), so a training or sampling step is
mostly Python and torch's dispatcher between small ops, and that holds the GIL.
This runs one such loop (forward, backward, AdamW step of an 8-layer MLP of
width 96 on a batch of 128; one torch thread) alone, then two copies as two
threads of one process, then as two processes, and prints each copy's wall
time against the loop alone. On two cores two processes run at full speed;
two threads serialise on the GIL (and hand it back and forth, which costs
more than running them one after the other). It is why the demo runs the
rollout engine and the learner's steps in child processes by default
(``conveyor demo --engine-in-process --learner-in-process`` keeps them threads).

    python bench/gil_contention.py [--steps 1500]

Ends with ``FIGURE gil_threads_slowdown <v> x`` and ``FIGURE gil_processes_slowdown <v> x``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time


def loop(steps: int) -> float:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(8)])
    x = torch.randn(128, 96)
    opt = torch.optim.AdamW(model.parameters())
    t0 = time.perf_counter()
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return time.perf_counter() - t0


def _in_child(steps: int, out) -> None:
    out.put(loop(steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    args = ap.parse_args()
    alone = loop(args.steps)

    walls = [0.0, 0.0]

    def run(i: int) -> None:
        walls[i] = loop(args.steps)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    in_threads = max(walls)

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_in_child, args=(args.steps, out)) for _ in range(2)]
    for p in procs:
        p.start()
    in_procs = max(out.get() for _ in procs)
    for p in procs:
        p.join()
    print(
        f"one loop alone {alone:.2f} s; two as threads of one process {in_threads:.2f} s each; two processes {in_procs:.2f} s each"
    )
    print(f"FIGURE gil_threads_slowdown {in_threads / alone:.2f} x")
    print(f"FIGURE gil_processes_slowdown {in_procs / alone:.2f} x")


if __name__ == "__main__":
    main()
