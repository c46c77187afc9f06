"""Encoder identities (namespaces): an entry is served only to the identity
that wrote it; weights fingerprints; stores from before identities (schema
< 3) keep their entries but never serve them; ecstore-dump purges by identity.
Real LMDB stores, real files; the vLLM side is in test_identity_engine.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import gib
from helpers.tensors import assert_same, make_tensor

from ecstore import ECStore, ECStoreConfig
from ecstore.format import codec
from ecstore.identity import (
    EncoderIdentity,
    WeightsFingerprint,
    fingerprint_weights,
    library_identity,
    qualify,
    split_stored,
)
from ecstore.lmdb import schema
from ecstore.testing.stores import open_store_at_schema

MODEL = "org/vlm"
REPO = Path(__file__).resolve().parents[2]


def ident(weights: str = "w1", **settings) -> EncoderIdentity:
    return EncoderIdentity(MODEL, "bfloat16", None, WeightsFingerprint("sampled", weights), settings)


def open_store(path: Path, identity: EncoderIdentity | None = None, schema_target: int | None = None,
               **kw) -> ECStore:
    cfg = ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=gib(64 << 20))
    return open_store_at_schema(cfg, schema_target, model=MODEL, dtype=torch.bfloat16, identity=identity, **kw)


def dump(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    return subprocess.run([sys.executable, "-m", "ecstore.cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120, check=False)


# --------------------------------------------------------------------------- identity values
def test_namespace_depends_on_every_part():
    base = ident()
    others = [ident("w2"), ident(mm_processor_kwargs={"do_normalize": False}),
              EncoderIdentity(MODEL, "float16", None, base.weights, {}),
              EncoderIdentity(MODEL, "bfloat16", "rev2", base.weights, {}),
              EncoderIdentity("org/other", "bfloat16", None, base.weights, {}),
              EncoderIdentity(MODEL, "bfloat16", None, base.weights, {}, format_version=99)]
    spaces = {o.namespace for o in others} | {base.namespace}
    assert len(spaces) == len(others) + 1
    assert ident().namespace == base.namespace  # a pure function of the values
    assert ident(a=1, b={"y": 2, "x": 1}).namespace == ident(b={"x": 1, "y": 2}, a=1).namespace


def test_stored_names_split_back():
    ns = ident().namespace
    for mm in ["a" * 64, "renderer0-mm-1-image-0", "x/y@z", "é\x00"]:
        assert split_stored(qualify(ns, mm)).namespace == ns
        assert split_stored(qualify(ns, mm)).identifier == mm
    assert split_stored("a" * 64).namespace is None  # a bare (legacy) identifier


# --------------------------------------------------------------------------- serving
def test_entry_of_another_identity_is_a_miss_and_both_coexist(tmp_store_dir):
    t_old, t_new = make_tensor(1), make_tensor(2)
    with open_store(tmp_store_dir, ident("w1")) as old:
        assert old.put("img", t_old)
        old.flush()
    with open_store(tmp_store_dir, ident("w2")) as new:  # weights changed in place
        assert not new.contains("img")
        assert new.get("img") is None
        assert new.pin_if_present("img") is False
        assert new.put("img", t_new) is True  # not refused as "already present"
        new.flush()
        assert_same(new.get("img"), t_new)
        assert new.key("img") != old.key("img")  # the namespace is in the hashed part
    with open_store(tmp_store_dir, ident("w1")) as old:
        assert_same(old.get("img"), t_old)
        recs = {r.namespace: r for _, r in old.disk.iter_records()}
        assert set(recs) == {ident("w1").namespace, ident("w2").namespace}
        assert {r.mm_identifier for r in recs.values()} == {"img"}


def test_same_key_other_identity_is_still_a_miss(tmp_store_dir):
    """Even if two stored names hash to one key, the record's full name is compared."""
    def same(name: str) -> str:  # every name collides
        return "00000000000000aa"

    with open_store(tmp_store_dir, ident("w1"), chunk_hasher=same) as a:
        assert a.put("img", make_tensor(1))
        a.flush()
    with open_store(tmp_store_dir, ident("w2"), chunk_hasher=same) as b:
        assert b.key("img") == a.key("img")
        assert not b.contains("img") and b.get("img") is None
        assert b.put("img", make_tensor(2)) is False  # the slot is taken: refused, not overwritten
        b.flush()
    with open_store(tmp_store_dir, ident("w1"), chunk_hasher=same) as a:
        assert_same(a.get("img"), make_tensor(1))


def test_foreign_namespace_check_reads_the_table_once_not_per_miss(tmp_store_dir, monkeypatch, caplog):
    """A consumer's miss is looked up under the model's other identities
    (ecstore.connector.foreign). It used to read the namespaces table and parse
    every identity description (several KB of JSON) on every miss, forever,
    on vLLM's scheduler thread: now the table is read again only after
    REFRESH_SECONDS, parsed only when it changed, and a namespace already
    reported is not looked at again."""
    from ecstore.connector import foreign
    from ecstore.maintenance import namespaces

    with open_store(tmp_store_dir, ident("w1")) as other:
        assert other.put("img-1", make_tensor(1))
        other.flush()
    now = [100.0]
    parsed: list[str | None] = []
    parse = namespaces.identity_of
    monkeypatch.setattr(namespaces, "identity_of", lambda d, ns: parsed.append(ns) or parse(d, ns))
    with open_store(tmp_store_dir, ident("w2")) as mine:
        assert mine.disk is not None
        reads, lookups = [], []
        read, contains = mine.disk.namespace_descriptions, mine.disk.contains
        monkeypatch.setattr(mine.disk, "namespace_descriptions", lambda: reads.append(1) or read())
        monkeypatch.setattr(mine.disk, "contains", lambda k, n: lookups.append(n) or contains(k, n))
        check = foreign.ForeignNamespaces(mine, clock=lambda: now[0])
        caplog.set_level("WARNING", logger="ecstore")
        assert [check.on_miss(f"nobody-{i}") for i in range(50)] == [None] * 50
        assert (len(reads), parsed) == (1, [ident("w1").namespace])  # once for 50 misses
        assert len(lookups) == 50  # one per miss under the one other identity
        assert check.on_miss("img-1") == ident("w1").namespace
        assert check.on_miss("img-1") is None  # told: that namespace is not looked at again
        lookups.clear()
        assert check.on_miss("nobody") is None and lookups == []
        told = [r.getMessage() for r in caplog.records if "another encoder identity" in r.getMessage()]
        assert len(told) == 1 and "weights.value: 'w2' here, 'w1' there" in told[0], told

        with open_store(tmp_store_dir, ident("w3")) as third:  # registered while the consumer runs
            assert third.put("img-3", make_tensor(3))
            third.flush()
        assert check.on_miss("img-3") is None and len(reads) == 1  # not read again yet
        now[0] += foreign.REFRESH_SECONDS
        assert check.on_miss("img-3") == ident("w3").namespace
        assert len(reads) == 2 and parsed == [ident("w1").namespace, ident("w3").namespace]
        now[0] += foreign.REFRESH_SECONDS
        assert check.on_miss("nobody") is None
        assert len(reads) == 3 and len(parsed) == 2  # unchanged table: not parsed again


# --------------------------------------------------------------------------- old stores
def _legacy_store(path: Path) -> None:
    """A store as ecstore wrote it before identities (schema 2, records v1)."""
    with open_store(path, schema_target=2) as old:
        assert old.disk.schema_version == 2
        for i in range(3):
            assert old.put(f"img-{i}", make_tensor(i))
        # a client uuid that looks exactly like a stored name of today's identity
        assert old.put(qualify(library_identity(MODEL, "bfloat16").namespace, "crafted"), make_tensor(9))
        old.flush()


def test_upgrade_to_3_keeps_legacy_entries_but_never_serves_them(tmp_store_dir):
    _legacy_store(tmp_store_dir)
    with open_store(tmp_store_dir) as store:  # migrates to the current schema
        assert store.disk.schema_version == schema.current_version() == 4
        recs = [r for _, r in store.disk.iter_records()]
        assert len(recs) == 4 and {r.version for r in recs} == {codec.LEGACY_RECORD_VERSION}
        assert {r.namespace for r in recs} == {None}
        for i in range(3):
            assert not store.contains(f"img-{i}") and store.get(f"img-{i}") is None
        # the crafted legacy entry sits under exactly today's key and name, and is still a miss
        assert store.disk.record(store.key("crafted")) is not None
        assert not store.contains("crafted") and store.get("crafted") is None
        assert store.pin_if_present("crafted") is False
        assert store.put("img-0", make_tensor(5)) is True  # written afresh under the identity
        store.flush()
        assert_same(store.get("img-0"), make_tensor(5))


def test_dump_shows_identities_and_purges_one(tmp_store_dir):
    _legacy_store(tmp_store_dir)
    with open_store(tmp_store_dir, ident("w1")) as a:
        a.put("img-a", make_tensor(1))
    with open_store(tmp_store_dir, ident("w2")) as b:
        b.put("img-b", make_tensor(2))
    ns1, ns2 = ident("w1").namespace, ident("w2").namespace

    listed = json.loads(dump("list", str(tmp_store_dir), "--json").stdout)["entries"]
    assert sorted((e["namespace"] or "none", e["identifier"]) for e in listed if not e["identifier"].startswith(
        ("img-0", "img-1", "img-2")) and "crafted" not in e["identifier"]) == sorted(
        [(ns1, "img-a"), (ns2, "img-b")])
    assert sum(e["namespace"] is None for e in listed) == 4
    table = dump("list", str(tmp_store_dir)).stdout
    assert ns1[:12] in table and ns2[:12] in table and "none" in table

    stats = json.loads(dump("stats", str(tmp_store_dir), "--json").stdout)
    by = {n["namespace"]: n for n in stats["by_namespace"]}
    assert by[None]["entries"] == 4 and by[None]["identity"] is None
    assert by[ns1]["identity"]["weights"] == {"method": "sampled", "value": "w1"}
    shown = json.loads(dump("show", str(tmp_store_dir), "img-b", "--json").stdout)["entries"]
    assert [(e["namespace"], e["identity"]["weights"]["value"]) for e in shown] == [(ns2, "w2")]

    bad = dump("purge", str(tmp_store_dir), "--namespace", "xyz")
    assert bad.returncode != 0 and "hex digits" in bad.stderr
    r = dump("purge", str(tmp_store_dir), "--namespace", "none")
    assert r.returncode == 0 and "removed 4 entries" in r.stdout, r.stdout + r.stderr
    r = dump("purge", str(tmp_store_dir), "--namespace", ns1[:8])
    assert r.returncode == 0 and "removed 1 entry" in r.stdout, r.stdout + r.stderr
    left = json.loads(dump("list", str(tmp_store_dir), "--json").stdout)["entries"]
    assert [(e["namespace"], e["identifier"]) for e in left] == [(ns2, "img-b")]


# --------------------------------------------------------------------------- weights fingerprint
def _checkpoint(d: Path, payload: bytes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    (d / "model-00001-of-00002.safetensors").write_bytes(payload)
    (d / "model-00002-of-00002.safetensors").write_bytes(payload[::-1])
    return d


def test_fingerprint_sees_weights_rewritten_in_place(tmp_path):
    size = 8 << 20
    payload = bytes(range(256)) * (size // 256)
    d = _checkpoint(tmp_path / "ckpt", payload)
    first = fingerprint_weights(str(d))
    assert first.method == "sampled" and first == fingerprint_weights(str(d))
    # a copy elsewhere has the same fingerprint (the path is not part of it)
    assert fingerprint_weights(str(_checkpoint(tmp_path / "copy", payload))) == first
    # a "fine-tune" of identical shapes: same sizes, every value moved a little
    tuned = bytes((b + 1) % 256 for b in payload)
    _checkpoint(d, tuned)
    assert fingerprint_weights(str(d)).value != first.value


def test_fingerprint_degrades_and_never_raises(tmp_path):
    assert fingerprint_weights(str(tmp_path), load_format="dummy").method == "dummy"
    assert fingerprint_weights("s3://bucket/model").method == "config-only"
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    fp = fingerprint_weights(str(empty))
    assert fp.method == "config-only" and "no weight files" in fp.reason
    assert fingerprint_weights(str(tmp_path / "missing")).method == "config-only"
    assert fingerprint_weights(str(tmp_path), pinned="team-ckpt-7") == WeightsFingerprint("pinned", "team-ckpt-7")
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "hub" / "models--org--vlm" / "snapshots" / commit
    _checkpoint(snap, b"x" * 100)
    assert fingerprint_weights(str(snap)) == WeightsFingerprint("hub-commit", commit)
