"""Tests of ecstore.config.load_config: precedence, provenance, bad input."""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ecstore.config as config_mod
from ecstore.config import (
    ConfigWarning,
    ECStoreConfig,
    GiB,
    describe_config,
    load_config,
)
from ecstore.errors import ConfigError

FIELDS = ["local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size",
          "max_write_queue_size", "lease_seconds", "file_mode", "namespace", "share_client_uuids",
          "pooled_blobs", "split_reads", "use_odirect", "spare_blob_files", "min_file_blob_size", "remote_url",
          "remote_password",
          "remote_timeout_seconds", "remote_ttl_seconds", "max_remote_queue_size"]

SEED_YAML = """\
chunk_size: 256
local_cpu: true
max_local_cpu_size: 2          # GiB
local_disk: "file://{disk}"
max_local_disk_size: 16        # GiB
ec_max_local_disk_size: 64     # the encoder cache gets 64 GiB, the KV cache keeps 16
"""


def write(tmp_path: Path, text: str, name: str = "ec.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def line_of(path: str, needle: str) -> int:
    """1-based number of the first line of ``path`` that contains ``needle``."""
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if needle in line:
            return number
    raise AssertionError(f"{needle!r} not in {path}")


def config_error(**kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    return str(info.value)


# --------------------------------------------------------------------------
# The "done when" check and the seed example
# --------------------------------------------------------------------------


def test_done_when_seed_yaml_plus_ec_env(tmp_path: Path) -> None:
    path = write(tmp_path, SEED_YAML.format(disk=tmp_path / "ec"))
    cfg = load_config(env={"LMCACHE_CONFIG_FILE": path, "LMCACHE_EC_MAX_LOCAL_DISK_SIZE": "32"})
    assert cfg.max_local_disk_size == 32.0
    assert cfg.disk_capacity_bytes == 32 * 2**30
    assert cfg.source_of("max_local_disk_size") == "env LMCACHE_EC_MAX_LOCAL_DISK_SIZE"
    assert cfg.sources["max_local_disk_size"] == "env LMCACHE_EC_MAX_LOCAL_DISK_SIZE"
    assert cfg.local_disk == str(tmp_path / "ec")
    assert cfg.config_file == path


def test_seed_yaml_alone_gives_ec_64_gib(tmp_path: Path) -> None:
    path = write(tmp_path, SEED_YAML.format(disk=tmp_path / "ec"))
    cfg = load_config(path, env={})
    assert cfg == ECStoreConfig(local_cpu=True, max_local_cpu_size=2.0, local_disk=str(tmp_path / "ec"),
                                max_local_disk_size=64.0)
    assert cfg.disk_capacity_bytes == 64 * GiB
    assert cfg.cpu_capacity_bytes == 2 * GiB
    assert cfg.sources == {
        "local_cpu": f"{path}:2",
        "max_local_cpu_size": f"{path}:3",
        "local_disk": f"{path}:4",
        "max_local_disk_size": f"{path}:6",
        "max_write_queue_size": "default",
        "lease_seconds": "default",
        "file_mode": "default",
        "namespace": "default",
        "share_client_uuids": "default",
        "pooled_blobs": "default",
        "split_reads": "default",
        "use_odirect": "default",
        "spare_blob_files": "default",
        "min_file_blob_size": "default",
        **{key: "default" for key in FIELDS[14:]},  # the remote tier's keys
        "__file__": path,
        "config_file": "argument path",
    }


def test_defaults_without_any_source() -> None:
    cfg = load_config(env={})
    assert cfg == ECStoreConfig()
    assert cfg.local_disk is None and cfg.disk_capacity_bytes == 0  # no default disk location
    assert (cfg.local_cpu, cfg.max_local_cpu_size, cfg.max_local_disk_size) == (True, 5.0, 0.0)
    assert (cfg.max_write_queue_size, cfg.lease_seconds) == (2.0, 120.0)
    assert cfg.sources == {key: "default" for key in FIELDS}
    assert cfg.config_file is None and cfg.source_of("config_file") == "default"


def test_describe_config(tmp_path: Path) -> None:
    path = write(tmp_path, SEED_YAML.format(disk=tmp_path / "ec"))
    cfg = load_config(env={"LMCACHE_CONFIG_FILE": path, "LMCACHE_EC_LEASE_SECONDS": "30"},
                      overrides={"max_write_queue_size": 0.5})
    assert describe_config(cfg) == [
        ("config_file", path, "env LMCACHE_CONFIG_FILE"),
        ("local_cpu", True, f"{path}:2"),
        ("max_local_cpu_size", 2.0, f"{path}:3"),
        ("local_disk", str(tmp_path / "ec"), f"{path}:4"),
        ("max_local_disk_size", 64.0, f"{path}:6"),
        ("max_write_queue_size", 0.5, "override max_write_queue_size"),
        ("lease_seconds", 30.0, "env LMCACHE_EC_LEASE_SECONDS"),
        ("file_mode", "0600", "default"),
        ("namespace", None, "default"),
        ("share_client_uuids", False, "default"),
        ("pooled_blobs", True, "default"),
        ("split_reads", True, "default"),
        ("use_odirect", True, "default"),
        ("spare_blob_files", True, "default"),
        ("min_file_blob_size", 0.5, "default"),
    ] + [(key, getattr(cfg, key), "default") for key in FIELDS[14:]]  # the remote tier's keys


def test_min_file_blob_size_from_every_source(tmp_path: Path) -> None:
    """The size from which blobs go to files of their own (MiB) is read like
    any size: YAML (ec_ key wins), LMCACHE_EC_ variable, override; bytes
    derived once."""
    cfg = load_config(env={})
    assert (cfg.min_file_blob_size, cfg.file_blobs_from_bytes) == (0.5, 1 << 19)
    path = write(tmp_path, "min_file_blob_size: 8\nec_min_file_blob_size: 0.25\n")
    cfg = load_config(env={"LMCACHE_CONFIG_FILE": path})
    assert (cfg.file_blobs_from_bytes, cfg.source_of("min_file_blob_size")) == (1 << 18, f"{path}:2")
    cfg = load_config(env={"LMCACHE_EC_MIN_FILE_BLOB_SIZE": "0"})
    assert (cfg.file_blobs_from_bytes, cfg.source_of("min_file_blob_size")) == (0, "env LMCACHE_EC_MIN_FILE_BLOB_SIZE")
    with pytest.raises(ConfigError, match="min_file_blob_size"):
        load_config(env={"LMCACHE_EC_MIN_FILE_BLOB_SIZE": "-1"})


def test_pooled_blobs_from_every_source(tmp_path: Path) -> None:
    """The put path's pooling switch (ecstore.store.put_path) is an ordinary boolean
    setting: YAML base and ec_ keys, LMCACHE_(EC_)POOLED_BLOBS, overrides."""
    assert load_config(env={}).pooled_blobs is True
    path = write(tmp_path, "pooled_blobs: true\nec_pooled_blobs: off\n")
    cfg = load_config(path, env={})
    assert (cfg.pooled_blobs, cfg.source_of("pooled_blobs")) == (False, f"{path}:2")
    cfg = load_config(path, env={"LMCACHE_EC_POOLED_BLOBS": "1"})
    assert (cfg.pooled_blobs, cfg.source_of("pooled_blobs")) == (True, "env LMCACHE_EC_POOLED_BLOBS")
    assert load_config(env={"LMCACHE_POOLED_BLOBS": "no"}).pooled_blobs is False
    assert load_config(env={"LMCACHE_EC_POOLED_BLOBS": "0"}, overrides={"pooled_blobs": True}).pooled_blobs


@pytest.mark.parametrize("kwargs, where", [
    ({"env": {"LMCACHE_EC_POOLED_BLOBS": "maybe"}}, "env LMCACHE_EC_POOLED_BLOBS"),
    ({"env": {"LMCACHE_EC_POOLED_BLOBS": "2"}}, "env LMCACHE_EC_POOLED_BLOBS"),
    ({"env": {}, "overrides": {"pooled_blobs": "enabled"}}, "override pooled_blobs"),
])
def test_bad_pooled_blobs_is_a_config_error(kwargs: dict[str, Any], where: str) -> None:
    msg = config_error(**kwargs)
    assert msg.startswith("pooled_blobs (from " + where + "): expected true or false"), msg


def test_bad_pooled_blobs_argument_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"pooled_blobs \(from ECStoreConfig argument\): expected true or false"):
        ECStoreConfig(pooled_blobs="no")  # type: ignore[arg-type]


def test_namespace_key_from_every_source(tmp_path: Path) -> None:
    """The identity pin (ecstore.identity) follows the usual precedence."""
    path = write(tmp_path, "ec_namespace: from-yaml\n")
    assert load_config(path, env={}).namespace == "from-yaml"
    cfg = load_config(path, env={"LMCACHE_EC_NAMESPACE": "from-env"})
    assert (cfg.namespace, cfg.source_of("namespace")) == ("from-env", "env LMCACHE_EC_NAMESPACE")
    cfg = load_config(path, env={"LMCACHE_EC_NAMESPACE": "from-env"}, overrides={"namespace": "ckpt-7"})
    assert (cfg.namespace, cfg.source_of("namespace")) == ("ckpt-7", "override namespace")
    assert load_config(env={}, overrides={"namespace": "  "}).namespace is None  # empty: automatic
    assert load_config(env={"LMCACHE_EC_SHARE_CLIENT_UUIDS": "yes"}).share_client_uuids is True
    for bad in ("x" * 201, "tab\there"):
        with pytest.raises(ConfigError, match="namespace"):
            load_config(env={}, overrides={"namespace": bad})


def test_default_env_is_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("LMCACHE_"):
            monkeypatch.delenv(var)
    path = write(tmp_path, "lease_seconds: 10\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", path)
    monkeypatch.setenv("LMCACHE_EC_MAX_LOCAL_CPU_SIZE", "0.25")
    cfg = load_config()
    assert (cfg.lease_seconds, cfg.max_local_cpu_size) == (10.0, 0.25)
    assert cfg.source_of("lease_seconds") == f"{path}:1"
    assert cfg.source_of("max_local_cpu_size") == "env LMCACHE_EC_MAX_LOCAL_CPU_SIZE"


# --------------------------------------------------------------------------
# Precedence, pairwise
# --------------------------------------------------------------------------

LEVELS = ["default", "file", "env", "ec_file", "ec_env", "override"]


def _level_values(key: str, tmp_path: Path) -> dict[str, tuple[Any, Any]]:
    """level -> (raw value as written at that level, expected effective value)."""
    if key == "max_local_disk_size":
        return {"default": (None, 0.0), "file": (16, 16.0), "env": ("24", 24.0),
                "ec_file": (64, 64.0), "ec_env": ("32.5", 32.5), "override": (48, 48.0)}
    d = tmp_path
    return {"default": (None, None),
            "file": (f"file://{d}/kv", f"{d}/kv"),
            "env": (f"{d}/env", f"{d}/env"),
            "ec_file": (f"{d}/ecf", f"{d}/ecf"),
            "ec_env": (f"file://{d}/ece", f"{d}/ece"),
            "override": (d / "ovr", f"{d}/ovr")}


def _build(tmp_path: Path, key: str, levels: set[str], ec_form: str
           ) -> tuple[str, dict[str, str], dict[str, Any], dict[str, str]]:
    """Seed-like YAML, env and overrides setting ``key`` at ``levels``; also the
    expected source string of each level."""
    values = _level_values(key, tmp_path)
    lines = ["chunk_size: 256", "local_cpu: true", "max_local_cpu_size: 2"]
    if key == "max_local_disk_size":
        lines.append(f'local_disk: "file://{tmp_path}/ec"')
    else:
        lines.append("max_local_disk_size: 16")
    expected: dict[str, str] = {"default": "default"}
    if "file" in levels:
        lines.append(f"{key}: {values['file'][0]}")
        expected["file"] = f"{{path}}:{len(lines)}"
    if "ec_file" in levels:
        if ec_form == "ec_":
            lines.append(f"ec_{key}: {values['ec_file'][0]}")
        else:
            lines += ["ec:", f"  {key}: {values['ec_file'][0]}"]
        expected["ec_file"] = f"{{path}}:{len(lines)}"
    lines.append("remote_url: null")
    path = write(tmp_path, "\n".join(lines) + "\n")
    env = {"LMCACHE_CONFIG_FILE": path, "LMCACHE_USE_EXPERIMENTAL": "True"}
    if "env" in levels:
        env[f"LMCACHE_{key.upper()}"] = str(values["env"][0])
    if "ec_env" in levels:
        env[f"LMCACHE_EC_{key.upper()}"] = str(values["ec_env"][0])
    overrides: dict[str, Any] = {}
    if "override" in levels:
        overrides[key] = values["override"][0]
    expected.update({"env": f"env LMCACHE_{key.upper()}", "ec_env": f"env LMCACHE_EC_{key.upper()}",
                     "override": f"override {key}"})
    return path, env, overrides, {k: v.format(path=path) for k, v in expected.items()}


PAIRS = [
    pytest.param(key, lo, hi, form, id=f"{key}-{lo}<{hi}" + (f"[{form}]" if "ec_file" in (lo, hi) else ""))
    for key in ("max_local_disk_size", "local_disk")
    for lo, hi in itertools.combinations(LEVELS, 2)
    for form in (("ec_", "ec:") if "ec_file" in (lo, hi) else ("ec_",))
]


@pytest.mark.parametrize("key,lo,hi,ec_form", PAIRS)
def test_precedence_pairwise(tmp_path: Path, key: str, lo: str, hi: str, ec_form: str) -> None:
    path, env, overrides, expected_source = _build(tmp_path, key, {lo, hi}, ec_form)
    cfg = load_config(env=env, overrides=overrides)
    assert getattr(cfg, key) == _level_values(key, tmp_path)[hi][1]
    assert cfg.source_of(key) == expected_source[hi]
    # The lower level alone is what shows through when the higher one is absent.
    path, env, overrides, expected_source = _build(tmp_path, key, {lo}, ec_form)
    if key == "max_local_disk_size" and lo == "default":
        with pytest.raises(ConfigError):  # local_disk set, no size anywhere
            load_config(env=env, overrides=overrides)
        return
    cfg = load_config(env=env, overrides=overrides)
    assert getattr(cfg, key) == _level_values(key, tmp_path)[lo][1]
    assert cfg.source_of(key) == expected_source[lo]


# --------------------------------------------------------------------------
# Precedence, property-based
# --------------------------------------------------------------------------

HYP_LEVELS = ["file", "env", "ec_file", "ec_env", "override"]
BOOL_SPELLINGS = {True: ["true", "True", "TRUE", "yes", "Yes", "on", "ON", "1", "tRuE", "yEs", "oN"],
                  False: ["false", "False", "FALSE", "no", "NO", "off", "Off", "0", "fAlSe", "nO", "oFF"]}
NUMBER_KEYS = ["max_local_cpu_size", "max_local_disk_size", "max_write_queue_size", "lease_seconds"]


@st.composite
def _assignment(draw: st.DrawFn) -> dict[str, dict[str, tuple[Any, Any]]]:
    """key -> level -> (value as written, expected parsed value)."""
    out: dict[str, dict[str, tuple[Any, Any]]] = {}
    for key in ["local_cpu", *NUMBER_KEYS]:
        levels = draw(st.lists(st.sampled_from(HYP_LEVELS), unique=True, max_size=len(HYP_LEVELS)))
        per_level = {}
        for level in levels:
            if key == "local_cpu":
                value = draw(st.booleans())
                written: Any = draw(st.sampled_from(BOOL_SPELLINGS[value]))
                if level == "override" and draw(st.booleans()):
                    written = value
            else:
                top = config_mod.NUMBER_MAX[key]  # the largest value the key accepts
                value = draw(st.one_of(st.integers(0, int(top)).map(float),
                                       st.floats(0, top, allow_nan=False, allow_infinity=False)))
                written = value if level in ("file", "ec_file", "override") else repr(value)
                if level == "override" and draw(st.booleans()):
                    written = repr(value)
            per_level[level] = (written, value)
        out[key] = per_level
    return out


@settings(max_examples=75, deadline=None)
@given(assignment=_assignment(), nested=st.booleans())
def test_highest_source_wins(tmp_path_factory: pytest.TempPathFactory,
                             assignment: dict[str, dict[str, tuple[Any, Any]]], nested: bool) -> None:
    path = str(tmp_path_factory.getbasetemp() / "hypothesis-ec.yaml")
    lines = ["chunk_size: 256", "remote_serde: naive"]
    line_no: dict[tuple[str, str], int] = {}
    for key, per_level in assignment.items():
        if "file" in per_level:
            lines.append(f"{key}: {per_level['file'][0]}")
            line_no[(key, "file")] = len(lines)
    ec_keys = [k for k, per_level in assignment.items() if "ec_file" in per_level]
    if nested and ec_keys:
        lines.append("ec:")
    for key in ec_keys:
        lines.append(f"  {key}: {assignment[key]['ec_file'][0]}" if nested
                     else f"ec_{key}: {assignment[key]['ec_file'][0]}")
        line_no[(key, "ec_file")] = len(lines)
    Path(path).write_text("\n".join(lines) + "\n")

    env = {"LMCACHE_CONFIG_FILE": path}
    overrides: dict[str, Any] = {}
    for key, per_level in assignment.items():
        if "env" in per_level:
            env[f"LMCACHE_{key.upper()}"] = per_level["env"][0]
        if "ec_env" in per_level:
            env[f"LMCACHE_EC_{key.upper()}"] = per_level["ec_env"][0]
        if "override" in per_level:
            overrides[key] = per_level["override"][0]

    cfg = load_config(env=env, overrides=overrides)
    default = ECStoreConfig()
    for key, per_level in assignment.items():
        top = max(per_level, key=HYP_LEVELS.index, default=None)
        if top is None:
            assert getattr(cfg, key) == getattr(default, key)
            assert cfg.sources[key] == "default"
            continue
        assert getattr(cfg, key) == per_level[top][1]
        assert cfg.sources[key] == {
            "file": f"{path}:{line_no.get((key, 'file'))}",
            "ec_file": f"{path}:{line_no.get((key, 'ec_file'))}",
            "env": f"env LMCACHE_{key.upper()}",
            "ec_env": f"env LMCACHE_EC_{key.upper()}",
            "override": f"override {key}",
        }[top]
    assert set(FIELDS) <= set(cfg.sources)


# --------------------------------------------------------------------------
# ec: mapping, ec_ keys, local_disk forms
# --------------------------------------------------------------------------


def test_ec_mapping_and_ec_prefix_together(tmp_path: Path) -> None:
    path = write(tmp_path, f"""\
local_disk: {tmp_path}/kv
max_local_disk_size: 16
ec_max_local_disk_size: 64
ec:
  local_disk: {tmp_path}/enc
  lease_seconds: 5
ec_local_cpu: off
""")
    cfg = load_config(path, env={})
    assert (cfg.local_disk, cfg.max_local_disk_size, cfg.lease_seconds, cfg.local_cpu) == (
        f"{tmp_path}/enc", 64.0, 5.0, False)
    assert cfg.sources["local_disk"] == f"{path}:5"
    assert cfg.sources["max_local_disk_size"] == f"{path}:3"
    assert cfg.sources["lease_seconds"] == f"{path}:6"
    assert cfg.sources["local_cpu"] == f"{path}:7"
    assert cfg.cpu_capacity_bytes == 0


def test_ec_prefix_and_ec_mapping_setting_same_key_conflict(tmp_path: Path) -> None:
    path = write(tmp_path, "ec_lease_seconds: 5\nchunk_size: 256\nec:\n  lease_seconds: 6\n")
    msg = config_error(path=path, env={})
    assert "lease_seconds" in msg and f"{path}:1" in msg and f"{path}:4" in msg
    assert "ec_lease_seconds" in msg and "ec.lease_seconds" in msg


def test_ec_mapping_empty_or_null(tmp_path: Path) -> None:
    for text in ("ec:\n", "ec: {}\n", "ec: null\n"):
        assert load_config(write(tmp_path, text), env={}) == ECStoreConfig()


def test_ec_mapping_must_be_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 256\nec: 64\n")
    msg = config_error(path=path, env={})
    assert f"{path}:2" in msg and "mapping" in msg and "64" in msg


@pytest.mark.parametrize("form", ["file://{d}/store", "{d}/store", "file://localhost{d}/store",
                                  "{d}/store/"])
def test_local_disk_file_uri_and_plain_path(tmp_path: Path, form: str) -> None:
    path = write(tmp_path, f'local_disk: "{form.format(d=tmp_path)}"\nmax_local_disk_size: 1\n')
    cfg = load_config(path, env={})
    assert cfg.local_disk == str(tmp_path / "store")
    assert cfg.disk_capacity_bytes == GiB


def test_relative_local_disk_resolves_against_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(env={"LMCACHE_EC_LOCAL_DISK": "cache/ec", "LMCACHE_EC_MAX_LOCAL_DISK_SIZE": "1"})
    assert cfg.local_disk == str(tmp_path / "cache" / "ec")
    assert os.path.isabs(cfg.local_disk)


def test_memory_only_when_local_disk_absent(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 2\nmax_local_disk_size: 16\n")
    cfg = load_config(path, env={})
    assert cfg.local_disk is None and cfg.disk_capacity_bytes == 0
    assert cfg.source_of("local_disk") == "default"


@pytest.mark.parametrize("how", ["yaml-null", "yaml-empty", "env-empty", "override-none"])
def test_encoder_cache_memory_only_while_kv_cache_keeps_disk(tmp_path: Path, how: str) -> None:
    text = SEED_YAML.format(disk=tmp_path / "kv")
    env: dict[str, str] = {}
    overrides: dict[str, Any] = {}
    if how == "yaml-null":
        text += "ec_local_disk: null\n"
    elif how == "yaml-empty":
        text += 'ec:\n  local_disk: ""\n'
    elif how == "env-empty":
        env["LMCACHE_EC_LOCAL_DISK"] = ""
    else:
        overrides["local_disk"] = None
    cfg = load_config(write(tmp_path, text), env=env, overrides=overrides)
    assert cfg.local_disk is None and cfg.disk_capacity_bytes == 0
    assert cfg.source_of("local_disk") != "default"


def test_shadowed_lmcache_multi_disk_value_is_not_an_error(tmp_path: Path) -> None:
    # LMCache accepts comma-separated disks for the KV cache; ecstore only
    # validates a shared base value when it is the one it uses.
    path = write(tmp_path, f'local_disk: "{tmp_path}/a,{tmp_path}/b"\nmax_local_disk_size: 4\n'
                           f"ec_local_disk: {tmp_path}/enc\n")
    assert load_config(path, env={}).local_disk == f"{tmp_path}/enc"
    path = write(tmp_path, f'local_disk: "{tmp_path}/a,{tmp_path}/b"\nmax_local_disk_size: 4\n')
    msg = config_error(path=path, env={})
    assert "local_disk" in msg and f"{path}:1" in msg and "single directory" in msg


def test_shadowed_bad_ec_value_is_still_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "ec_max_local_disk_size: lots\n")
    msg = config_error(path=path, env={"LMCACHE_EC_MAX_LOCAL_DISK_SIZE": "32"})
    assert "ec_max_local_disk_size" in msg and f"{path}:1" in msg and "'lots'" in msg


# --------------------------------------------------------------------------
# Value parsing
# --------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("true", True), ("True", True), ("yes", True), ("Yes", True), ("on", True), ("ON", True),
    ("1", True), ("false", False), ("No", False), ("off", False), ("0", False),
    ('"yes"', True), ('"oN"', True), ('"NO"', False), ('"0"', False),
])
def test_bool_spellings_in_yaml(tmp_path: Path, text: str, expected: bool) -> None:
    assert load_config(write(tmp_path, f"local_cpu: {text}\n"), env={}).local_cpu is expected


@pytest.mark.parametrize("text", ["true", "TRUE", "yes", "YES", "yEs", "on", "On", "1", " 1 ", '"yes"'])
def test_truthy_env_strings_are_true(text: str) -> None:
    assert load_config(env={"LMCACHE_EC_LOCAL_CPU": text}).local_cpu is True


@pytest.mark.parametrize("text", ["false", "FALSE", "no", "No", "off", "OFF", "0", "'off'"])
def test_falsy_env_strings_are_false(text: str) -> None:
    assert load_config(env={"LMCACHE_LOCAL_CPU": text}).local_cpu is False


@pytest.mark.parametrize("text,expected", [("2.5", 2.5), ("64", 64.0), (" 8 ", 8.0), ("0", 0.0),
                                           ("1e3", 1000.0), ('"4"', 4.0)])
def test_sizes_from_env_strings(text: str, expected: float) -> None:
    cfg = load_config(env={"LMCACHE_EC_MAX_LOCAL_CPU_SIZE": text})
    assert cfg.max_local_cpu_size == expected
    assert cfg.cpu_capacity_bytes == int(expected * GiB)


@pytest.mark.parametrize("text,expected", [("16", 16.0), ("2.5", 2.5), ("1e3", 1000.0), ("1.0e+3", 1000.0),
                                           ('"3"', 3.0), ("0", 0.0)])
def test_sizes_from_yaml(tmp_path: Path, text: str, expected: float) -> None:
    cfg = load_config(write(tmp_path, f"max_write_queue_size: {text}\n"), env={})
    assert cfg.max_write_queue_size == expected


def test_overrides_accept_strings_and_pathlike(tmp_path: Path) -> None:
    cfg = load_config(env={}, overrides={"local_disk": tmp_path / "enc", "max_local_disk_size": "64",
                                         "local_cpu": "no", "lease_seconds": 7})
    assert (cfg.local_disk, cfg.max_local_disk_size, cfg.local_cpu, cfg.lease_seconds) == (
        str(tmp_path / "enc"), 64.0, False, 7.0)
    assert cfg.sources["local_disk"] == "override local_disk"


BAD_YAML = [
    ("max_local_disk_size: lots", "max_local_disk_size", "'lots'", "GiB"),
    ("max_local_disk_size: -1", "max_local_disk_size", "-1", ">= 0"),
    ("max_local_cpu_size: .nan", "max_local_cpu_size", "nan", "finite"),
    ("ec_max_local_cpu_size: .inf", "ec_max_local_cpu_size", "inf", "finite"),
    ("max_local_disk_size: true", "max_local_disk_size", "True", "GiB"),
    ("lease_seconds: [1, 2]", "lease_seconds", "[1, 2]", "seconds"),
    ("local_cpu: 2", "local_cpu", "2", "true or false"),
    ("local_cpu: 1.0", "local_cpu", "1.0", "true or false"),
    ("local_cpu: maybe", "local_cpu", "'maybe'", "true or false"),
    ("ec:\n  local_cpu: enabled", "ec.local_cpu", "'enabled'", "true or false"),
    ('local_disk: "s3://bucket/ec"\nmax_local_disk_size: 1', "local_disk", "s3://bucket/ec", "file://"),
    ('ec_local_disk: "lm://host:65432"', "local_disk", "lm://host:65432", "file://"),
    ("local_disk: 5\nmax_local_disk_size: 1", "local_disk", "5", "path"),
    ("local_disk: [a, b]\nmax_local_disk_size: 1", "local_disk", "['a', 'b']", "path"),
    ("local_disk: file://remotehost/x\nmax_local_disk_size: 1", "local_disk", "remotehost", "local"),
]


@pytest.mark.parametrize("text,key,value,expected", BAD_YAML)
def test_bad_values_in_yaml(tmp_path: Path, text: str, key: str, value: str, expected: str) -> None:
    path = write(tmp_path, "chunk_size: 256\n" + text + "\n")
    msg = config_error(path=path, env={})
    assert key in msg and value in msg and expected in msg
    assert f"{path}:{line_of(path, key.split('.')[-1] + ':')}" in msg


BAD_ENV = [
    ("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "lots", "GiB"),
    ("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "-2", ">= 0"),
    ("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "nan", "finite"),
    ("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "inf", "finite"),
    ("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "", "GiB"),
    ("LMCACHE_EC_LEASE_SECONDS", "2 minutes", "seconds"),
    ("LMCACHE_MAX_LOCAL_CPU_SIZE", "2GB", "GiB"),
    ("LMCACHE_EC_LOCAL_CPU", "maybe", "true or false"),
    ("LMCACHE_EC_LOCAL_CPU", "2", "true or false"),
    ("LMCACHE_LOCAL_CPU", "", "true or false"),
    ("LMCACHE_EC_LOCAL_DISK", "s3://bucket/x", "file://"),
]


@pytest.mark.parametrize("var,value,expected", BAD_ENV)
def test_bad_values_in_env(var: str, value: str, expected: str) -> None:
    msg = config_error(env={var: value, "LMCACHE_EC_MAX_WRITE_QUEUE_SIZE": "1"})
    key = var.removeprefix("LMCACHE_EC_").removeprefix("LMCACHE_").lower()
    assert key in msg and f"env {var}" in msg and repr(value).strip("'") in msg and expected in msg


@pytest.mark.parametrize("key,value,expected", [
    ("max_local_disk_size", "lots", "GiB"),
    ("max_local_cpu_size", True, "GiB"),
    ("max_local_cpu_size", float("nan"), "finite"),
    ("lease_seconds", None, "seconds"),
    ("local_cpu", 2, "true or false"),
    ("local_cpu", "nope", "true or false"),
    ("local_disk", 3, "path"),
])
def test_bad_values_in_overrides(key: str, value: Any, expected: str) -> None:
    msg = config_error(env={}, overrides={"max_local_disk_size": 1, key: value})
    assert key in msg and f"override {key}" in msg and repr(value) in msg and expected in msg


def test_yes_is_never_false(tmp_path: Path) -> None:
    path = write(tmp_path, "local_cpu: no\nec_local_cpu: yes\n")
    assert load_config(path, env={}).local_cpu is True
    assert load_config(path, env={"LMCACHE_EC_LOCAL_CPU": "Yes"}).local_cpu is True
    assert load_config(env={}, overrides={"local_cpu": "YES"}).local_cpu is True


@pytest.mark.parametrize("size_line,size_source", [
    ("", "default"),
    ("max_local_disk_size: 0", "{path}:2"),
])
def test_local_disk_without_size_names_both_sources(tmp_path: Path, size_line: str, size_source: str) -> None:
    path = write(tmp_path, f"local_disk: {tmp_path}/ec\n{size_line}\n")
    msg = config_error(path=path, env={})
    assert "local_disk" in msg and "max_local_disk_size" in msg
    assert f"from {path}:1" in msg and f"from {size_source.format(path=path)}" in msg
    msg = config_error(path=path, env={"LMCACHE_EC_MAX_LOCAL_DISK_SIZE": "0"})
    assert f"from {path}:1" in msg and "env LMCACHE_EC_MAX_LOCAL_DISK_SIZE" in msg


def test_env_values_lose_one_pair_of_quotes(tmp_path: Path) -> None:
    cfg = load_config(env={"LMCACHE_EC_LOCAL_DISK": f'"file://{tmp_path}/q"',
                           "LMCACHE_EC_MAX_LOCAL_DISK_SIZE": "'2'"})
    assert (cfg.local_disk, cfg.max_local_disk_size) == (f"{tmp_path}/q", 2.0)


# --------------------------------------------------------------------------
# Unknown keys
# --------------------------------------------------------------------------


def test_unknown_ec_key_in_yaml_names_line_and_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, SEED_YAML.format(disk=tmp_path) + "ec_max_local_disc_size: 64\n")
    msg = config_error(path=path, env={})
    assert "ec_max_local_disc_size" in msg and f"{path}:7" in msg
    assert "did you mean 'ec_max_local_disk_size'" in msg


def test_unknown_key_in_ec_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 256\nec:\n  max_local_disk_size: 4\n  lease_second: 3\n")
    msg = config_error(path=path, env={})
    assert "ec.lease_second" in msg and f"{path}:4" in msg and "did you mean 'ec.lease_seconds'" in msg


def test_unknown_ec_key_without_close_match_lists_valid_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "ec_zzzz: 1\n")
    msg = config_error(path=path, env={})
    assert "ec_zzzz" in msg and f"{path}:1" in msg
    assert all(f"ec_{key}" in msg for key in FIELDS)


def test_unknown_ec_env_var_names_variable_and_suggestion() -> None:
    msg = config_error(env={"LMCACHE_EC_MAX_LOCAL_DISC_SIZE": "64"})
    assert "env LMCACHE_EC_MAX_LOCAL_DISC_SIZE" in msg
    assert "did you mean 'LMCACHE_EC_MAX_LOCAL_DISK_SIZE'" in msg


def test_unknown_override_key() -> None:
    msg = config_error(env={}, overrides={"lease_second": 5})
    assert "lease_second" in msg and "override" in msg and "did you mean 'lease_seconds'" in msg
    msg = config_error(env={}, overrides={"ec_max_local_disk_size": 5})
    assert "ec_max_local_disk_size" in msg and "did you mean 'max_local_disk_size'" in msg
    msg = config_error(env={}, overrides={"chunk_size": 256})  # LMCache's key: not for the EC connector
    assert "chunk_size" in msg


def test_lmcache_keys_for_its_own_ec_engine_are_ignored(tmp_path: Path) -> None:
    # LMCache's own EC engine reads ec_<lmcache key> / LMCACHE_EC_<KEY>: not typos.
    path = write(tmp_path, "ec_chunk_size: 128\nec:\n  remote_url: null\n  lease_seconds: 9\n")
    cfg = load_config(path, env={"LMCACHE_EC_SAVE_UNFULL_CHUNK": "true"})
    assert cfg.lease_seconds == 9.0


def test_known_lmcache_base_keys_are_ignored_silently(tmp_path: Path) -> None:
    path = write(tmp_path, """\
chunk_size: 256
remote_url: "lm://localhost:65432"
remote_serde: naive
save_decode_cache: false
local_device: cpu
enable_blending: false
blend_special_str: " # # "
pd_role: sender
pd_buffer_size: 1073741824
pd_some_future_option: 3
use_layerwise: false
enable_p2p: false
lookup_url: localhost:8100
distributed_url: localhost:8200
extra_config: {enable_nixl_storage: false}
nixl_buffer_device: cuda
max_local_disk_size: 16
""")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(path, env={"LMCACHE_CHUNK_SIZE": "512", "LMCACHE_USE_EXPERIMENTAL": "True",
                                     "LMCACHE_LOG_LEVEL": "DEBUG", "LMCACHE_WHATEVER": "x"})
    assert cfg.max_local_disk_size == 16.0


def test_unknown_base_key_warns_with_line_and_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 256\nmax_local_disc_size: 16\nfrobnicate: 1\n")
    with pytest.warns(ConfigWarning) as record:
        cfg = load_config(path, env={})
    messages = [str(w.message) for w in record]
    assert any(f"{path}:2" in m and "max_local_disc_size" in m and "'max_local_disk_size'" in m
               for m in messages)
    assert any(f"{path}:3" in m and "frobnicate" in m for m in messages)
    assert cfg == ECStoreConfig()


# --------------------------------------------------------------------------
# The file itself
# --------------------------------------------------------------------------


def test_missing_file_argument(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    msg = config_error(path=missing, env={})
    assert missing in msg and "does not exist" in msg and "argument path" in msg


def test_missing_file_from_env(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    msg = config_error(env={"LMCACHE_CONFIG_FILE": missing})
    assert missing in msg and "env LMCACHE_CONFIG_FILE" in msg


def test_directory_instead_of_file(tmp_path: Path) -> None:
    msg = config_error(path=tmp_path, env={})
    assert str(tmp_path) in msg and "directory" in msg


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "chunk_size: 256\n")

    real_open = os.open

    def denied(name: Any, *args: Any, **kwargs: Any) -> Any:
        if name == path:  # root reads any file: refuse this one as chmod 000 would
            raise PermissionError(13, "Permission denied", path)
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    msg = config_error(path=path, env={})
    assert path in msg and "cannot be read" in msg and "Permission denied" in msg


def test_unreadable_path_is_a_config_error(tmp_path: Path) -> None:
    # A directory cannot be read as a file, even by root (chmod 000 can).
    path = tmp_path / "ec.yaml"
    path.mkdir()
    msg = config_error(path=str(path), env={})
    assert str(path) in msg and "is a directory" in msg


@pytest.mark.parametrize("text,line", [
    ("chunk_size: 256\nlocal_disk: [a, b\nmax_local_disk_size: 3\n", None),
    ("chunk_size: 256\n  bad_indent: 1\n", 2),
    ("chunk_size: 256\nlocal_cpu: 'unterminated\n", None),
    ("a: 1\n---\nb: 2\n", 2),
    ("a: !!python/object/apply:os.system ['echo owned']\n", 1),
])
def test_malformed_yaml_names_path_and_position(tmp_path: Path, text: str, line: int | None) -> None:
    path = write(tmp_path, text)
    msg = config_error(path=path, env={})
    assert path in msg and "malformed YAML at line " in msg and "column " in msg
    if line is not None:
        assert f"at line {line}," in msg


@pytest.mark.parametrize("text,line", [
    ("chunk_size: 256\nmax_local_disk_size: !!float abc\n", 2),
    ("chunk_size: 256\nmax_local_disk_size: !!int 0x\n", 2),
    ("chunk_size: 256\nlocal_cpu: !!bool maybe\n", 2),
    ("chunk_size: 256\nlease_seconds: !!timestamp soon\n", 2),
    ("chunk_size: 256\nec:\n  lease_seconds: !!float abc\n", 3),
    ("chunk_size: !!int abc\n", 1),
    ("? !!float abc\n: 1\n", 1),
    ("chunk_size: " + "[" * 5000 + "]" * 5000 + "\n", None),
])
def test_yaml_values_python_cannot_construct_are_config_errors(tmp_path: Path, text: str,
                                                                line: int | None) -> None:
    """Explicit tags YAML's constructor fails on (ValueError, KeyError,
    AttributeError inside PyYAML) and nesting deeper than Python's recursion
    limit are malformed files: a ConfigError naming the path, never a bare
    Python exception."""
    path = write(tmp_path, text)
    msg = config_error(path=path, env={})
    assert path in msg and "malformed YAML" in msg
    if line is not None:
        assert f"at line {line}," in msg


def test_invalid_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "ec.yaml"
    path.write_bytes(b"chunk_size: 256\nlocal_disk: \xff\xfe\x00bad\n")
    msg = config_error(path=path, env={})
    assert str(path) in msg


@pytest.mark.parametrize("text,kind", [("- a\n- b\n", "list"), ("just a string\n", "single value"),
                                       ("42\n", "single value")])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    path = write(tmp_path, text)
    msg = config_error(path=path, env={})
    assert path in msg and "mapping" in msg and kind in msg


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file_means_no_keys(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    cfg = load_config(path, env={})
    assert cfg == ECStoreConfig()
    assert cfg.config_file == path
    assert all(cfg.sources[key] == "default" for key in FIELDS)


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "max_local_disk_size: 16\nchunk_size: 256\nmax_local_disk_size: 32\n")
    msg = config_error(path=path, env={})
    assert "max_local_disk_size" in msg and f"{path}:1" in msg and f"{path}:3" in msg


def test_file_is_never_written(tmp_path: Path) -> None:
    path = write(tmp_path, SEED_YAML.format(disk=tmp_path / "ec"))
    before = (Path(path).read_bytes(), os.stat(path).st_mtime_ns)
    load_config(path, env={"LMCACHE_EC_MAX_LOCAL_DISK_SIZE": "32"})
    assert (Path(path).read_bytes(), os.stat(path).st_mtime_ns) == before


# --------------------------------------------------------------------------
# Which file: path argument, overrides["config_file"], LMCACHE_CONFIG_FILE
# --------------------------------------------------------------------------


def test_config_file_in_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "lease_seconds: 11\n")
    cfg = load_config(env={}, overrides={"config_file": path, "max_local_cpu_size": 1})
    assert cfg.lease_seconds == 11.0 and cfg.max_local_cpu_size == 1.0
    assert cfg.config_file == path and cfg.source_of("config_file") == "override config_file"


def test_file_choice_precedence(tmp_path: Path) -> None:
    arg = write(tmp_path, "lease_seconds: 1\n", "arg.yaml")
    over = write(tmp_path, "lease_seconds: 2\n", "over.yaml")
    envf = write(tmp_path, "lease_seconds: 3\n", "env.yaml")
    env = {"LMCACHE_CONFIG_FILE": envf}
    cfg = load_config(arg, env=env, overrides={"config_file": over})
    assert (cfg.lease_seconds, cfg.config_file, cfg.source_of("config_file")) == (1.0, arg, "argument path")
    cfg = load_config(env=env, overrides={"config_file": over})
    assert (cfg.lease_seconds, cfg.config_file) == (2.0, over)
    cfg = load_config(env=env)
    assert (cfg.lease_seconds, cfg.config_file, cfg.source_of("config_file")) == (
        3.0, envf, "env LMCACHE_CONFIG_FILE")


def test_empty_config_file_values_mean_no_file() -> None:
    cfg = load_config(env={"LMCACHE_CONFIG_FILE": ""}, overrides={"config_file": None})
    assert cfg.config_file is None and cfg == ECStoreConfig()


def test_relative_config_file_path_is_reported_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "lease_seconds: 4\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config("ec.yaml", env={})
    assert cfg.config_file == str(tmp_path / "ec.yaml")
    assert cfg.source_of("lease_seconds") == f"{tmp_path / 'ec.yaml'}:1"


def test_bad_config_file_override_type() -> None:
    msg = config_error(env={}, overrides={"config_file": 42})
    assert "config file" in msg and "override config_file" in msg and "42" in msg


def test_settings_table_is_the_dataclass_and_its_limits() -> None:
    rows = config_mod.settings_table()
    assert [r.name for r in rows] == FIELDS == list(config_mod.KEYS)
    default = ECStoreConfig()
    for r in rows:
        assert r.default == getattr(default, r.name), r.name
        assert r.maximum == config_mod.NUMBER_MAX.get(r.name), r.name
        assert r.type and r.unit and r.expected and r.doc
    top = {r.name: r.maximum for r in rows}
    assert top["max_local_disk_size"] == config_mod.MAX_SIZE_GIB
    assert top["lease_seconds"] == config_mod.MAX_LEASE_SECONDS
    assert top["local_disk"] is None
    # The documented keys are the table's keys.
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert all(f"`{r.name}`" in doc for r in rows)
