"""``python -m decode_node``: the decode daemon's entry point (a placeholder for now)."""

from __future__ import annotations

import sys


def main() -> int:
    print(
        "kvtransfer-decode: the decode daemon is not implemented yet (it arrives with the "
        "daemons issue); see README.md, section Limits",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
