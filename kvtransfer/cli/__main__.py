"""``python -m kvtransfer.cli``: the same as ``kvtransfer``."""

from __future__ import annotations

import sys

from kvtransfer.cli import main

if __name__ == "__main__":
    sys.exit(main())
