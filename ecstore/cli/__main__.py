"""``python -m ecstore.cli``: the same as the ``ecstore-dump`` script."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
