"""Reading the YAML config file: bounded, refusing devices, with line numbers.

Returns the top-level entries with their 1-based line numbers (for the
provenance :func:`ecstore.config.load_config` records); never writes.
"""

from __future__ import annotations

import os
import stat
import sys
from typing import Any

import yaml

from ecstore.config.redact import short_repr
from ecstore.config.settings import EC_SECTION
from ecstore.errors import ConfigError
from ecstore.remote.url import mask_secrets

MAX_CONFIG_BYTES = 1 << 20


def read_bounded(path: str, what: str) -> bytes:
    """The bytes of a regular file (or a pipe, e.g. ``<(...)``), at most
    MAX_CONFIG_BYTES; a device, socket or directory is refused without
    reading it (``/dev/zero`` would never end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{what} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{what} cannot be read: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"{what} is a directory, not a YAML file")
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise ConfigError(f"{what} is not a regular file (a device or socket); give a YAML file")
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"{what} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{what} is larger than {MAX_CONFIG_BYTES >> 20} MiB; a config file is a few "
                          f"lines of YAML")
    return b"".join(chunks)


_MERGE_TAG = "tag:yaml.org,2002:merge"
#: Longest description of a YAML syntax error in a message, in characters.
MAX_YAML_PROBLEM = 500


def merged_pairs(pairs: list[tuple[Any, Any, int, bool]]) -> list[tuple[Any, Any, int]]:
    """(key, value, line) of a mapping's entries given as (key, value, line,
    merged), with YAML's "<<" merge rules: a key written in the mapping itself
    overrides a merged one, and of merged keys the one PyYAML puts last wins
    (``yaml.safe_load`` keeps the same value). A key written twice in the
    mapping itself is kept twice (the loader refuses it as set twice)."""
    seen: set[tuple[type, Any]] = set()
    kept = []
    for key, value, line, merged in reversed(pairs):
        tagged = (type(key), key)  # 1 and True are different keys
        if merged and tagged in seen:
            continue
        seen.add(tagged)
        kept.append((key, value, line))
    kept.reverse()
    return kept


def _bounded(text: str, limit: int) -> str:
    """``text`` on one line, secrets masked, at most ``limit`` characters."""
    text = mask_secrets(" ".join(text[: limit * 4].split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong in a malformed file, from PyYAML's error: its context,
    problem and note with their line and column, but never the snippet of
    the offending line PyYAML's own message quotes (it may hold a URL's
    password); secrets masked, at most :data:`MAX_YAML_PROBLEM` characters
    (tag and alias names are quoted in full by PyYAML)."""
    part = MAX_YAML_PROBLEM // 3

    def at(mark: Any) -> str:
        return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""

    if isinstance(exc, yaml.MarkedYAMLError):
        pieces = []
        if exc.context:
            shown = exc.context_mark is not None and (
                exc.problem_mark is None or (exc.context_mark.line, exc.context_mark.column)
                != (exc.problem_mark.line, exc.problem_mark.column))
            pieces.append(_bounded(str(exc.context), part) + (at(exc.context_mark) if shown else ""))
        if exc.problem:
            pieces.append(_bounded(str(exc.problem), part))
        if exc.note:
            pieces.append(_bounded(str(exc.note), part))
        text = ": ".join(pieces) or type(exc).__name__
    elif isinstance(exc, yaml.reader.ReaderError):
        char = exc.character
        code = char[0] if isinstance(char, bytes) and char else char if isinstance(char, int) else -1
        text = (f"unacceptable character or byte #x{code:02x} ({_bounded(str(exc.reason), part)}), "
                f"at position {exc.position}")
    else:
        text = str(exc)
    return _bounded(text, MAX_YAML_PROBLEM)


def read_yaml(path: str, origin: str) -> list[tuple[Any, Any, int, list[tuple[Any, Any, int]] | None]]:
    """Top-level entries of the YAML mapping in ``path`` as (key, value, line, ec).

    ``ec`` is the (key, value, line) list of a nested ``ec:`` mapping (value
    None), else None. Lines are 1-based. An empty file yields no entries.
    ``origin`` (where the path was named) goes into file-level errors.
    """
    what = f"config file {path} (from {origin})"
    data = read_bounded(path, what)

    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(data)  # ReaderError for bytes that are not UTF-8/16
        loader.name = path  # marks in YAML's messages then name the file

        def construct(node: yaml.Node) -> Any:
            """The Python value of ``node``. PyYAML's constructors raise plain
            Python errors for explicit tags they cannot build (``!!float abc``:
            ValueError, ``!!bool maybe``: KeyError, ``!!timestamp x``:
            AttributeError): a malformed file, at the node's position."""
            try:
                return loader.construct_object(node, deep=True)
            except (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError) as exc:
                mark = node.start_mark
                raise ConfigError(
                    f"{what}: malformed YAML at line {mark.line + 1}, column {mark.column + 1}: "
                    f"cannot build the value tagged {short_repr(node.tag)} ({type(exc).__name__}: "
                    f"{short_repr(str(exc))[1:-1]})") from None

        root = loader.get_single_node()
        if root is None or (isinstance(root, yaml.ScalarNode) and construct(root) is None):
            return []  # empty file, comments only, or a lone "---"
        if not isinstance(root, yaml.MappingNode):
            kind = "a list" if isinstance(root, yaml.SequenceNode) else "a single value"
            raise ConfigError(
                f"{what}: the top level must be a mapping of keys to values, got {kind} "
                f"at line {root.start_mark.line + 1}"
            )

        def pairs(node: yaml.MappingNode) -> list[tuple[Any, yaml.Node, int]]:
            """(key, value node, line) of each entry of ``node``, "<<" merge
            keys resolved as YAML does (:func:`merged_pairs`)."""
            explicit = sum(1 for key_node, _ in node.value if key_node.tag != _MERGE_TAG)
            loader.flatten_mapping(node)  # merged pairs first, then the mapping's own
            first_own = len(node.value) - explicit
            out = []
            for index, (key_node, value_node) in enumerate(node.value):
                key = construct(key_node)
                if not isinstance(key, (str, int, float, bool)) and key is not None:
                    key = short_repr(key)  # a list or mapping used as a key
                out.append((key, value_node, key_node.start_mark.line + 1, index < first_own))
            return merged_pairs(out)

        entries: list[tuple[Any, Any, int, list[tuple[Any, Any, int]] | None]] = []
        for key, value_node, line in pairs(root):
            if key == EC_SECTION and isinstance(value_node, yaml.MappingNode):
                nested = [(k, construct(v), ln) for k, v, ln in pairs(value_node)]
                entries.append((key, None, line, nested))
                continue
            value = construct(value_node)
            if key == EC_SECTION:
                if value is not None:
                    raise ConfigError(
                        f"{EC_SECTION} (from {path}:{line}): expected a mapping of ecstore "
                        f"keys (e.g. 'ec: {{max_local_disk_size: 64}}'), got {short_repr(value)}"
                    )
                entries.append((key, None, line, []))
            else:
                entries.append((key, value, line, None))
        return entries
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{what}: malformed YAML{where}: {yaml_problem(exc)}") from None
    except RecursionError:  # PyYAML composes and constructs recursively
        raise ConfigError(f"{what}: malformed YAML: nested deeper than Python can read "
                          f"({sys.getrecursionlimit()} levels); a config file is a flat mapping") from None
    finally:
        if loader is not None:
            loader.dispose()
