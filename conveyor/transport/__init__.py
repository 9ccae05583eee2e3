"""Transports: byte-level topics with Kafka semantics (see ``base``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.transport.base import (
    Consumer,
    Producer,
    Record,
    SendResult,
    TopicPartition,
    TopicSpec,
    Transport,
    next_offsets,
)

if TYPE_CHECKING:
    from conveyor.config import KafkaTransportConfig, MemoryTransportConfig
    from conveyor.transport.memory import MemoryBroker

__all__ = [
    "Consumer",
    "Producer",
    "Record",
    "SendResult",
    "TopicPartition",
    "TopicSpec",
    "Transport",
    "next_offsets",
    "open_transport",
]


def open_transport(cfg: MemoryTransportConfig | KafkaTransportConfig, *, memory_broker: MemoryBroker | None = None) -> Transport:
    """The transport a config names. Embedded roles share one ``memory_broker``."""
    if cfg.type == "memory":
        from conveyor.transport.memory import MemoryTransport

        return MemoryTransport(memory_broker, partitions=cfg.partitions)
    if cfg.type == "kafka":
        from conveyor.transport.kafka import KafkaTransport

        return KafkaTransport(cfg)
    raise ValueError(f"unknown transport type {cfg.type!r}")
