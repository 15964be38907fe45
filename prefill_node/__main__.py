"""``kvtransfer-prefill`` / ``python -m prefill_node``: start the prefill daemon."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from kvtransfer.serve.daemon import main as run_daemon

    return run_daemon("prefill", argv)


if __name__ == "__main__":
    sys.exit(main())
