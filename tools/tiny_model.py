#!/usr/bin/env python
"""Command line of :mod:`ecstore.testing.tiny_model`: build the tiny BLIP-2 into a directory."""

import sys

from ecstore.testing.tiny_model import main

if __name__ == "__main__":
    sys.exit(main())
