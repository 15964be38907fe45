"""``python -m control_helpers.prefill_server``: a prefill engine's control server, for tests.

Prints one JSON line when serving (address, generation, and the metadata its connector received,
as JSON per ``"pp,tp"``), then serves until stdin closes.
"""

from __future__ import annotations

import argparse
import json
import sys

from control_helpers.fake_engine import make_compat, start_engine
from kvtransfer.control import BasicAdminBackend, ControlServerThread, HandshakeBook


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--no-publish", action="store_true")
    args = parser.parse_args()

    book = HandshakeBook(args.engine_id, make_compat())
    received = {}
    if not args.no_publish:
        connector = start_engine(book, args.pp, args.tp)
        published = connector.received or {}
        received = {f"{pp},{tp}": md.encode().decode() for (pp, tp), md in published.items()}
    admin = BasicAdminBackend(
        role="kv_producer", engine_id=args.engine_id, model=book.compat.model, num_blocks=64
    )
    with ControlServerThread(book=book, admin=admin) as server:
        ready = {"address": server.address, "generation": book.generation, "received": received}
        print(json.dumps(ready), flush=True)
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
