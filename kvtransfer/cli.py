"""The ``kvtransfer`` command line: ``demo`` and ``connectors list``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["demo"]:
        # The demo owns its flags (``--help`` included); hand them over untouched.
        from kvtransfer.demo import main as demo_main

        return demo_main(args_list[1:])
    parser = argparse.ArgumentParser(prog="kvtransfer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("demo", help="run the main demo (see README); demo --help for flags")

    connectors = commands.add_parser("connectors", help="inspect registered KV connectors")
    connectors_cmds = connectors.add_subparsers(dest="connectors_command", required=True)
    listing = connectors_cmds.add_parser("list", help="every connector found via entry points")
    listing.add_argument("--json", action="store_true", help="machine-readable output")

    args = parser.parse_args(args_list)
    return _list_connectors(as_json=args.json)


def _list_connectors(as_json: bool) -> int:
    from kvtransfer.connector.factory import KVConnectorFactory

    rows = [
        {"name": entry.name, "class": entry.value, "distribution": entry.distribution}
        for entries in KVConnectorFactory.discover().values()
        for entry in entries
    ]
    rows.sort(key=lambda row: (row["name"], row["distribution"]))
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    widths = {k: max([len(k), *(len(r[k]) for r in rows)]) for k in ("name", "class")}
    print(f"{'name':<{widths['name']}}  {'class':<{widths['class']}}  distribution")
    names = [row["name"] for row in rows]
    for row in rows:
        clash = "  (CONFLICT: registered more than once)" if names.count(row["name"]) > 1 else ""
        print(
            f"{row['name']:<{widths['name']}}  {row['class']:<{widths['class']}}  "
            f"{row['distribution']}{clash}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
