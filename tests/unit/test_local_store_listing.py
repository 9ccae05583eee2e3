"""The local object store lists a prefix by walking that prefix's directory only: the learner
lists its weights at every publication, and a store shared by many runs must not slow that down."""

import os

from conveyor import objectstore
from conveyor.objectstore import LocalObjectStore


def test_listing_walks_only_the_prefix_directory(tmp_path, monkeypatch):
    store = LocalObjectStore(tmp_path)
    for run in ("r1", "r2"):
        for v in (1, 2):
            store.put(f"runs/{run}/weights/v{v:06d}/model.safetensors", b"w")
    store.put("runs/r1/lake/part-a.parquet", b"p")
    walked, real_walk = [], os.walk

    def recording_walk(top, *a, **kw):
        walked.append(os.path.relpath(top, tmp_path))
        return real_walk(top, *a, **kw)

    monkeypatch.setattr(objectstore.os, "walk", recording_walk)
    keys = [o.key for o in store.list("runs/r1/weights/")]
    assert keys == ["runs/r1/weights/v000001/model.safetensors", "runs/r1/weights/v000002/model.safetensors"]
    assert walked == ["runs/r1/weights"]
    walked.clear()
    assert [o.key for o in store.list("runs/r1/lake/part-")] == ["runs/r1/lake/part-a.parquet"]
    assert walked == ["runs/r1/lake"]
    assert list(store.list("../outside/")) == []
