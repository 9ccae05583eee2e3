"""The object-store contract, against a local directory and the real
SeaweedFS S3 server started by the project's stack code."""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from conveyor.errors import ChecksumMismatch
from conveyor.objectstore import LocalObjectStore, ObjectNotFound, sha256_hex

# `store` (local directory and SeaweedFS, a fresh prefix each) comes from conftest.py.


def test_put_get_head_exists_delete(store):
    info = store.put("a/b/c.bin", b"hello")
    assert info.size == 5 and info.sha256 == sha256_hex(b"hello")
    assert store.get("a/b/c.bin") == b"hello"
    assert store.get("a/b/c.bin", sha256=info.sha256) == b"hello"
    assert store.head("a/b/c.bin").sha256 == info.sha256
    assert store.exists("a/b/c.bin")
    store.put("a/b/c.bin", b"replaced")
    assert store.get("a/b/c.bin") == b"replaced"
    store.delete("a/b/c.bin")
    assert not store.exists("a/b/c.bin")
    with pytest.raises(ObjectNotFound):
        store.get("a/b/c.bin")
    with pytest.raises(ObjectNotFound):
        store.head("a/b/c.bin")


def test_list_is_sorted_and_filtered_by_prefix(store):
    for key in ["runs/r1/b", "runs/r1/a", "runs/r2/a", "other/x"]:
        store.put(key, key.encode())
    assert [o.key for o in store.list("runs/r1/")] == ["runs/r1/a", "runs/r1/b"]
    assert [o.key for o in store.list("runs/")] == ["runs/r1/a", "runs/r1/b", "runs/r2/a"]
    assert [o.size for o in store.list("other/")] == [len(b"other/x")]
    # A prefix that ends inside a name, and one that names nothing.
    assert [o.key for o in store.list("runs/r")] == ["runs/r1/a", "runs/r1/b", "runs/r2/a"]
    assert [o.key for o in store.list("runs/r1/a")] == ["runs/r1/a"]
    assert list(store.list("runs/r3/")) == [] and list(store.list("nothing/at/all")) == []


def test_put_if_absent_refuses_overwrite(store):
    assert store.put_if_absent("once", b"first") is True
    assert store.put_if_absent("once", b"second") is False
    assert store.get("once") == b"first"


def test_put_if_absent_keeps_the_callers_digest_and_reads_verify_it(store, monkeypatch):
    data = os.urandom(1 << 20)
    digest = sha256_hex(data)
    with monkeypatch.context() as m:  # the caller's digest is used, not computed again
        m.setattr("conveyor.objectstore.sha256_hex", lambda _: pytest.fail("put_if_absent hashed the data again"))
        assert store.put_if_absent("digested", data, sha256=digest) is True
    assert store.head("digested").sha256 == sha256_hex(data)
    assert store.get("digested") == data


def test_put_if_absent_has_one_winner_under_a_race(store):
    key = f"race-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(lambda i: store.put_if_absent(key, f"writer {i}".encode()), range(8)))
    assert wins.count(True) == 1
    assert store.get(key) == f"writer {wins.index(True)}".encode()


def test_multipart_object_of_12_mb_round_trips(store, tmp_path):
    data = os.urandom(12 << 20)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    info = store.put_file("big/file.bin", src)
    assert info.size == len(data) and info.sha256 == sha256_hex(data)
    out = tmp_path / "back.bin"
    store.get_file("big/file.bin", out)
    assert out.read_bytes() == data
    store.put("big/bytes.bin", data)  # above the multipart threshold from memory too
    assert store.get("big/bytes.bin", sha256=info.sha256) == data


def test_wrong_checksum_is_refused(store):
    store.put("sum", b"payload")
    with pytest.raises(ChecksumMismatch):
        store.get("sum", sha256=sha256_hex(b"something else"))


def test_corrupted_local_object_is_detected(tmp_path):
    store = LocalObjectStore(tmp_path)
    store.put("x", b"original")
    (tmp_path / "x").write_bytes(b"bitflip!")
    with pytest.raises(ChecksumMismatch):
        store.get("x")


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "dir/", "a//b"])
def test_bad_keys_are_rejected(store, key):
    with pytest.raises(ValueError):
        store.put(key, b"x")
