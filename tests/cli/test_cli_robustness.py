"""``ecstore-dump`` against hostile store contents and odd arguments (hostile
headers, planted symlinks at export, odd arguments, output that cannot be
written): one clear line and exit status 2 (or a BAD report from ``verify``),
never a traceback, a hang or a followed symlink. Real stores, real
console-script subprocesses where argv bytes or hangs matter, in-process
``cli.main`` otherwise."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import stat
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from safetensors.torch import load_file

from ecstore import ECStore, ECStoreConfig, cli
from ecstore.format import codec
from ecstore.lmdb.env import _SharedEnv

_SCRIPT = Path(sys.executable).parent / "ecstore-dump"
DUMP = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "ecstore.cli"]
MODEL = "org/robust"
N = 6


@pytest.fixture(autouse=True)
def _no_ambient_config(no_lmcache_env: None) -> None:
    """Only the test configures ecstore."""


def tensor_for(i: int) -> torch.Tensor:
    return (torch.arange(32, dtype=torch.float32).reshape(4, 8) / 8 + i).to(torch.float16)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    with ECStore(ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=0.01),
                 model=MODEL, dtype=torch.float16) as s:
        for i in range(N):
            s.put(f"img-{i}", tensor_for(i))
        s.flush()
    return path


def key_for(path: Path, i: int) -> str:
    """The stored key of ``img-{i}`` in the fixture's store."""
    with ECStore(ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=0.01),
                 model=MODEL, dtype=torch.float16, readonly=True) as s:
        return s.key(f"img-{i}")


def keys_of(path: Path) -> list[bytes]:
    env = lmdb.open(str(path), max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return [bytes(k) for k, _ in txn.cursor(db=env.open_db(b"entries", txn=txn, create=False))]
    finally:
        env.close()


def rewrite_entry(path: Path, key: bytes, header_edit: Any, *, shape: tuple[int, ...] | None = None,
                  new_key: bytes | None = None) -> None:
    """Rewrite one entry's safetensors header with ``header_edit(header)`` and
    store it (under ``new_key`` if given) with a record that agrees with it:
    checksum and size recomputed, the record's shape set to ``shape``. What
    a writer with access to the file can do."""
    env = lmdb.open(str(path), max_dbs=8)
    try:
        blobs = env.open_db(b"blobs")
        entries = env.open_db(b"entries")
        meta = env.open_db(b"meta")
        lru = env.open_db(b"lru")
        with env.begin(write=True) as txn:
            blob = bytes(txn.get(key, db=blobs))
            rec = codec.unpack_record(txn.get(key, db=entries))
            (hlen,) = struct.unpack_from("<Q", blob, 0)
            header = json.loads(blob[8:8 + hlen])
            if new_key is not None:  # a copy under its own identifier
                header["__metadata__"]["identifier"] += "-copy"
            header_edit(header)
            hb = json.dumps(header).encode()
            hb += b" " * (-len(hb) % 8)
            new = struct.pack("<Q", len(hb)) + hb + blob[8 + hlen:]
            rec = codec.Record(rec.identifier, rec.dtype, shape or rec.shape, rec.nbytes, len(new),
                               codec.checksum(new), rec.created_ns, rec.last_access_ns, rec.hits, rec.lru_seq)
            target = new_key or key
            if new_key is not None:
                total = struct.unpack("<Q", txn.get(b"total_bytes", db=meta))[0]
                txn.put(b"total_bytes", struct.pack("<Q", total + len(new)), db=meta)
                seq = struct.unpack("<Q", txn.get(b"next_seq", db=meta))[0]
                txn.put(b"next_seq", struct.pack("<Q", seq + 1), db=meta)
                rec = codec.Record(rec.identifier + "-copy", rec.dtype, rec.shape, rec.nbytes, rec.blob_size,
                                   rec.checksum, rec.created_ns, rec.last_access_ns, rec.hits, seq)
                txn.put(struct.pack(">Q", seq), target, db=lru)
            txn.put(target, new, db=blobs)
            txn.put(target, codec.pack_record(rec), db=entries)
    finally:
        env.close()


def _same(header: dict[str, Any]) -> None:
    """No header change."""


def run(*args: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([a if isinstance(a, str) else os.fsdecode(a) for a in map(_arg, args)])
    assert not _SharedEnv._open, "the command left a store open"
    return rc, out.getvalue(), err.getvalue()


def _arg(a: Any) -> str | bytes:
    return a if isinstance(a, (str, bytes)) else str(a)


def console(*args: Any, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    """The console script with raw argv bytes (no decoding on our side)."""
    argv = [os.fsencode(a) if isinstance(a, str) else (a if isinstance(a, bytes) else os.fsencode(str(a)))
            for a in args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    return subprocess.run([os.fsencode(x) for x in DUMP] + argv, capture_output=True, timeout=timeout,
                          env=env, stdin=subprocess.DEVNULL, check=False)


def one_line_error(err: str | bytes) -> str:
    text = err.decode("utf-8", "replace") if isinstance(err, bytes) else err
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ecstore-dump: error: ") and "Traceback" not in text, text
    return lines[0]


# --------------------------------------------------------------------------
# Hostile safetensors headers
# --------------------------------------------------------------------------


def _meta(field: str, value: Any) -> Any:
    def edit(h: dict[str, Any]) -> None:
        h["__metadata__"][field] = value
    return edit


def _negative_offsets(h: dict[str, Any]) -> None:
    # Claims [5, 8] float16 = 80 bytes starting 16 bytes before the data: the
    # header's last 16 bytes would be handed out as tensor data.
    h["ec"]["data_offsets"] = [-16, 64]
    h["ec"]["shape"] = [5, 8]
    h["__metadata__"]["shape"] = "[5, 8]"


HOSTILE = {
    "dtype-int": (_meta("dtype", 5), None),
    "dtype-null": (_meta("dtype", None), None),
    "shape-negative": (_meta("shape", "[-4, -8]"), (4, 8)),
    "shape-overflow": (_meta("shape", f"[{2**70}, 8]"), (4, 8)),
    "shape-not-list": (_meta("shape", "5"), (4, 8)),
    "identifier-int": (_meta("identifier", 7), None),
    "offsets-negative": (_negative_offsets, (5, 8)),
    "offsets-strings": (lambda h: h["ec"].__setitem__("data_offsets", ["a", "b"]), None),
    "tensor-not-dict": (lambda h: h.__setitem__("ec", 5), None),
}


def test_verify_reports_every_hostile_header_and_goes_on(store: Path) -> None:
    keys = keys_of(store)
    hostile = dict(zip(HOSTILE, keys))
    for name, key in hostile.items():
        edit, shape = HOSTILE[name]
        rewrite_entry(store, key, edit, shape=shape)
    for name in list(HOSTILE)[len(keys):]:  # more cases than entries: add copies
        src = keys[0]
        new_key = src.replace(b"@1@0@", f"@1@0@{name}".encode())
        rewrite_entry(store, src, _same, new_key=new_key)
        edit, shape = HOSTILE[name]
        rewrite_entry(store, new_key, edit, shape=shape)
        hostile[name] = new_key
    rc, out, err = run("verify", store, "--json")
    assert err == "" and rc == 1
    doc = json.loads(out)
    bad = {b["key"].encode(): b["error"] for b in doc["bad"]}
    assert set(bad) == set(hostile.values()), (bad, hostile)
    assert doc["checked"] == len(keys_of(store)) and doc["ok"] == doc["checked"] - len(hostile)
    rc, out, err = run("verify", store)
    assert rc == 1 and "Traceback" not in err and out.count("BAD ") == len(hostile)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_show_and_export_of_a_hostile_header(store: Path, tmp_path: Path, name: str) -> None:
    key = keys_of(store)[0]
    edit, shape = HOSTILE[name]
    rewrite_entry(store, key, edit, shape=shape)
    rc, out, err = run("show", store, key.decode())
    assert rc == 0 and err == "" and re.search(r"blob check:\s+bad safetensors header", out), out
    rc, out, err = run("show", store, key.decode(), "--json")
    assert rc == 0 and json.loads(out)["entries"][0]["check"] != "ok"
    dest = tmp_path / "out.safetensors"
    rc, out, err = run("export", store, key.decode(), dest)
    assert rc == 2 and "corrupt" in one_line_error(err) and not dest.exists()


# --------------------------------------------------------------------------
# Export never follows a planted symlink
# --------------------------------------------------------------------------


def test_export_does_not_follow_a_symlink_at_the_temporary_name(store: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "shared" / "e.safetensors"
    out.parent.mkdir()
    # The old predictable temporary name, and a symlink at the final name.
    os.symlink(victim, f"{out}.tmp-{os.getpid()}")
    key = key_for(store, 1)
    rc, text, err = run("export", store, key, out)
    assert rc == 0, err
    assert victim.read_bytes() == b"precious"
    assert not out.is_symlink() and stat.S_ISREG(out.lstat().st_mode)
    assert torch.equal(load_file(str(out))["ec"], tensor_for(1))
    # A symlink planted at OUT itself is refused (it was replaced), its target untouched.
    out.unlink()
    os.symlink(victim, out)
    rc, _, err = run("export", store, key, out)
    assert rc == 2 and "symbolic link" in one_line_error(err)
    assert victim.read_bytes() == b"precious" and out.is_symlink()
    leftovers = [p.name for p in out.parent.iterdir() if p.name != out.name and not p.is_symlink()]
    assert leftovers == []


def _special(kind: str, at: Path) -> None:
    """Make a file of ``kind`` at ``at``."""
    if kind == "fifo":
        os.mkfifo(at)
    elif kind == "socket":
        import socket
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(at))
        sock.close()
    elif kind == "char device":  # a copy of /dev/null (root only)
        try:
            os.mknod(at, 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
        except PermissionError:
            pytest.skip("creating a device needs root")
    elif kind == "symlink to stdout":  # what /dev/stdout is
        os.symlink("/proc/self/fd/1", at)
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["char device", "fifo", "socket", "symlink to stdout"])
def test_export_never_replaces_what_is_not_a_regular_file(store: Path, tmp_path: Path, kind: str) -> None:
    """export renamed its file over whatever sat at OUT: a copy of /dev/null
    became a regular file, /dev/stdout a file. Only a new name or a regular
    file is written; the rest is refused and left as it was."""
    out = tmp_path / "out"
    _special(kind, out)
    before = os.lstat(out)
    rc, text, err = run("export", store, key_for(store, 1), out)
    assert rc == 2 and text == "" and "'-'" in one_line_error(err), err
    after = os.lstat(out)
    assert (after.st_ino, after.st_mode, after.st_rdev) == (before.st_ino, before.st_mode, before.st_rdev)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "store"]  # no temporary file left


@pytest.mark.parametrize("name", ["data.mdb", "lock.mdb", "leases.mdb", "e.safetensors"])
def test_export_never_writes_into_a_store(store: Path, tmp_path: Path, name: str) -> None:
    """``export STORE KEY STORE/data.mdb`` replaced the store's own data file
    (the store no longer opened): no file of a store directory (any store's,
    this one's too) is written, new or not."""
    def files() -> tuple[dict[str, int], bytes]:  # (inode of each file, data.mdb's bytes)
        return {p.name: p.lstat().st_ino for p in store.iterdir()}, (store / "data.mdb").read_bytes()

    before = files()
    other = tmp_path / "other"
    with ECStore(ECStoreConfig(local_cpu=False, local_disk=str(other), max_local_disk_size=0.01),
                 model=MODEL, dtype=torch.float16):
        pass
    for target in (store / name, other / name):
        rc, text, err = run("export", store, key_for(store, 1), target)
        assert rc == 2 and text == "" and "ecstore store" in one_line_error(err), err
    assert files() == before
    assert not (other / "e.safetensors").exists()
    assert run("verify", store)[0] == 0


def test_export_to_dash_writes_the_entry_to_standard_output(store: Path, tmp_path: Path) -> None:
    """``-`` is standard output (it was a file named "-"): the exact
    safetensors bytes there, the report on stderr."""
    key = key_for(store, 2)
    raw = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    err = io.StringIO()
    with contextlib.redirect_stdout(raw), contextlib.redirect_stderr(err), contextlib.chdir(tmp_path):
        rc = cli.main(["export", str(store), key, "-"])
    raw.flush()
    assert rc == 0 and not (tmp_path / "-").exists(), err.getvalue()
    data = raw.buffer.getvalue()  # type: ignore[attr-defined]
    from safetensors.torch import load
    assert torch.equal(load(data)["ec"], tensor_for(2))
    assert "exported" in err.getvalue() and "standard output" in err.getvalue()
    # Over an existing regular file: replaced, as before.
    out = tmp_path / "e.safetensors"
    out.write_bytes(b"old")
    assert run("export", store, key, out)[0] == 0
    assert torch.equal(load_file(str(out))["ec"], tensor_for(2))


def test_export_into_a_missing_directory_is_one_line(store: Path, tmp_path: Path) -> None:
    rc, _, err = run("export", store, keys_of(store)[1].decode(), tmp_path / "nope" / "e.safetensors")
    assert rc == 2 and "cannot write" in one_line_error(err)


# --------------------------------------------------------------------------
# Odd arguments
# --------------------------------------------------------------------------


@pytest.mark.parametrize("age", ["9" * 400 + "d", "1e400w", "99999999999999999999999w", "0001-01-01T00:00:00"])
def test_purge_older_than_out_of_range(store: Path, age: str) -> None:
    before = keys_of(store)
    rc, _, err = run("purge", store, "--older-than", age)
    assert rc == 2 and "--older-than" in one_line_error(err)
    assert keys_of(store) == before


def test_non_utf8_arguments(store: Path, tmp_path: Path) -> None:
    r = console("show", store, b"\xff\xfekey")
    assert r.returncode == 2 and b"no entry" in r.stderr and b"\\xff\\xfe" in r.stderr
    one_line_error(r.stderr)
    r = console("list", os.fsencode(str(tmp_path)) + b"/\xff")
    assert r.returncode == 2
    one_line_error(r.stderr)
    r = console("purge", store, "--key", b"\xffnot-there", "--dry-run")
    assert r.returncode == 2
    one_line_error(r.stderr)


@pytest.mark.parametrize("special", ["/dev/zero", "/dev/urandom"])
def test_config_from_a_device_is_refused_quickly(special: str) -> None:
    r = console("config", "--config", special, timeout=60)
    assert r.returncode == 2 and b"regular file" in r.stderr
    one_line_error(r.stderr)


@pytest.mark.parametrize("empty", ["", "  "])
def test_empty_config_argument_is_refused_not_replaced_by_the_env_file(tmp_path: Path, empty: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``--config ""`` (an unset shell variable) read $LMCACHE_CONFIG_FILE instead."""
    env_file = tmp_path / "env.yaml"
    env_file.write_text(f"ec_local_disk: {tmp_path / 'from-env'}\nec_max_local_disk_size: 3\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(env_file))
    for argv in (["config", "--config", empty], ["list", "--config", empty], ["stats", "--config", empty]):
        rc, out, err = run(*argv)
        assert rc == 2 and out == "" and "--config" in one_line_error(err) and "empty" in err, (argv, out, err)
    assert str(env_file) in run("config")[1]  # without --config, the variable is read
    from ecstore.config import load_config
    from ecstore.errors import ConfigError
    with pytest.raises(ConfigError, match="empty"):
        load_config(empty, env={"LMCACHE_CONFIG_FILE": str(env_file)})


def test_oversized_config_file_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("# filler\n" * 200_000)
    rc, _, err = run("config", "--config", big)
    assert rc == 2 and "larger than" in one_line_error(err)


def test_non_utf8_key_in_the_store_is_listed_shown_and_purged(store: Path) -> None:
    src = keys_of(store)[2]
    odd = src.replace(b"@1@0@", b"@1@0@\xff\xfe")
    rewrite_entry(store, src, _same, new_key=odd)
    assert odd in keys_of(store)
    r = console("list", store, "--json")
    assert r.returncode == 0, r.stderr
    listed = [e["key"] for e in json.loads(r.stdout)["entries"]]
    assert len(listed) == N + 1 and any("\\xff\\xfe" in k for k in listed)
    r = console("list", store)
    assert r.returncode == 0 and b"\\xff\\xfe" in r.stdout
    r = console("verify", store)
    assert r.returncode == 0, r.stdout + r.stderr
    r = console("show", store, odd)
    assert r.returncode == 0 and re.search(rb"blob check:\s+ok\n", r.stdout), r.stdout + r.stderr
    r = console("purge", store, "--key", odd)
    assert r.returncode == 0 and b"removed 1 entry" in r.stdout, r.stderr
    assert odd not in keys_of(store) and len(keys_of(store)) == N
    r = console("verify", store, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["checked"] == N


# --------------------------------------------------------------------------
# Output that cannot be written
# --------------------------------------------------------------------------
NO_ROOM = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


def _on_full_disk(store: Path, argv: list[str]) -> list[str]:
    return [*argv[:1], *([] if argv[0] == "config" else [str(store)]), *argv[1:]]


@NO_ROOM
@pytest.mark.parametrize("argv", [["list"], ["list", "--json"], ["verify"], ["verify", "--json"], ["stats"],
                                  ["show", "img-0"], ["config", "--json"]],
                         ids=["list", "list-json", "verify", "verify-json", "stats", "show", "config-json"])
def test_output_that_cannot_be_written_is_one_line_and_its_own_exit_status(store: Path, argv: list[str]) -> None:
    """Standard output on a full disk (/dev/full) ended in an OSError
    traceback and exit 1, the status of "verify found bad entries": one
    line on stderr and ExitCode.OUTPUT. (In-process, stdout a real file
    on /dev/full; the console script below.)"""
    err = io.StringIO()
    with open("/dev/full", "w") as full, contextlib.redirect_stdout(full), contextlib.redirect_stderr(err):
        rc = cli.main(_on_full_disk(store, argv))
    assert rc == cli.ExitCode.OUTPUT, err.getvalue()
    assert "cannot write" in one_line_error(err.getvalue()) and "No space left on device" in err.getvalue()


@NO_ROOM
def test_output_that_cannot_be_written_by_the_console_script(store: Path) -> None:
    """The same from the console script: its exit status, and nothing more
    said when the interpreter flushes standard output at exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    with open("/dev/full", "wb") as full:
        r = subprocess.run(DUMP + _on_full_disk(store, ["list", "--json"]), stdout=full, stderr=subprocess.PIPE,
                           stdin=subprocess.DEVNULL, env=env, timeout=120, check=False)
    assert r.returncode == cli.ExitCode.OUTPUT, r.stderr.decode()
    assert "cannot write" in one_line_error(r.stderr)
