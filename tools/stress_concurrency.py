#!/usr/bin/env python
"""Command line of :mod:`ecstore.testing.stress_concurrency` (``--help`` lists the options)."""

import sys

from ecstore.testing.stress_concurrency import main

if __name__ == "__main__":
    sys.exit(main())
