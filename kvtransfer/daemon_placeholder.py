"""Entry point the daemon commands share until the daemons exist (they arrive with issue [4/4])."""

from __future__ import annotations

import sys


def not_implemented(role: str) -> int:
    print(
        f"kvtransfer-{role}: the {role} daemon is not implemented yet (it arrives with the "
        "daemons issue); see README.md, section 'Status and limits'",
        file=sys.stderr,
    )
    return 2
