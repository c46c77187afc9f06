"""Keeping credentials and huge values out of messages, logs and tool output.

Text is masked by ecstore's one masker,
:func:`ecstore.remote.url.mask_secrets` (URL passwords, secret query
parameters); config values are shown through it by ``ecstore-dump config``,
config errors and the store's log lines.

* :func:`is_secret_key` tells whether a config key names a secret by itself
  (``remote_password``, ``*_token``...): its whole value is masked.
* :func:`short_repr` is ``repr`` bounded in size and cost (a YAML alias bomb
  must not produce a 500 MB error message), with secrets masked.

Pure functions, thread-safe.
"""

from __future__ import annotations

import re
import reprlib
from typing import Any

from ecstore.remote.url import MASK, SECRET_WORDS, mask_secrets

#: Longest value representation put into a message, in characters.
MAX_REPR = 200

_SECRET_KEY = re.compile(rf"(?i)(?:^|[_.-]){SECRET_WORDS}$")


def is_secret_key(key: str) -> bool:
    """True if a config key's name says its value is a secret
    (``password``, ``remote_password``, ``auth_token``, ``api_key``...)."""
    return bool(_SECRET_KEY.search(key))


def mask_value(key: str, value: Any) -> Any:
    """A config value as it may be shown: the whole value masked for a
    secret key (if set), URL passwords masked in strings, else unchanged."""
    if value is None or value == "":
        return value
    if is_secret_key(key):
        return MASK
    if isinstance(value, str):
        return mask_secrets(value)
    return value


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxstring = _REPR.maxother = MAX_REPR
_REPR.maxlong = 60


def short_repr(value: Any, limit: int = MAX_REPR) -> str:
    """``repr(value)`` with secrets masked, nesting and length bounded
    (cost bounded too: shared YAML aliases are never expanded in full)."""
    if isinstance(value, str):
        text = repr(mask_secrets(value[: limit * 4]))
    else:
        text = mask_secrets(_REPR.repr(value))
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text
