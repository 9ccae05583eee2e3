"""Every object-store key the project writes, built and parsed in one place.

    runs/<run>/weights/v<version:06d>/model.safetensors    policy versions (the learner)
    runs/<run>/model/<file>                                the initial model's config, tokenizer and
                                                           generation config (what an export needs)
    runs/<run>/checkpoints/step-<step:09d>.json            a learner checkpoint's manifest (its state but tensors)
    runs/<run>/checkpoints/step-<step:09d>.safetensors     a learner checkpoint's tensors
    runs/<run>/checkpoints/step-<step:09d>.rank-<r>.safetensors  a sharded checkpoint's pieces held by rank r
    runs/<run>/checkpoints/latest.json                     pointer to the newest checkpoint
    runs/<run>/producer/position.json                      the producer's position in its source
    runs/<run>/rollouts/                                   the rollouts table, Delta Lake (storage/table.py)
    runs/<run>/rollouts_leases/<id>.json                   table versions a replay in progress reads
    runs/<run>/lake/policy_version=<v>/part-<h>.parquet    trajectory parts before the table (storage/lake_parts.py)
    runs/<run>/lake/_manifest/part-<h>.json                each such part's key, size, sha256 and stats
    runs/<run>/meta/<name>                                 run metadata (config, summary, report)
    <claims prefix>/<sha256[:2]>/<sha256>                  claim-checked message bodies
    images/<sha256[:2]>/<sha256>.<png|jpg|webp>            task images, by content (conveyor/images.py)

Writers and readers (the learner and the rollout workers, the sink and the lake reader, ``conveyor
runs``) all call these functions, so a key's shape cannot drift between two of them.
"""

from __future__ import annotations

import re

RUNS = "runs/"
_WEIGHTS = re.compile(r"^runs/(?P<run>[^/]+)/weights/v(?P<version>\d+)/")
_CHECKPOINT_STEP = re.compile(r"/checkpoints/step-(?P<step>\d+)\.[^/]+$")
_LAKE_VERSION = re.compile(r"/lake/policy_version=(?P<version>\d+)/")


def run_prefix(run_id: str) -> str:
    return f"{RUNS}{run_id}/"


def run_of(key: str) -> str | None:
    """The run a key under ``runs/`` belongs to (None for any other key)."""
    parts = key.split("/")
    return parts[1] if len(parts) >= 3 and key.startswith(RUNS) else None


# policy weights


def weights_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}weights/"


def weights_key(run_id: str, version: int) -> str:
    return f"{weights_prefix(run_id)}v{version:06d}/model.safetensors"


def weights_version(key: str) -> int | None:
    """The policy version of a weights key (None when ``key`` is not one)."""
    m = _WEIGHTS.match(key)
    return int(m.group("version")) if m else None


# the model's files besides its weights


def model_files_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}model/"


def model_file_key(run_id: str, name: str) -> str:
    return f"{model_files_prefix(run_id)}{name}"


# learner checkpoints


def checkpoints_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}checkpoints/"


def checkpoint_key(run_id: str, step: int) -> str:
    """A checkpoint's manifest: its state except tensors, and where each tensor goes."""
    return f"{checkpoints_prefix(run_id)}step-{step:09d}.json"


def checkpoint_tensors_key(run_id: str, step: int) -> str:
    return f"{checkpoints_prefix(run_id)}step-{step:09d}.safetensors"


def checkpoint_shard_key(run_id: str, step: int, rank: int) -> str:
    """One rank's pieces of a sharded checkpoint (``learner/sharded_checkpoint.py``)."""
    return f"{checkpoints_prefix(run_id)}step-{step:09d}.rank-{rank:05d}.safetensors"


def checkpoint_step(key: str) -> int | None:
    """The step of any object of a checkpoint (None when ``key`` is not one)."""
    m = _CHECKPOINT_STEP.search(key)
    return int(m.group("step")) if m else None


def checkpoint_steps_prefix(run_id: str) -> str:
    """What every checkpoint's key starts with (not the pointer's)."""
    return f"{checkpoints_prefix(run_id)}step-"


def checkpoint_pointer_key(run_id: str) -> str:
    return f"{checkpoints_prefix(run_id)}latest.json"


# the producer


def producer_position_key(run_id: str) -> str:
    return f"{run_prefix(run_id)}producer/position.json"


# the trajectory lake


def table_prefix(run_id: str) -> str:
    """The run's rollouts table (Delta Lake): ``_delta_log/`` and its data files."""
    return f"{run_prefix(run_id)}rollouts/"


def table_lease_prefix(run_id: str) -> str:
    """Leases of table versions that readers in progress still need (vacuum keeps them)."""
    return f"{run_prefix(run_id)}rollouts_leases/"


def lake_prefix(run_id: str) -> str:
    """The part-and-manifest layout runs stored before the rollouts table (read, and migrated)."""
    return f"{run_prefix(run_id)}lake/"


def lake_part_key(run_id: str, policy_version: int, digest: str) -> str:
    return f"{lake_prefix(run_id)}policy_version={policy_version}/part-{digest}.parquet"


def lake_manifest_prefix(run_id: str) -> str:
    return f"{lake_prefix(run_id)}_manifest/"


def lake_manifest_key(part: str) -> str:
    """The manifest key of a part key."""
    run_prefix_, _, rest = part.partition("/lake/")
    return f"{run_prefix_}/lake/_manifest/{rest.rsplit('/', 1)[-1].removesuffix('.parquet')}.json"


def lake_version(part: str) -> int:
    """The policy version a part key is partitioned under."""
    m = _LAKE_VERSION.search(part)
    if m is None:
        raise ValueError(f"not a lake part key: {part!r}")
    return int(m.group("version"))


# run metadata


def meta_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}meta/"


def meta_key(run_id: str, name: str) -> str:
    return f"{meta_prefix(run_id)}{name}"


# claim checks


def claim_key(prefix: str, sha256: str) -> str:
    """A claim-checked body's key: content-addressed, fanned out by the hash's first byte."""
    return f"{prefix.strip('/')}/{sha256[:2]}/{sha256}"


# images


IMAGES = "images/"


def image_key(sha256: str, media_type: str) -> str:
    """An image's key: content-addressed and shared by every run, so a dataset's image that many
    tasks and epochs use is stored once. The extension follows the media type, for readers that
    go by it."""
    ext = {"image/png": "png", "image/jpeg": "jpg", "image/webp": "webp"}[media_type]
    return f"{IMAGES}{sha256[:2]}/{sha256}.{ext}"
