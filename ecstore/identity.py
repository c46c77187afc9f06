"""The encoder identity (namespace) of an entry.

:class:`EncoderIdentity` holds what an encoder output depends on besides the
item (vLLM's ``mm_hash`` covers neither the weights nor the revision nor
server-level settings); its ``namespace`` is 32 lower-case hex digits (the
first 128 bits of SHA-256 over its canonical JSON), hashed into the key and
stored in the entry. Pure Python (no vLLM; the vLLM side is
``ecstore.connector.vllm_identity``). Why both places, and what counts:
docs/correctness.md#1-every-entry-has-an-encoder-identity-namespace.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

log = logging.getLogger("ecstore")

#: Version of ecstore's entry format; part of every identity, so a format
#: change never serves entries written by an older format.
FORMAT_VERSION = 2
NAMESPACE_LEN = 32
SEPARATOR = "/"
_HEX = re.compile(r"^[0-9a-f]{32}$")

#: File name patterns of weight files the fingerprint samples.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz", ".msgpack", ".h5")
#: Blocks sampled per weight file, and their size in bytes.
SAMPLE_BLOCKS = 64
SAMPLE_BLOCK_BYTES = 64 << 10
#: Leading bytes read in full (a safetensors header: tensor names, shapes, offsets).
HEAD_BYTES = 1 << 20


@dataclass(frozen=True)
class WeightsFingerprint:
    """What the weights were recognised by.

    ``method``: ``"hub-commit"`` (a hub cache snapshot: its commit fixes
    every file), ``"sampled"`` (sizes plus sampled
    blocks of every weight file), ``"dummy"`` (``load_format=dummy``: weights
    are a seeded random init, fixed by the config), ``"pinned"`` (the operator's
    ``namespace`` key), ``"config-only"`` (nothing readable: config + revision
    only; ``reason`` says why).
    """

    method: str
    value: str
    reason: str = ""


@dataclass(frozen=True)
class EncoderIdentity:
    """Everything an entry's encoder output depends on besides the item.

    ``settings`` holds JSON-able values (the vLLM settings that change
    encoder output; see docs/correctness.md). Immutable; :attr:`namespace` is
    a pure function of the fields.
    """

    model: str
    dtype: str
    revision: str | None
    weights: WeightsFingerprint
    settings: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def describe(self) -> dict[str, Any]:
        """The identity as a JSON-able dict (what ``ecstore-dump show`` prints)."""
        return {
            "format_version": self.format_version,
            "model": self.model,
            "dtype": self.dtype,
            "revision": self.revision,
            "weights": {"method": self.weights.method, "value": self.weights.value},
            "settings": _jsonable(dict(self.settings)),
        }

    def canonical(self) -> bytes:
        return json.dumps(self.describe(), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True).encode("ascii")

    @property
    def namespace(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()[:NAMESPACE_LEN]

    @classmethod
    def from_description(cls, d: Mapping[str, Any]) -> EncoderIdentity:
        """The identity :meth:`describe` described (same namespace); tools use
        it to open a store under an identity read from its namespaces table."""
        w = d["weights"]
        return cls(d["model"], d["dtype"], d["revision"], WeightsFingerprint(w["method"], w["value"]),
                   dict(d["settings"]), int(d["format_version"]))


def library_identity(model: str, dtype: str) -> EncoderIdentity:
    """The identity of an :class:`~ecstore.ECStore` opened without one
    (library use): the caller vouches that ``(model, dtype)`` fixes the encoder."""
    return EncoderIdentity(model, dtype, None, WeightsFingerprint("caller", "library"))


def _jsonable(value: Any) -> Any:
    """``value`` with every leaf made JSON-serialisable (repr as a last resort), keys as str."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    name = getattr(value, "name", None)  # enums
    if isinstance(name, str) and type(value).__module__ != "builtins":
        return f"{type(value).__name__}.{name}"
    return repr(value)


# --------------------------------------------------------------------------- stored names
def qualify(namespace: str, identifier: str) -> str:
    """The stored name of ``identifier`` under ``namespace``: ``"<ns>/<id>"``."""
    return f"{namespace}{SEPARATOR}{identifier}"


@dataclass(frozen=True)
class StoredName:
    """A stored name split into its parts (``namespace`` None: not qualified)."""

    namespace: str | None
    identifier: str


def split_stored(name: str) -> StoredName:
    """Split ``"<ns>/<id>"``; a name without a 32-hex namespace prefix comes
    back with ``namespace=None`` (entries written before identities existed)."""
    if len(name) > NAMESPACE_LEN and name[NAMESPACE_LEN] == SEPARATOR and _HEX.match(name[:NAMESPACE_LEN]):
        return StoredName(name[:NAMESPACE_LEN], name[NAMESPACE_LEN + 1:])
    return StoredName(None, name)


def check_namespace_pin(value: Any) -> str | None:
    """Validate the ``namespace`` config value: None/empty (no pin) or a
    non-empty printable string of at most 200 characters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError("expected a string")
    text = value.strip()
    if not text:
        return None
    if len(text) > 200 or not text.isprintable():
        raise ValueError("expected at most 200 printable characters")
    return text


# --------------------------------------------------------------------------- weights
_HUB_SNAPSHOT = re.compile(r"[/\\]models--[^/\\]+[/\\]snapshots[/\\]([0-9a-f]{40})(?:[/\\]|$)")


def _weight_files(directory: Path) -> list[Path]:
    out = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.endswith(WEIGHT_SUFFIXES):
                out.append(Path(root) / name)
    return sorted(out)


def _sample_file(path: Path, hasher: Any) -> None:
    """Feed ``path``'s size, first HEAD_BYTES and SAMPLE_BLOCKS evenly spread
    blocks to ``hasher`` (about 5 MiB read per file, whatever its size)."""
    size = path.stat().st_size
    hasher.update(f"{size}\n".encode())
    with open(path, "rb") as fh:
        hasher.update(fh.read(HEAD_BYTES))
        if size > HEAD_BYTES:
            span = size - HEAD_BYTES
            for i in range(SAMPLE_BLOCKS):
                fh.seek(HEAD_BYTES + (span * i) // SAMPLE_BLOCKS)
                hasher.update(fh.read(SAMPLE_BLOCK_BYTES))
            fh.seek(max(HEAD_BYTES, size - SAMPLE_BLOCK_BYTES))
            hasher.update(fh.read(SAMPLE_BLOCK_BYTES))


def fingerprint_weights(model: str, *, revision: str | None = None, load_format: str = "auto",
                        model_weights: str = "", pinned: str | None = None) -> WeightsFingerprint:
    """Fingerprint the weights vLLM will load for ``model``. Never raises.

    * ``pinned`` (the ``namespace`` key): used as is, nothing read.
    * ``load_format="dummy"``: the weights are vLLM's seeded random init.
    * a hub cache snapshot (a ``.../models--org--name/snapshots/<commit>``
      path, or a repo id whose snapshot is in the local hub cache): the commit.
    * a local directory: every weight file (``WEIGHT_SUFFIXES``, recursively)
      by relative path and size, its first MiB and 65 blocks of 64 KiB spread
      over it (about 5 MiB per file: well under a second for a 15 GB
      checkpoint on an SSD).
    * anything else (a hub id not downloaded here, ``s3://``/``gs://`` URIs,
      runai/tensorizer, a directory without weight files): ``config-only``,
      with the reason; the identity then rests on the model string, revision
      and config, which is logged as a warning by the caller.
    """
    if pinned:
        return WeightsFingerprint("pinned", pinned)
    if load_format == "dummy":
        return WeightsFingerprint("dummy", "seeded-random-init")
    source = model_weights or model
    if "://" in source:
        return WeightsFingerprint("config-only", "", f"weights at {source} are remote: not read")
    directory = Path(source).expanduser()
    snap = _hub_snapshot_dir(source, revision) if not directory.is_dir() or hub_commit(str(directory)) else None
    if snap is not None and hub_commit(str(snap)):
        # A hub snapshot is named by its commit, which fixes every file in it;
        # known before the weights are downloaded (scheduler and workers agree).
        return WeightsFingerprint("hub-commit", hub_commit(str(snap)) or "")
    if not directory.is_dir():
        return WeightsFingerprint("config-only", "",
                                  f"{source} is not a local directory and no hub snapshot was found")
    try:
        files = _weight_files(directory)
        if not files:
            return WeightsFingerprint("config-only", "", f"no weight files in {directory}")
        hasher = xxhash.xxh3_128()
        for f in files:
            hasher.update(f"{f.relative_to(directory).as_posix()}\n".encode())
            _sample_file(f, hasher)
        return WeightsFingerprint("sampled", hasher.hexdigest())
    except OSError as e:
        return WeightsFingerprint("config-only", "", f"weight files unreadable: {e}")


def _hub_snapshot_dir(model: str, revision: str | None) -> Path | None:
    """The local hub-cache snapshot of repo id ``model`` vLLM resolved (best effort)."""
    if _HUB_SNAPSHOT.search(model):
        return Path(model)
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(model, revision=revision, local_files_only=True,
                                 allow_patterns=["*.json"])
        return Path(path)
    except Exception:  # noqa: BLE001 - not cached, offline, no huggingface_hub: degrade
        return None


def hub_commit(path: str) -> str | None:
    """The commit of a hub cache snapshot path, else None."""
    m = _HUB_SNAPSHOT.search(path + "/")
    return m.group(1) if m else None
