"""``python -m prefill_node``: the prefill daemon's entry point (a placeholder for now)."""

from __future__ import annotations

import sys

from kvtransfer.daemon_placeholder import not_implemented


def main() -> int:
    return not_implemented("prefill")


if __name__ == "__main__":
    sys.exit(main())
