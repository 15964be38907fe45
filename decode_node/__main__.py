"""``python -m decode_node``: the decode daemon's entry point (a placeholder for now)."""

from __future__ import annotations

import sys

from kvtransfer.daemon_placeholder import not_implemented


def main() -> int:
    return not_implemented("decode")


if __name__ == "__main__":
    sys.exit(main())
