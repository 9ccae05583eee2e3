"""The demo's shutdown: a service that fails or never finishes draining is named, and a
stuck one is reported with where it waited."""

from __future__ import annotations

import asyncio

import pytest

from launch.demo import _stopped


async def _drains() -> None:
    await asyncio.sleep(0.01)


async def _never_drains(forever: asyncio.Event) -> None:
    await forever.wait()


async def _fails() -> None:
    raise ValueError("bad weights")


def test_a_stuck_service_is_named_cancelled_and_its_wait_printed(capsys):
    async def go():
        services = {"producer": asyncio.create_task(_drains()),
                    "rollout-worker": asyncio.create_task(_never_drains(asyncio.Event()))}  # fmt: skip
        with pytest.raises(RuntimeError, match=r"service\(s\) rollout-worker still running 0.2 s after being told to stop"):
            await _stopped(services, ("producer", "rollout-worker"), 0.2)
        assert services["rollout-worker"].cancelled()

    asyncio.run(go())
    err = capsys.readouterr().err
    assert "_never_drains" in err and "forever.wait()" in err  # the stuck coroutine's await
    assert "threads:" in err and "Current thread" in err


def test_a_failed_service_is_named_with_its_error():
    async def go():
        services = {"producer": asyncio.create_task(_drains()), "rollout-worker": asyncio.create_task(_fails())}
        with pytest.raises(RuntimeError, match="service rollout-worker failed during shutdown") as info:
            await _stopped(services, ("producer", "rollout-worker"), 5)
        assert isinstance(info.value.__cause__, ValueError)

    asyncio.run(go())


def test_services_that_drain_pass():
    async def go():
        services = {"producer": asyncio.create_task(_drains()), "rollout-worker": asyncio.create_task(_drains())}
        await _stopped(services, ("producer", "rollout-worker"), 5)

    asyncio.run(go())
