"""`conveyor serve`'s service runner: what start-up built is frozen out of the garbage
collector while the service runs (full collections skip it) and handed back when it ends."""

from __future__ import annotations

import gc

from conveyor.config import parse_run_config
from launch.cli.serve import _run_service


class _Service:
    def __init__(self, store) -> None:
        self.store = store
        self.frozen_while_running: int | None = None

    async def run(self, stop) -> None:
        self.frozen_while_running = gc.get_freeze_count()


def test_startup_objects_are_frozen_while_the_service_runs_and_released_after(tmp_path):
    cfg = parse_run_config({"run_id": "freeze", "transport": {"type": "memory"},
                            "object_store": {"type": "local", "root": str(tmp_path / "objects")}})  # fmt: skip
    built: list[_Service] = []
    _run_service(cfg, lambda transport, topics, store: built.append(_Service(store)) or built[0])
    assert built and built[0].store is not None
    assert built[0].frozen_while_running and built[0].frozen_while_running > 100
    assert gc.get_freeze_count() == 0
