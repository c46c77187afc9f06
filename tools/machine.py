"""What the benchmarks and demos record about the machine they ran on."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded (empty where unknown)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []
