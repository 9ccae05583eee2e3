"""The storage sink as a run config describes it: what ``conveyor serve storage-sink``, the demo
and the tests start."""

from __future__ import annotations

from conveyor.config import RunConfig
from conveyor.messaging import claim_check_for
from conveyor.objectstore import ObjectStore
from conveyor.topics import Topics
from conveyor.transport.base import Transport
from storage.sink import StorageSink


def build(cfg: RunConfig, transport: Transport, topics: Topics, store: ObjectStore) -> StorageSink:
    return StorageSink(transport, topics, store, cfg.sink, claim_check=claim_check_for(cfg, store))
