"""Make ecstore's INFO lines (``EC put: ...``) show in vLLM's console output.

vLLM configures only its own ``vllm`` logger; the ``ecstore`` logger would
fall through to Python's last-resort handler, which drops INFO. Unless the
user configured logging themselves (a handler on ``ecstore`` or on the root
logger) or disabled vLLM's (``VLLM_CONFIGURE_LOGGING=0``), we attach a
console handler formatted like vLLM's own lines.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s.%(msecs)03d [%(filename)s:%(lineno)d] %(message)s"
_DATEFMT = "%m-%d %H:%M:%S"


def ensure_console_logging() -> None:
    logger = logging.getLogger("ecstore")
    if logger.handlers or logging.getLogger().handlers:
        return
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    handler = logging.StreamHandler(sys.stdout)
    try:
        from vllm.logging_utils import NewLineFormatter

        handler.setFormatter(NewLineFormatter(_FORMAT, datefmt=_DATEFMT))
    except Exception:  # formatter moved: plain format still works  # noqa: BLE001
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATEFMT))
    logger.addHandler(handler)
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    logger.setLevel(getattr(logging, level, logging.INFO))
    logger.propagate = False
