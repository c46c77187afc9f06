"""Tests of ``ecstore-dump`` (the ecstore/cli package) against real stores.

Stores are made with ecstore.ECStore (several models and dtypes, hundreds of
small entries). Most checks run the real console script in a subprocess;
detailed variations call ``ecstore.cli.main`` in-process (same code, no
interpreter start-up). Independent subprocess runs are started together to
keep the suite fast on 2 CPUs. No mocks, no sleeps for synchronisation.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import io
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from safetensors import safe_open

from ecstore import ECStore, ECStoreConfig, cli, maintenance
from ecstore.lmdb import LMDBTier
from ecstore.lmdb.env import _SharedEnv
from ecstore.testing.stores import open_store_at_schema

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
_SCRIPT = Path(sys.executable).parent / "ecstore-dump"
DUMP = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "ecstore.cli"]

M1 = "Qwen/Qwen2.5-VL-7B-Instruct"  # bfloat16, 200 entries
M2 = "llava-hf/llava-1.5-7b-hf"  # float16, 100 entries; identifiers shared with M1
M3 = "org/vision@v2"  # float32, 50 entries; '@' in the model name
M1_N, M2_N, M3_N = 200, 100, 50
TOTAL_N = M1_N + M2_N + M3_N


def ident(i: int) -> str:
    return hashlib.sha256(f"image-{i}".encode()).hexdigest()


def tensor_for(i: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(32, dtype=torch.float32).reshape(4, 8) / 8 + i).to(dtype)


def disk_cfg(path: Path | str) -> ECStoreConfig:
    return ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=1.0)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update(extra)
    return env


@dataclass
class Result:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def dump(*args: str, env: dict[str, str] | None = None) -> Result:
    """Run the console script."""
    return dump_many([list(args)], env=env)[0]


def dump_many(cmds: list[list[str]], env: dict[str, str] | None = None) -> list[Result]:
    """Run several console-script invocations at once (independent commands)."""
    procs = [subprocess.Popen(DUMP + [str(a) for a in c], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env or clean_env(), stdin=subprocess.DEVNULL) for c in cmds]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        results.append(Result(p.returncode, out, err))
    return results


def run(*args: Any) -> Result:
    """``ecstore.cli.main`` in-process; checks that no store is left open."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in args])
    assert not _SharedEnv._open, "the command left a store open"
    return Result(rc, out.getvalue(), err.getvalue())


def one_error_line(r: Result) -> str:
    lines = r.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ecstore-dump: error: "), r.err
    return lines[0]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_state(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): (sha(p) if p.is_file() else "dir") for p in sorted(path.rglob("*"))}


def records(path: Path) -> dict[str, Any]:
    tier = LMDBTier(str(path), 0, readonly=True, create=False)
    try:
        return dict(tier.iter_records())
    finally:
        tier.close()


@pytest.fixture(autouse=True)
def _no_ambient_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("LMCACHE_"):
            monkeypatch.delenv(k)


@dataclass
class Template:
    path: Path
    keys: dict[str, tuple[str, str, torch.dtype, int]]  # key -> (model, identifier, dtype, i)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    path = tmp_path_factory.mktemp("template") / "store"
    cfg = disk_cfg(path)
    keys: dict[str, tuple[str, str, torch.dtype, int]] = {}
    with ECStore(cfg, model=M1, dtype=torch.bfloat16) as a, \
            ECStore(cfg, model=M2, dtype=torch.float16) as b, \
            ECStore(cfg, model=M3, dtype=torch.float32) as c:
        for store, n, dtype, base in ((a, M1_N, torch.bfloat16, 0), (b, M2_N, torch.float16, 0),
                                      (c, M3_N, torch.float32, 1000)):
            for i in range(base, base + n):
                store.put(ident(i), tensor_for(i, dtype))
                keys[store.key(ident(i))] = (store.model, ident(i), dtype, i)
                if i % 40 == 39:
                    store.flush()  # several commits: distinct creation times
            store.flush()
        for i in range(0, M1_N, 10):  # hits: 20 entries once, 4 of them 3 times
            assert a.get(ident(i)) is not None
            if i % 50 == 0:
                a.get(ident(i))
                a.get(ident(i))
            a.flush()
    return Template(path, keys)


def template_key(template: Template, model: str, i: int) -> str:
    return next(k for k, v in template.keys.items() if v[0] == model and v[3] == i)


@dataclass
class Console:
    """Console-script runs against the read-only template, started together."""

    results: dict[str, Result]
    dir: Path
    cfg: Path


@pytest.fixture(scope="module")
def console(template: Template, tmp_path_factory: pytest.TempPathFactory) -> Console:
    d = tmp_path_factory.mktemp("console")
    cfg = d / "ec.yaml"
    cfg.write_text(f"local_disk: {template.path}\nmax_local_disk_size: 2\n")
    cmds = {
        "list": ["list", template.path, "--json"],
        "show": ["show", template.path, template_key(template, M1, 50)],
        "export": ["export", template.path, template_key(template, M1, 3), d / "k.safetensors"],
    }
    results = dict(zip(cmds, dump_many(list(cmds.values()))))
    # stats alone: it reports the reader slots of other processes, and the
    # commands above are such processes while they run.
    results["stats"] = dump("stats", "--json", "--config", cfg)
    return Console(results, d, cfg)


@pytest.fixture
def store(template: Template, tmp_path: Path) -> Path:
    dst = tmp_path / "store"
    shutil.copytree(template.path, dst)
    return dst


# --------------------------------------------------------------------------
# list
# --------------------------------------------------------------------------


def test_list_json_every_entry_exact(template: Template, console: Console) -> None:
    r = console.results["list"]
    assert r.rc == 0 and r.err == ""
    doc = r.json()
    recs = records(template.path)
    assert len(doc["entries"]) == TOTAL_N == len(recs)
    assert {e["key"] for e in doc["entries"]} == set(template.keys)
    for e in doc["entries"]:
        model, identifier, dtype, _ = template.keys[e["key"]]
        rec = recs[e["key"]]
        assert e["model"] == model and e["identifier"] == identifier
        assert e["dtype"] == str(dtype).removeprefix("torch.") and e["shape"] == [4, 8]
        assert e["bytes"] == rec.blob_size and e["tensor_bytes"] == 32 * dtype.itemsize
        assert e["hits"] == rec.hits and e["lru_seq"] == rec.lru_seq
        assert e["created_ns"] == rec.created_ns and e["last_access_ns"] == rec.last_access_ns
        created = dt.datetime.fromisoformat(e["created"])
        assert created.tzinfo is not None
        assert created == dt.datetime.fromtimestamp(rec.created_ns // 10**9, dt.UTC) + dt.timedelta(
            microseconds=rec.created_ns % 10**9 // 1000)
        assert e["chunk_hash"] == e["key"].split("@")[-2]
    total = sum(r.blob_size for r in recs.values())
    assert doc["totals"] == {"entries": TOTAL_N, "bytes": total, "cap_bytes": None, "cap_source": None,
                             "cap_used": None}
    assert doc["shown"] == {"entries": TOTAL_N, "bytes": total}
    tier = LMDBTier(str(template.path), 0, readonly=True, create=False)
    try:
        assert tier.total_bytes() == total
    finally:
        tier.close()
    assert sum(e["hits"] for e in doc["entries"]) == 20 + 4 * 2


def test_list_sort_filter_limit(template: Template) -> None:
    def keys(*args: str) -> list[str]:
        r = run("list", template.path, "--json", *args)
        assert r.rc == 0, r.err
        return [e["key"] for e in r.json()["entries"]]

    tier = LMDBTier(str(template.path), 0, readonly=True, create=False)
    try:
        lru = tier.lru_keys()
    finally:
        tier.close()
    assert keys("--sort", "lru") == lru  # least recently used first
    assert keys("--sort", "lru", "--limit", "7") == lru[:7]
    assert keys() == sorted(keys())  # default: key order
    m3 = keys("--model", M3)
    assert len(m3) == M3_N and all(k.startswith(M3 + "@1@0@") for k in m3)
    doc = run("list", template.path, "--json", "--model", M3, "--limit", "5").json()
    assert doc["shown"]["entries"] == 5 and doc["totals"]["entries"] == TOTAL_N
    hits = [e["hits"] for e in run("list", template.path, "--json", "--sort", "hits").json()["entries"]]
    assert hits == sorted(hits, reverse=True) and hits[0] == 3
    sizes = [e["bytes"] for e in run("list", template.path, "--json", "--sort", "size").json()["entries"]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    created = [e["created_ns"] for e in run("list", template.path, "--json", "--sort", "age").json()["entries"]]
    assert created == sorted(created)
    assert run("list", template.path, "--model", "no/such-model", "--json").json()["entries"] == []


def test_list_table_is_human_readable(template: Template) -> None:
    r = run("list", template.path, "--model", M2, "--sort", "lru")
    assert r.rc == 0 and r.err == ""
    lines = r.out.splitlines()
    assert lines[0].split() == ["KEY", "NAMESPACE", "MM", "IDENTIFIER", "SHAPE", "DTYPE", "SIZE", "CREATED",
                                "LAST", "ACCESS", "HITS"]
    assert len(lines) == 1 + M2_N + 2
    first = lines[1].split()
    assert first[0].startswith(M2 + "@1@0@") and re.fullmatch("[0-9a-f]{12}", first[1])
    assert first[2] == ident(0) and first[3] == "4x8"
    assert first[4] == "float16" and first[6] == "B" and first[-1] == "0" and "ago" in lines[1]
    assert lines[-2].startswith(f"shown: {M2_N} entries of model '{M2}'")
    assert lines[-1].startswith(f"total: {TOTAL_N} entries, ") and "KiB" in lines[-1]
    assert "cap unknown" in lines[-1]


def test_cap_and_path_come_from_the_config(template: Template, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "ec.yaml"
    cfg.write_text(f"local_disk: file://{template.path}\nmax_local_disk_size: 16\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(cfg))
    monkeypatch.setenv("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "0.5")
    doc = run("list", "--json", "--limit", "1").json()  # no PATH: local_disk of the config
    assert doc["store"] == str(template.path)
    total = doc["totals"]["bytes"]
    assert doc["totals"]["cap_bytes"] == 2**29
    assert doc["totals"]["cap_source"] == "env LMCACHE_EC_MAX_LOCAL_DISK_SIZE"
    assert doc["totals"]["cap_used"] == pytest.approx(total / 2**29)
    assert "cap 512.0 MiB (from env LMCACHE_EC_MAX_LOCAL_DISK_SIZE)" in run("list", "--limit", "0").out
    # A PATH that is another directory: the config's cap is not this store's.
    other = tmp_path / "other"
    shutil.copytree(template.path, other)
    assert run("list", other, "--json").json()["totals"]["cap_bytes"] is None
    # file:// URI as PATH
    assert run("list", f"file://{template.path}", "--json").json()["totals"]["cap_bytes"] == 2**29


# --------------------------------------------------------------------------
# show / export
# --------------------------------------------------------------------------


def test_show_by_key_and_by_mm_identifier(template: Template, console: Console) -> None:
    key = template_key(template, M1, 50)
    r = console.results["show"]
    assert r.rc == 0 and r.err == ""
    assert f"key:           {key}" in r.out and f"mm identifier: {ident(50)}" in r.out
    assert "hits:          3" in r.out and "blob check:    ok" in r.out
    assert 'tensor "ec": {"dtype": "BF16", "shape": [4, 8]' in r.out and "format:     ecstore/1" in r.out

    doc = run("show", template.path, key, "--json").json()
    assert doc["matched_by"] == "key" and len(doc["entries"]) == 1
    e = doc["entries"][0]
    assert e["check"] == "ok" and e["header"]["__metadata__"]["identifier"] == f"{e['namespace']}/{ident(50)}"
    assert e["identifier"] == ident(50) and e["identity"]["model"] == M1  # the registered identity
    assert e["header"]["ec"]["shape"] == [4, 8] and e["blob_bytes"] == e["bytes"]
    assert e["data_offset"] + e["tensor_bytes"] == e["bytes"]

    # An mm identifier held by two models: both shown; --model narrows.
    doc = run("show", template.path, ident(7), "--json").json()
    assert doc["matched_by"] == "identifier"
    assert sorted((e["model"], e["dtype"]) for e in doc["entries"]) == [(M1, "bfloat16"), (M2, "float16")]
    doc = run("show", template.path, ident(7), "--model", M2, "--json").json()
    assert [e["model"] for e in doc["entries"]] == [M2]
    assert run("show", template.path, ident(7)).out.startswith(f"2 entries hold mm identifier {ident(7)}:")


def test_show_path_from_config_with_one_positional(template: Template, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_EC_LOCAL_DISK", str(template.path))
    monkeypatch.setenv("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "1")
    doc = run("show", ident(1001), "--json").json()
    assert [e["model"] for e in doc["entries"]] == [M3]
    out = tmp_path / "x.safetensors"
    assert run("export", ident(1001), out).rc == 0 and out.exists()
    r = run("show", "a", "b", "c")
    assert r.rc == 2 and "expected [PATH] KEY_OR_MM_HASH" in one_error_line(r)


def test_export_round_trip_bit_exact(template: Template, console: Console, tmp_path: Path) -> None:
    key = template_key(template, M1, 3)
    out_key, out_id, out_amb = console.dir / "k.safetensors", tmp_path / "i.safetensors", tmp_path / "amb.safetensors"
    r_key = console.results["export"]
    r_amb = run("export", template.path, ident(3), out_amb)
    r_id = run("export", template.path, ident(3), out_id, "--model", M2)
    assert r_id.rc == 0, r_id.err
    assert r_key.rc == 0 and r_key.err == "" and "exported" in r_key.out
    for path, dtype, model in ((out_key, torch.bfloat16, M1), (out_id, torch.float16, M2)):
        with safe_open(str(path), framework="pt") as f:
            assert list(f.keys()) == ["ec"]
            t = f.get_tensor("ec")
            meta = f.metadata()
        want = tensor_for(3, dtype)
        assert t.dtype == dtype and t.shape == want.shape
        assert t.view(torch.uint8).flatten().tolist() == want.view(torch.uint8).flatten().tolist()
        assert meta["identifier"].endswith("/" + ident(3)) and meta["model"] == model
    # The file is exactly the stored blob.
    tier = LMDBTier(str(template.path), 0, readonly=True, create=False)
    try:
        assert out_key.read_bytes() == tier.blob_bytes(key)
    finally:
        tier.close()
    assert r_amb.rc == 2 and "2 entries hold mm identifier" in one_error_line(r_amb) and not out_amb.exists()


# --------------------------------------------------------------------------
# stats
# --------------------------------------------------------------------------


def test_stats_json(template: Template, console: Console) -> None:
    cfg = console.cfg
    r = console.results["stats"]
    assert r.rc == 0 and r.err == ""
    st = r.json()
    recs = records(template.path)
    by: dict[tuple[str, str], list[int]] = {}
    for key, rec in recs.items():
        g = by.setdefault((template.keys[key][0], rec.dtype), [0, 0])
        g[0] += 1
        g[1] += rec.blob_size
    assert {(g["model"], g["dtype"]): [g["entries"], g["bytes"]] for g in st["by_model"]} == by
    assert {(g["model"], g["dtype"]) for g in st["by_model"]} == {(M1, "bfloat16"), (M2, "float16"),
                                                                 (M3, "float32")}
    total = sum(r.blob_size for r in recs.values())
    assert st["entries"] == TOTAL_N and st["bytes"] == total == st["accounted_bytes"]
    assert st["cap_bytes"] == 2 * 2**30 and st["cap_source"] == f"{cfg}:2"
    assert st["cap_used"] == pytest.approx(total / 2**31)
    assert st["schema_version"] == 4 == st["schema_supported"]
    # one encoder identity per (model, dtype) here, each registered by its writer
    assert sorted((n["identity"]["model"], n["identity"]["dtype"], n["entries"]) for n in st["by_namespace"]) \
        == sorted((g["model"], g["dtype"], g["entries"]) for g in st["by_model"])
    lm = st["lmdb"]
    assert lm["file_size"] == (template.path / "data.mdb").stat().st_size
    assert lm["file_pages"] * lm["page_size"] == lm["file_size"]
    assert lm["tree_pages"] + lm["free_pages"] == lm["last_pgno"] + 1
    assert lm["trees"]["entries"]["entries"] == TOTAL_N == lm["trees"]["blobs"]["entries"] == lm["trees"]["lru"][
        "entries"]
    assert lm["map_size"] >= lm["file_size"]
    # Nobody else has the template open: any reader slot is this command's own or a dead process's.
    assert all(r["this_process"] or not r["alive"] for r in st["readers"])
    assert all(set(r) == {"pid", "thread", "txnid", "alive", "this_process"} for r in st["readers"])
    text = run("stats", template.path).out
    assert f"entries:        {TOTAL_N}" in text and "free pages:" in text and "readers:" in text
    assert "cap unknown" in text  # no config for this PATH in-process


def test_stats_reports_a_live_reader_of_another_process(store: Path) -> None:
    """A process holding the store open shows up as a live foreign reader
    slot (what test_stats_json relies on being absent when nobody else reads)."""
    holder = _holder(store, "ro")
    try:
        st = run("stats", store, "--json").json()
        text = run("stats", store).out
    finally:
        _release(holder)
    foreign = [r for r in st["readers"] if not r["this_process"]]
    assert [(r["pid"], r["alive"]) for r in foreign] == [(holder.pid, True)]
    assert f"readers:        1 slot(s) held by other processes ({holder.pid})" in text
    after = run("stats", store, "--json").json()
    assert all(r["this_process"] or not r["alive"] for r in after["readers"])


# --------------------------------------------------------------------------
# verify / purge --key
# --------------------------------------------------------------------------


def _pattern(n: int) -> bytes:
    out = b""
    seed = b"ecstore-dump corruption pattern"
    while len(out) < n:
        seed = hashlib.sha256(seed).digest()
        out += seed
    return out[:n]


def test_verify_finds_flipped_byte_then_purge_key_fixes(store: Path) -> None:
    pattern = _pattern(128 * 8 * 4)
    bad_t = torch.frombuffer(bytearray(pattern), dtype=torch.float32).reshape(128, 8).clone()
    with ECStore(disk_cfg(store), model="corrupt/me", dtype=torch.float32) as s:
        s.put("victim-image", bad_t)
        bad_key = s.key("victim-image")
    data = store / "data.mdb"
    raw = bytearray(data.read_bytes())
    needle = pattern[1000:1064]
    hits, at = [], raw.find(needle)
    while at != -1:
        hits.append(at)
        at = raw.find(needle, at + 1)
    assert hits, "blob bytes not found in data.mdb"
    for at in hits:  # every copy (LMDB may keep stale copies in free pages)
        raw[at + 10] ^= 0xFF
    data.write_bytes(bytes(raw))

    r, rj = dump("verify", store), run("verify", store, "--json")
    assert r.rc == 1 and r.err == ""
    bad_lines = [ln for ln in r.out.splitlines() if ln.startswith("BAD")]
    assert len(bad_lines) == 1 and bad_key in bad_lines[0] and "checksum mismatch" in bad_lines[0]
    assert f"verified {TOTAL_N + 1} entries" in r.out and "1 bad" in r.out
    doc = rj.json()
    assert rj.rc == 1 and doc["checked"] == TOTAL_N + 1 and doc["ok"] == TOTAL_N
    assert [(b["key"], b["identifier"]) for b in doc["bad"]] == [(bad_key, "victim-image")]

    shown = run("show", store, bad_key, "--json").json()["entries"][0]
    assert shown["check"].startswith("checksum mismatch")
    out = store.parent / "bad.safetensors"
    r = run("export", store, bad_key, out)
    assert r.rc == 2 and "corrupt" in one_error_line(r) and not out.exists()

    r = run("purge", store, "--key", bad_key)
    assert r.rc == 0 and r.out.startswith("removed 1 entry (") and r.err == ""
    r = run("verify", store)
    assert r.rc == 0 and f"verified {TOTAL_N} entries" in r.out and "0 bad" in r.out
    assert len(records(store)) == TOTAL_N


# --------------------------------------------------------------------------
# purge
# --------------------------------------------------------------------------


def test_purge_by_model_key_and_all(store: Path) -> None:
    before = records(store)
    r = run("purge", store, "--model", M2, "--dry-run")
    assert r.rc == 0 and r.out.count("would remove  ") == M2_N and f"would remove {M2_N} entries" in r.out
    assert records(store) == before  # dry run changes nothing

    r = run("purge", store, "--model", M2)
    assert r.rc == 0 and r.out.startswith(f"removed {M2_N} entries")
    after = records(store)
    assert set(after) == {k for k in before if not k.startswith(M2 + "@")}
    assert all(after[k] == before[k] for k in after)  # others untouched (hits, LRU position...)
    st = run("stats", store, "--json").json()
    assert st["bytes"] == st["accounted_bytes"] == sum(r.blob_size for r in after.values())

    # --key with an mm identifier removes every entry holding it (M1 only now).
    r = run("purge", store, "--key", ident(5), "-v")
    assert r.rc == 0 and "removed 1 entry (" in r.out
    assert not any(v.identifier == ident(5) for v in records(store).values())

    assert run("purge", store, "--all").rc == 0
    assert records(store) == {}
    st = run("stats", store, "--json").json()
    assert st["entries"] == 0 and st["accounted_bytes"] == 0


def test_purge_by_age(store: Path) -> None:
    r = run("purge", store, "--older-than", "1000w", "--dry-run")
    assert r.rc == 0 and "would remove 0 entries" in r.out
    assert run("purge", store, "--older-than", "1000w").out.startswith("nothing to remove")
    assert len(records(store)) == TOTAL_N

    r = run("purge", store, "--older-than", "0s", "--model", M3)  # everything of M3 was used before now
    assert r.rc == 0 and r.out.startswith(f"removed {M3_N} entries")
    recs = records(store)
    assert len(recs) == TOTAL_N - M3_N and not any(k.startswith(M3 + "@") for k in recs)

    # An absolute cutoff between the entries' last-access times: exactly the older ones go.
    m1 = {k: r for k, r in recs.items() if k.startswith(M1 + "@")}
    newest = max(r.last_access_ns for r in m1.values())
    cutoff_iso = cli.iso(newest)
    cutoff_ns = cli.parse_older_than(cutoff_iso, 0)
    expect_gone = {k for k, r in m1.items() if r.last_access_ns < cutoff_ns}
    assert 0 < len(expect_gone) < len(m1)
    r = run("purge", store, "--model", M1, "--older-than", cutoff_iso)
    assert r.rc == 0 and r.out.startswith(f"removed {len(expect_gone)} entries")
    assert set(records(store)) == set(recs) - expect_gone


def test_purge_never_evicts_even_when_the_configured_cap_is_smaller(store: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A writable LMDBTier evicts down to its cap when opened; purge must not."""
    monkeypatch.setenv("LMCACHE_EC_LOCAL_DISK", str(store))
    monkeypatch.setenv("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "0.00001")  # ~10 KiB, far below the store
    before = records(store)
    doc = run("list", "--json", "--limit", "0").json()
    assert doc["totals"]["cap_bytes"] == int(0.00001 * 2**30) and doc["totals"]["cap_used"] > 1
    key = sorted(before)[0]
    r = run("purge", "--key", key)
    assert r.rc == 0 and r.out.startswith("removed 1 entry (")
    after = records(store)
    assert set(after) == set(before) - {key} and all(after[k] == before[k] for k in after)


def test_purge_argument_errors(store: Path) -> None:
    before = sha(store / "data.mdb")
    for args in (["purge", store], ["purge", store, "--all", "--model", M1],
                 ["purge", store, "--older-than", "7 days"], ["purge", store, "--key", "no-such-entry"]):
        r = run(*args)
        assert r.rc == 2 and r.out == "", args
        one_error_line(r)
    assert sha(store / "data.mdb") == before


def test_parse_older_than_units_and_timestamps() -> None:
    now = 10**18
    assert cli.parse_older_than("90s", now) == now - 90 * 10**9
    assert cli.parse_older_than("7d", now) == now - 7 * 86400 * 10**9
    assert cli.parse_older_than("2w", now) == now - 14 * 86400 * 10**9
    assert cli.parse_older_than("1.5h", now) == now - 5400 * 10**9
    assert cli.parse_older_than("30m", now) == now - 1800 * 10**9
    assert cli.parse_older_than("1970-01-01T00:00:01.000002Z", now) == 10**9 + 2000
    assert cli.parse_older_than("1970-01-01T01:00:00+01:00", now) == 0
    assert cli.iso(10**9 + 2999) == "1970-01-01T00:00:01.000002+00:00"
    assert cli.human_size(1536) == "1.5 KiB" and cli.human_size(12) == "12 B"
    assert cli.human_age(0, 3 * 86400 * 10**9) == "3d ago"


# --------------------------------------------------------------------------
# concurrency
# --------------------------------------------------------------------------


def test_readonly_commands_while_another_process_writes(store: Path, tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, str(HELPERS / "cli_writer.py"), str(store), str(stop), "writer/m"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        assert writer.stdout is not None
        first = writer.stdout.readline()
        assert first.startswith("committed"), writer.stderr.read() if writer.stderr else first
        seen = []
        lst, st = dump_many([["list", store, "--json"], ["stats", store, "--json"]])
        for r in (lst, st):
            assert r.rc == 0 and r.err == "", r.err
        seen.append(_check_snapshot(lst.json(), st.json()))
        for _ in range(3):
            # Wait for a commit the last reads cannot have seen (no timing:
            # the writer's own report), then read again while it goes on.
            _wait_for_commit_beyond(writer, seen[-1])
            for _ in range(2):  # in-process too (same code, no interpreter start-up)
                lst, st = run("list", store, "--json"), run("stats", store, "--json")
                assert lst.rc == 0 and st.rc == 0, lst.err + st.err
                seen.append(_check_snapshot(lst.json(), st.json()))
        assert seen == sorted(seen) and seen[-1] > seen[0]  # the writer made progress meanwhile
        assert seen[1] > seen[0] and seen[3] > seen[1] and seen[5] > seen[3]
    finally:
        stop.touch()
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    summary = json.loads(out.splitlines()[-1])
    assert summary["write_errors"] == 0 and summary["bad"] == []
    doc = run("list", store, "--json", "--model", "writer/m").json()
    assert len(doc["entries"]) == summary["puts"] and doc["totals"]["entries"] == TOTAL_N + summary["puts"]
    assert run("verify", store).rc == 0


def _wait_for_commit_beyond(writer: subprocess.Popen[str], n: int) -> int:
    """Read the writer's ``committed N`` lines until N > ``n``; returns N."""
    assert writer.stdout is not None
    while True:
        line = writer.stdout.readline()
        assert line.startswith("committed "), line or (writer.stderr.read() if writer.stderr else "EOF")
        count = int(line.split()[1])
        if count > n:
            return count


def _check_snapshot(lst: dict[str, Any], st: dict[str, Any]) -> int:
    """Each output is self-consistent; returns the writer's entry count seen by list."""
    assert lst["totals"]["entries"] == len(lst["entries"]) >= TOTAL_N
    assert lst["totals"]["bytes"] == sum(e["bytes"] for e in lst["entries"])
    assert st["bytes"] == sum(g["bytes"] for g in st["by_model"])
    assert st["entries"] == sum(g["entries"] for g in st["by_model"]) >= TOTAL_N
    fixed = {(g["model"], g["entries"]) for g in st["by_model"] if g["model"] != "writer/m"}
    assert fixed == {(M1, M1_N), (M2, M2_N), (M3, M3_N)}
    return sum(1 for e in lst["entries"] if e["model"] == "writer/m")


def test_readonly_commands_change_nothing(store: Path, tmp_path: Path) -> None:
    before_data, before_recs = sha(store / "data.mdb"), records(store)
    key = next(iter(before_recs))
    for args in (["list", store], ["list", store, "--json", "--sort", "lru"], ["show", store, key],
                 ["show", store, ident(1)], ["stats", store], ["verify", store],
                 ["export", store, key, tmp_path / "o.safetensors"], ["purge", store, "--all", "--dry-run"]):
        assert run(*args).rc == 0, args
    assert sha(store / "data.mdb") == before_data
    assert records(store) == before_recs


# --------------------------------------------------------------------------
# compact
# --------------------------------------------------------------------------


def _holder(store: Path, mode: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, str(HELPERS / "cli_holder.py"), str(store), mode],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env())
    assert p.stdout is not None and p.stdout.readline() == "open\n"
    return p


def _release(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.close()
    assert p.wait(timeout=60) == 0


def test_compact_refused_while_open_elsewhere_then_shrinks(store: Path) -> None:
    assert run("purge", store, "--model", M1).rc == 0  # frees most pages
    data = store / "data.mdb"
    size0, sha0, recs0 = data.stat().st_size, sha(data), records(store)

    holder = _holder(store, "rw")  # a writer, as vLLM holds it
    try:
        r = dump("compact", store)
        assert r.rc == 3 and r.out == ""
        line = one_error_line(r)
        assert f"pid {holder.pid}" in line and "Nothing was changed" in line
    finally:
        _release(holder)
    holder = _holder(store, "ro")  # a plain reader: refused too
    try:
        r = run("compact", store)
        assert r.rc == 3 and f"pid {holder.pid}" in one_error_line(r)
    finally:
        _release(holder)
    assert sha(data) == sha0 and data.stat().st_size == size0
    assert not [p for p in store.iterdir() if p.name.startswith(maintenance.COMPACT_PREFIX)]

    r = dump("compact", store)
    assert r.rc == 0 and r.err == "" and r.out.startswith(f"compacted {store}")
    assert data.stat().st_size < size0 * 0.8
    assert records(store) == recs0
    assert not [p for p in store.iterdir() if p.name.startswith(maintenance.COMPACT_PREFIX)]
    assert run("verify", store).rc == 0
    # The store stays fully usable: reads bit-exact, writes, reopen.
    with ECStore(disk_cfg(store), model=M2, dtype=torch.float16) as s:
        assert torch.equal(s.get(ident(9)), tensor_for(9, torch.float16))
        s.put("after-compact", tensor_for(77, torch.float16))
    with ECStore(disk_cfg(store), model=M2, dtype=torch.float16, readonly=True) as s:
        assert torch.equal(s.get("after-compact"), tensor_for(77, torch.float16))


def test_compact_refused_while_open_in_this_process(store: Path) -> None:
    tier = LMDBTier(str(store), 2**30, readonly=False, create=False)
    try:
        before = sha(store / "data.mdb")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(["compact", str(store)])
        assert rc == 3 and "open in this process" in err.getvalue()
        assert sha(store / "data.mdb") == before
        assert tier.entry_count() == TOTAL_N
    finally:
        tier.close()


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------


def _newer_schema(path: Path) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"schema_version", b"999", db=meta)
    env.close()


def test_errors_exit_2_one_line_nothing_changed(store: Path, tmp_path: Path) -> None:
    notastore = tmp_path / "notastore"
    notastore.mkdir()
    (notastore / "hello.txt").write_text("hi")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "data.mdb").write_bytes(os.urandom(8192))
    foreign = tmp_path / "foreign"  # an LMDB environment that is not ecstore's
    env = lmdb.open(str(foreign), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v", db=env.open_db(b"other", txn=txn))
    env.close()
    newer = tmp_path / "newer"
    shutil.copytree(store, newer)
    _newer_schema(newer)
    states = {p: tree_state(p) for p in (notastore, garbage, foreign, newer, store)}

    cases = [
        (["list", notastore], "not an ecstore store"),
        (["verify", newer], "schema version 999"),
        (["stats", tmp_path / "missing"], "no such directory"),
        (["show", store, "no-such-key-or-identifier"], "no entry with key or mm identifier"),
        (["list", garbage, "--json"], "not an LMDB file"),
        (["stats", foreign], "not an ecstore store"),
    ]
    results = dump_many([c for c, _ in cases[:2]]) + [run(*c) for c, _ in cases[2:]]
    for (args, needle), r in zip(cases, results):
        assert r.rc == 2 and r.out == "", (args, r)
        assert needle in one_error_line(r), (args, r.err)
    # The same in-process, plus the commands that would write.
    for args in (["purge", newer, "--all"], ["compact", newer], ["export", newer, "x", tmp_path / "x.st"],
                 ["purge", notastore, "--all"], ["compact", garbage], ["show", foreign, "k"],
                 ["list", "s3://bucket/x"]):
        r = run(*args)
        assert r.rc == 2 and r.out == "", (args, r)
        one_error_line(r)
    for p, state in states.items():
        if p in (newer, store, foreign):  # lock.mdb holds LMDB's reader table: compare data only
            assert sha(p / "data.mdb") == state["data.mdb"], p
        else:
            assert tree_state(p) == state, p
    assert not (tmp_path / "missing").exists() and not (tmp_path / "x.st").exists()


def test_no_path_and_no_config_is_an_error() -> None:
    r = run("list")
    assert r.rc == 2 and "no store given" in one_error_line(r)


# --------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------


def test_config_shows_every_value_and_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    yaml_path = tmp_path / "lmcache.yaml"
    yaml_path.write_text(
        "chunk_size: 256\n"
        "local_cpu: true\n"
        "max_local_cpu_size: 2\n"
        f"local_disk: \"file://{tmp_path}/ec\"\n"
        "max_local_disk_size: 16\n"
        "ec_max_local_disk_size: 64\n"
    )
    env = clean_env(LMCACHE_CONFIG_FILE=str(yaml_path), LMCACHE_EC_MAX_LOCAL_DISK_SIZE="32")
    r_json = dump("config", "--json", env=env)
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(yaml_path))
    monkeypatch.setenv("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "32")
    r_text = run("config")
    assert r_json.rc == 0 and r_json.err == ""
    doc = r_json.json()
    v = doc["values"]
    assert doc["config_file"] == str(yaml_path)
    assert v["config_file"] == {"value": str(yaml_path), "source": "env LMCACHE_CONFIG_FILE"}
    assert v["max_local_disk_size"] == {"value": 32.0, "source": "env LMCACHE_EC_MAX_LOCAL_DISK_SIZE"}
    assert v["local_disk"] == {"value": f"{tmp_path}/ec", "source": f"{yaml_path}:4"}
    assert v["max_local_cpu_size"] == {"value": 2.0, "source": f"{yaml_path}:3"}
    assert v["lease_seconds"]["source"] == "default"
    assert doc["disk_capacity_bytes"] == 32 * 2**30
    lines = {ln.split()[0]: ln.split() for ln in r_text.out.splitlines() if ln}
    assert lines["max_local_disk_size"][1:] == ["32.0", "env", "LMCACHE_EC_MAX_LOCAL_DISK_SIZE"]
    assert lines["local_disk"][1:] == [f"{tmp_path}/ec", f"{yaml_path}:4"]
    assert lines["local_cpu"][1:] == ["true", f"{yaml_path}:2"]
    # --config FILE wins over LMCACHE_CONFIG_FILE (LMCACHE_EC_* would still win over the file).
    monkeypatch.delenv("LMCACHE_EC_MAX_LOCAL_DISK_SIZE")
    other = tmp_path / "other.yaml"
    other.write_text("ec_max_local_disk_size: 8\n")
    doc = run("config", "--config", other, "--json").json()
    assert doc["values"]["config_file"]["source"] == "argument path"
    assert doc["values"]["max_local_disk_size"] == {"value": 8.0, "source": f"{other}:1"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("ec_max_local_disk_size: lots\n")
    r = run("config", "--config", bad)
    assert r.rc == 2 and "max_local_disk_size" in one_error_line(r)


# --------------------------------------------------------------------------
# progress, schema 1
# --------------------------------------------------------------------------


def test_progress_bar_only_on_a_terminal(template: Template) -> None:
    master, slave = pty.openpty()
    p = subprocess.Popen(DUMP + ["verify", str(template.path)], stdout=subprocess.PIPE, stderr=slave,
                         stdin=subprocess.DEVNULL, env=clean_env())
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the terminal's last writer is gone
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    out, _ = p.communicate(timeout=120)
    tty = b"".join(chunks).decode()
    assert p.returncode == 0 and f"verified {TOTAL_N} entries" in out.decode()
    assert "\r" in tty and "verifying [" in tty and f"{TOTAL_N}/{TOTAL_N}" in tty
    assert "verifying" not in out.decode()  # stdout (a pipe) carries no progress
    # With stderr piped (every other test) nothing but errors reach stderr.
    assert run("verify", template.path).err == ""


def test_schema_1_store_is_read_without_migrating(tmp_path: Path) -> None:
    path = tmp_path / "v1"
    with open_store_at_schema(disk_cfg(path), 1, model=M1, dtype=torch.bfloat16) as s:
        for i in range(5):
            s.put(ident(i), tensor_for(i, torch.bfloat16))
    doc = run("list", path, "--json", "--sort", "lru").json()
    assert doc["schema_version"] == 1 and len(doc["entries"]) == 5
    assert run("verify", path).rc == 0
    assert run("stats", path, "--json").json()["schema_version"] == 1
    assert run("purge", path, "--key", ident(0)).rc == 0
    env = lmdb.open(str(path), readonly=True, max_dbs=8)
    with env.begin() as txn:
        assert bytes(txn.get(b"schema_version", db=env.open_db(b"meta", txn=txn))) == b"1"
    env.close()
    assert len(run("list", path, "--json").json()["entries"]) == 4


def test_struct_layout_assumption_matches_lmdb(template: Template) -> None:
    """_precheck_store reads LMDB's magic at byte 16 of data.mdb."""
    head = (template.path / "data.mdb").read_bytes()[:24]
    assert struct.unpack_from("=I", head, 16)[0] == maintenance.LMDB_MAGIC
