"""The EC key: ``<model>@1@0@<chunk_hash>@<dtype>``.

* ``model`` is the served model name (``vllm_config.model_config.model``); it
  may itself contain ``@`` or ``/``, so keys are parsed from the right.
* ``1`` and ``0`` are sentinel world_size and worker_id: every tensor-parallel
  rank of a deployment maps to the same entry (the encoder output is
  replicated across ranks, so one copy serves all of them).
* ``chunk_hash`` is a stable 64-bit hash of vLLM's mm identifier (xxh64,
  seed 0, over its UTF-8 bytes), 16 lower-case hex digits. Being 64-bit it can
  collide; every entry therefore also stores the full identifier and reads
  compare it, so two colliding identifiers are never confused.
* ``dtype`` is the torch dtype name of the encoder output without ``torch.``
  (the model dtype, never the KV-cache dtype).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import xxhash

from ecstore.errors import InvalidEntryError

WORLD_SIZE_SENTINEL = 1
WORKER_ID_SENTINEL = 0

#: LMDB keys are limited to 511 bytes; leave room for the hash and dtype.
MAX_MODEL_NAME_BYTES = 400
#: Identifiers are stored in full inside each entry; bound them so a runaway
#: caller cannot bloat records. vLLM's are ~64-80 characters.
MAX_IDENTIFIER_BYTES = 4096

ChunkHasher = Callable[[str], str]


def chunk_hash(identifier: str) -> str:
    """Stable 64-bit hash of an mm identifier as 16 lower-case hex digits."""
    return xxhash.xxh64_hexdigest(identifier.encode("utf-8"))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    if not isinstance(dtype, torch.dtype):
        raise InvalidEntryError(f"expected a torch.dtype, got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises InvalidEntryError otherwise."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidEntryError(f"unknown torch dtype name {name!r}")
    return dt


def check_identifier_list(identifiers: object) -> list[str]:
    """The mm identifiers of a call that takes several (``lease``,
    ``release``), as a list. A ``str`` (or ``bytes``) is refused, not taken
    as its characters, and so is anything that is not a collection;
    each identifier is checked by :func:`check_identifier`."""
    if isinstance(identifiers, (str, bytes, bytearray, memoryview)) or not isinstance(identifiers, Iterable):
        shown = repr(identifiers)
        raise InvalidEntryError(
            f"expected a list of mm identifiers, got a {type(identifiers).__name__}"
            f" ({shown[:60] + '...' if len(shown) > 60 else shown})"
            + (": pass [identifier]" if isinstance(identifiers, str) else ""))
    return [check_identifier(i) for i in identifiers]


def check_device(device: object) -> torch.device:
    """The ``torch.device`` a tensor is asked on (``get(device=...)``), or
    InvalidEntryError: not a device (``"bogus"``, ``None``, an index with no
    accelerator), ``"meta"`` (holds no data), or a device type or index this
    process has none of (``"cuda"`` on a CPU build, ``"xpu"``, ``"cuda:99"``).
    Answers are cached per device: a device does not come and go."""
    if device == "cpu":
        return _CPU
    try:
        dev = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidEntryError(f"device {device!r} is not a torch device: {str(e).splitlines()[0]}") from None
    problem = _device_problem(dev)
    if problem:
        raise InvalidEntryError(f"device {device!r}: {problem}")
    return dev


_CPU = torch.device("cpu")


@functools.lru_cache(maxsize=64)
def _device_problem(dev: torch.device) -> str:
    """Why tensors cannot be placed on ``dev`` in this process ("" if they can)."""
    if dev.type == "cpu":
        return ""
    if dev.type == "meta":
        return "meta tensors hold no data"
    module = getattr(torch, dev.type, None)
    available = getattr(module, "is_available", None)
    try:
        if available is None or not available():
            return f"no {dev.type} device is available in this process"
        count = getattr(module, "device_count", None)
        if dev.index is not None and count is not None and dev.index >= count():
            return f"this process has {count()} {dev.type} device(s)"
    except Exception as e:  # noqa: BLE001  (a backend failing to answer: not usable)
        return f"{dev.type} is not usable: {type(e).__name__}: {e}"
    return ""


def check_identifier(identifier: object) -> str:
    """Validate an mm identifier; returns it unchanged.

    Must be a non-empty ``str`` that encodes to UTF-8 (lone surrogates do
    not) and is at most MAX_IDENTIFIER_BYTES long. Any character is allowed,
    ``@``, ``/`` and NUL included: the identifier is hashed into the key and
    stored verbatim in the entry, never parsed.
    """
    if not isinstance(identifier, str):
        raise InvalidEntryError(f"mm identifier must be a str, got {type(identifier).__name__}")
    if not identifier:
        raise InvalidEntryError("mm identifier must not be empty")
    try:
        raw = identifier.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidEntryError(f"mm identifier is not valid Unicode text: {e}") from None
    if len(raw) > MAX_IDENTIFIER_BYTES:
        raise InvalidEntryError(
            f"mm identifier is {len(raw)} bytes; at most {MAX_IDENTIFIER_BYTES} are accepted"
        )
    return identifier


def check_model(model: object) -> str:
    """Validate a model name for use in keys (non-empty UTF-8 str, bounded)."""
    if not isinstance(model, str) or not model:
        raise InvalidEntryError(f"model must be a non-empty str, got {model!r}")
    try:
        raw = model.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidEntryError(f"model name is not valid Unicode text: {e}") from None
    if len(raw) > MAX_MODEL_NAME_BYTES:
        raise InvalidEntryError(
            f"model name is {len(raw)} bytes; at most {MAX_MODEL_NAME_BYTES} fit in an LMDB key"
        )
    if "\x00" in model:
        raise InvalidEntryError("model name must not contain NUL")
    return model


def make_key(model: str, chunk: str, dtype: str) -> str:
    return f"{model}@{WORLD_SIZE_SENTINEL}@{WORKER_ID_SENTINEL}@{chunk}@{dtype}"


@dataclass(frozen=True)
class ECKey:
    """A parsed EC key."""

    model: str
    world_size: int
    worker_id: int
    chunk_hash: str
    dtype: str

    def __str__(self) -> str:
        return f"{self.model}@{self.world_size}@{self.worker_id}@{self.chunk_hash}@{self.dtype}"


def parse_key(key: str) -> ECKey:
    """Parse ``<model>@<ws>@<wid>@<chunk_hash>@<dtype>`` (model may contain ``@``)."""
    parts = key.rsplit("@", 4)
    if len(parts) != 5 or not parts[0]:
        raise InvalidEntryError(f"not an EC key: {key!r}")
    model, ws, wid, chunk, dtype = parts
    try:
        return ECKey(model, int(ws), int(wid), chunk, dtype)
    except ValueError:
        raise InvalidEntryError(f"not an EC key: {key!r}") from None


def looks_like_key(text: str) -> bool:
    try:
        parse_key(text)
        return True
    except InvalidEntryError:
        return False
