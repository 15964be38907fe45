"""``kvtransfer-decode`` / ``python -m decode_node``: start the decode daemon."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from kvtransfer.serve.daemon import main as run_daemon

    return run_daemon("decode", argv)


if __name__ == "__main__":
    sys.exit(main())
