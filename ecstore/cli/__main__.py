"""``python -m ecstore.cli``: the same as the ``ecstore-dump`` script."""

import sys

from ecstore.cli import main

if __name__ == "__main__":
    sys.exit(main())
