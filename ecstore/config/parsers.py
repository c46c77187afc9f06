"""Parsers of setting values as they appear in YAML, environment variables or overrides.

Each takes the raw value and returns the typed one, or raises ValueError
(whose message, if any, names the limit broken) or :class:`ConfigError`
(already worded, e.g. with a URL masked). :data:`ecstore.config.settings.KEYS`
maps every key to its parser. Pure functions, thread-safe.
"""

from __future__ import annotations

import datetime
import math
import os
from typing import Any

from ecstore.config.limits import normalize_local_disk, too_big
from ecstore.errors import ConfigError
from ecstore.lmdb.store_files import check_file_mode
from ecstore.remote.url import parse_remote_url

TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
FALSE_WORDS = frozenset({"false", "0", "no", "off"})


def parse_bool(value: Any) -> bool:
    """A boolean: YAML true/false, the ints 1/0, or one of the strings
    true/false, 1/0, yes/no, on/off in any case. Anything else is ValueError."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ValueError


def parse_number(value: Any, name: str = "") -> float:
    """A finite number >= 0: an int, a float or a numeric string ("2.5"),
    at most the limit of key ``name`` (see ``NUMBER_MAX``).

    Booleans, NaN, infinities, negatives, numbers over the limit and other
    strings are ValueError (the limit named in its message)."""
    if isinstance(value, str):
        try:
            value = float(value.strip()[:400])
        except ValueError:
            raise ValueError from None  # "lots"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError
    try:
        number = float(value)
    except OverflowError:
        raise ValueError from None
    if math.isnan(number) or number < 0:
        raise ValueError
    limit = too_big(name, number)
    if limit is not None:
        raise ValueError(limit)
    if math.isinf(number):
        raise ValueError
    return number


def parse_file_mode(value: Any) -> int:
    """An octal mode: a YAML octal int (``0660``, which YAML reads as 432)
    or a string ``"0660"`` / ``"660"`` / ``"0o660"``. A decimal int such as
    660 (YAML without the leading 0) is refused, not misread."""
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        if not text or any(c not in "01234567" for c in text):
            raise ValueError
        return check_file_mode(int(text, 8))
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError
    if value in (600, 640, 660):
        raise ValueError(f"{value} is decimal here: write 0{value} (YAML octal) or quote it as '0{value}'")
    return check_file_mode(value)


def parse_local_disk(value: Any, source: str) -> str | None:
    """A single directory (see :func:`normalize_local_disk`); LMCache's comma-separated list is refused."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError
    if "," in value:
        raise ValueError(
            "ecstore needs a single directory; LMCache's comma-separated multi-disk "
            "form is not supported here, give the encoder cache its own ec_local_disk"
        )
    return normalize_local_disk(value, source)


def parse_remote_url_setting(value: Any, source: str) -> str | None:
    """A remote URL (checked, never echoed unmasked), or None when empty."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise ConfigError(f"remote_url (from {source}): expected a redis:// URL, got a {type(value).__name__}")
    parse_remote_url(value, source)  # ConfigError with the URL masked
    return value.strip()


def not_text(value: Any, examples: bool = True) -> str:
    """Why a non-string ``value`` is refused where text is expected: YAML
    reads an unquoted ``1.10``, ``0123`` or ``on`` as a number or boolean
    whose text is lost (``1.1``, ``83``, ``True``), so it must be quoted.
    ``examples``: name example values in the hint (not for a secret)."""
    kind = ("boolean" if isinstance(value, bool) else "number" if isinstance(value, (int, float))
            else "date" if isinstance(value, datetime.date) else None)
    if kind is not None:
        eg = " (e.g. '1.10', '0123')" if examples else ""
        return f"YAML read it as a {kind}, not as the text written; quote it{eg} to keep it as written"
    return f"got a {type(value).__name__}, not a string"


def parse_text(value: Any) -> str | None:
    """A string value as written, or None: a YAML number, boolean, date,
    list or mapping is ValueError (see :func:`not_text`), never turned into
    text with ``str()`` (``1.10`` and ``1.1`` would become one value)."""
    if value is None or isinstance(value, str):
        return value
    raise ValueError(not_text(value))


def parse_secret(value: Any, source: str) -> str | None:
    """A password as a string, or None. A YAML number (``0123``, read as
    83) is refused with a hint to quote it; the value is never echoed."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"remote_password (from {source}): expected a string; {not_text(value, False)}")
    return value or None
