"""The security model (docs/security.md), on real files and real
processes of other users (the suite runs as root; children drop to
``nobody`` after start-up, see helpers/as_user.py).

* private by default: 0700 directory, 0600 files, export output 0600,
  whatever the umask; ``file_mode: 0660`` shares a store with a group;
* StrictModes-like refusals: a directory anyone may write to, one owned by
  another user, a symlinked store file; a one-time warning (not a refusal)
  for an existing store with an older version's looser modes;
* secrets masked in config errors and ``ecstore-dump config``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ecstore import ECStore, ECStoreConfig
from ecstore.config import load_config
from ecstore.config.redact import is_secret_key, short_repr
from ecstore.errors import ConfigError, StoreOpenError
from ecstore.lmdb.env import _SharedEnv
from ecstore.remote.url import mask_secrets

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
NOBODY = 65534
USERS_GID = 100  # the "users" group, which nobody is not in
STORE_FILES = ["data.mdb", "lock.mdb", "leases.mdb", "leases.mdb-lock"]

CHILD = """
import os, sys, torch
os.umask(int(sys.argv[2], 8))
from ecstore import ECStore, ECStoreConfig, cli
store, mode = sys.argv[1], int(sys.argv[3], 8)
cfg = ECStoreConfig(local_cpu=False, local_disk=store, max_local_disk_size=0.01, file_mode=mode,
                    min_file_blob_size=0)  # the blob in a file of its own: its mode is checked too
with ECStore(cfg, model="sec/m", dtype=torch.float16) as s:
    s.put("img", torch.ones(4, 8, dtype=torch.float16))
    s.flush()
    key = s.key("img")
sys.exit(cli.main(["export", store, key, sys.argv[4]]))
"""


def mode_of(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def cfg_for(path: Path, **kw: object) -> ECStoreConfig:
    return ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=0.01, **kw)  # type: ignore[arg-type]


def open_store(path: Path, **kw: object) -> ECStore:
    return ECStore(cfg_for(path, **kw), model="sec/m", dtype=torch.float16)


def refused(path: Path, *needles: str, **kw: object) -> str:
    with pytest.raises(StoreOpenError) as info:
        open_store(path, **kw)
    assert not _SharedEnv._open
    msg = str(info.value)
    for n in needles:
        assert n in msg, msg
    return msg


@pytest.mark.parametrize("umask", ["022", "002", "000"])
@pytest.mark.parametrize("file_mode, dir_mode", [("600", 0o700), ("660", 0o770)])
def test_modes_of_everything_ecstore_creates(tmp_path: Path, umask: str, file_mode: str, dir_mode: int) -> None:
    store = tmp_path / "new" / "parent" / "store"
    out = tmp_path / "out.safetensors"
    r = subprocess.run([sys.executable, "-c", CHILD, str(store), umask, file_mode, str(out)],
                       capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stderr
    assert mode_of(store) == dir_mode
    assert mode_of(store.parent) == dir_mode and mode_of(store.parent.parent) == dir_mode  # created too
    assert sorted(p.name for p in store.iterdir()) == sorted(STORE_FILES + ["blobs"])
    for name in STORE_FILES:
        assert mode_of(store / name) == int(file_mode, 8), name
    assert mode_of(store / "blobs") == dir_mode
    blob_files = list((store / "blobs").iterdir())
    assert [p.suffix for p in blob_files] == [".ecb"]  # the writer's lock file went with it
    assert all(mode_of(p) == int(file_mode, 8) for p in blob_files)
    assert mode_of(out) == 0o600  # export output: private (no config names this store here)


def test_world_writable_directory_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    store.chmod(0o777)
    refused(store, str(store), "mode 0777", "anyone may write", "chmod 700")
    assert not (store / "data.mdb").exists()


def test_fix_named_in_the_refusal_works(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    store.chmod(0o777)
    refused(store, "chmod 700")
    store.chmod(0o700)
    with open_store(store) as s:
        s.put("a", torch.ones(4, 8, dtype=torch.float16))
        s.flush()


def test_world_writable_store_file_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with open_store(store):
        pass
    (store / "data.mdb").chmod(0o666)
    refused(store, "data.mdb", "mode 0666", "chmod 600")


def test_group_writable_directory_for_a_new_store_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    store.chmod(0o770)
    refused(store, "group may write", "file_mode: 0660")
    with open_store(store, file_mode=0o660):  # on purpose: fine
        pass


def test_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    os.chown(store, NOBODY, NOBODY)
    msg = refused(store, str(store), "nobody", "another user", "chown")
    assert not (store / "data.mdb").exists() and not (store / "lock.mdb").exists()
    assert "root" in msg  # names this process's user


def test_existing_store_of_another_user_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with open_store(store) as s:
        s.put("a", torch.ones(4, 8, dtype=torch.float16))
        s.flush()
    os.chown(store / "data.mdb", NOBODY, NOBODY)
    refused(store, "data.mdb", "nobody")


def test_store_below_a_world_writable_non_sticky_directory_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    refused(shared / "store", str(shared), "sticky")
    shared.chmod(0o1777)  # like /tmp
    with open_store(shared / "store"):
        pass


def test_symlinked_lock_file_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"x")
    os.symlink(victim, store / "lock.mdb")
    refused(store, "lock.mdb", "symbolic link")
    assert victim.read_bytes() == b"x"


@pytest.mark.parametrize("dir_mode, file_mode_found", [(0o755, 0o644), (0o775, 0o664)])
def test_older_store_with_looser_modes_gets_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                       dir_mode: int, file_mode_found: int) -> None:
    store = tmp_path / "store"
    with open_store(store) as s:
        s.put("a", torch.ones(4, 8, dtype=torch.float16))
        s.flush()
    store.chmod(dir_mode)  # as the old version left it under umask 0022 / 0002
    for p in store.iterdir():
        p.chmod(file_mode_found)
    caplog.clear()
    with open_store(store) as s:
        assert s.get("a") is not None
    warned = [r.getMessage() for r in caplog.records if "looser permissions" in r.getMessage()]
    assert len(warned) == 1
    assert f"chmod 700 {store}" in warned[0] and "chmod 600" in warned[0] and "data.mdb" in warned[0]
    with open_store(store):  # one time: not again in this process
        pass
    assert len([r for r in caplog.records if "looser permissions" in r.getMessage()]) == 1
    assert mode_of(store) == dir_mode  # a warning only: nothing changed behind the operator's back


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory other users can reach (pytest's temporary root is 0700)."""
    base = Path(tempfile.mkdtemp(prefix="ecstore-sec-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_nobody(*args: str, groups: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HELPERS / "as_user.py"), str(NOBODY), str(NOBODY), groups, *args],
                          capture_output=True, text=True, timeout=180, check=False, cwd="/",
                          env={k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")},
                          stdin=subprocess.DEVNULL)


def test_group_mode_on_purpose_shares_the_store(reachable: Path) -> None:
    store = reachable / "store"
    with open_store(store, file_mode=0o660) as s:
        s.put("from-root", torch.ones(4, 8, dtype=torch.float16))
        s.flush()
    for p in [store, *store.iterdir()]:
        os.chown(p, 0, USERS_GID)
    assert mode_of(store) == 0o770 and mode_of(store / "blobs") == 0o770
    assert all(mode_of(p) == 0o660 for p in store.iterdir() if p.is_file())
    # Not in the group: refused (the store belongs to another user).
    r = as_nobody("put", str(store), "660", groups="-")
    assert r.returncode == 2 and "another user" in r.stdout, r.stdout + r.stderr
    # In the group, with the shared mode configured: reads and writes.
    r = as_nobody("put", str(store), "660", groups=str(USERS_GID))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
    # The private default refuses a store another user owns, even in its group.
    r = as_nobody("put", str(store), "600", groups=str(USERS_GID))
    assert r.returncode == 2 and "another user" in r.stdout, r.stdout + r.stderr
    with open_store(store, file_mode=0o660) as s:
        assert s.get("from-root") is not None
    # ecstore-dump purge by the group member: with the config naming the
    # shared mode it works; without it the private default refuses.
    r = as_nobody("dump", "purge", str(store), "--key", "from-root", groups=str(USERS_GID))
    assert r.returncode == 2 and "another user" in r.stderr, r.stdout + r.stderr
    cfg = store.parent / "ec.yaml"
    cfg.write_text(f"local_disk: {store}\nmax_local_disk_size: 0.01\nfile_mode: 0660\n")
    cfg.chmod(0o644)
    r = as_nobody("dump", "purge", "--config", str(cfg), "--key", "from-root", groups=str(USERS_GID))
    assert r.returncode == 0 and "removed 1 entry" in r.stdout, r.stdout + r.stderr


# --------------------------------------------------------------------------
# Secrets
# --------------------------------------------------------------------------


@pytest.mark.parametrize("text, secret", [
    ("redis://user:s3cret@host:6379/0", "s3cret"),
    ("rediss://:s3cret@host:6380", "s3cret"),
    ("valkey://default:p%40ss@10.0.0.1/2?ssl=true", "p%40ss"),
    ("redis://host:6379/0?password=s3cret&db=1", "s3cret"),
    ("see redis://a:b3c@h and http://x:y7z@w/path", "b3c"),
    ("redis://us@er:s3cret@host:6379/0", "s3cret"),  # an '@' in the user name
    ("redis://user:s3 cret@host/0", "cret"),  # a space in the password
    ("redis://user:ab/s3cret@host:1/0", "s3cret"),  # an unencoded '/' in the password
])
def test_mask_secrets(text: str, secret: str) -> None:
    masked = mask_secrets(text)
    assert secret not in masked and "***" in masked
    assert short_repr(text).count("***") >= 1 and secret not in short_repr(text)


def test_plain_values_are_not_masked() -> None:
    for text in ("/data/ec", "file:///data/ec", "redis://host:6379/0", "redis://user@host/0"):
        assert mask_secrets(text) == text
    assert is_secret_key("remote_password") and is_secret_key("auth_token") and not is_secret_key("local_disk")


def test_secret_in_a_bad_value_is_masked_in_the_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"local_disk": "file://user:s3cret@otherhost/x", "max_local_disk_size": 1})
    assert "s3cret" not in str(info.value) and "***" in str(info.value)
    path = tmp_path / "ec.yaml"
    path.write_text("ec_max_local_disk_size: redis://u:hunter2@h/0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path=str(path), env={})
    assert "hunter2" not in str(info.value)


def test_config_command_masks_secrets(tmp_path: Path) -> None:
    path = tmp_path / "ec.yaml"
    path.write_text(f"local_disk: {tmp_path / 's'}\nmax_local_disk_size: 1\nfile_mode: 0660\n"
                    f"ec_remote_url: redis://user:hunter2@cache:6379/0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    r = subprocess.run([sys.executable, "-m", "ecstore.cli", "config", "--config", str(path), "--json"],
                       capture_output=True, text=True, timeout=120, check=False, env=env)
    assert r.returncode == 0, r.stderr
    assert "hunter2" not in r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["values"]["file_mode"]["value"] == "0660"
    assert doc["values"]["remote_url"]["value"] == "redis://user:***@cache:6379/0"


def test_logs_never_carry_the_config_secret(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="ecstore")
    with pytest.raises(ConfigError):
        load_config(env={}, overrides={"local_disk": "file://u:hunter2@h/x", "max_local_disk_size": 1})
    assert all("hunter2" not in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("file_mode", [0o600, 0o660])
def test_compact_keeps_the_store_private(tmp_path: Path, file_mode: int) -> None:
    from ecstore import cli

    store = tmp_path / "store"
    with open_store(store, file_mode=file_mode) as s:
        for i in range(20):
            s.put(f"img-{i}", torch.full((64, 64), float(i), dtype=torch.float16))
        s.flush()
    old = os.umask(0o022)
    try:
        assert cli.main(["compact", str(store)]) == 0
    finally:
        os.umask(old)
    assert mode_of(store / "data.mdb") == file_mode
