"""A KV transfer agent serving seeded caches until stdin closes.

    python -m transport_helpers.kv_server --seed 3 --group model.layers:0:3:float32 [--no-serve]
        [--order BH2ND] [--data-plane tagged]

``--order`` stores every layer physically in that axis order (registered as its ``B2HND``
view, values unchanged).

Prints one JSON line ``{"address": hex, "layouts": {...}, "pid": n}`` once serving; then
answers each ``counters`` line on stdin with one JSON line of its server's counters
(``messages_received``: every message its code handled).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvtransfer.transport import KV_AXES, KVTransferAgent, TransportConfig
from transport_helpers.kv import LayerGroup, in_order, make_caches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--group", action="append", required=True)
    parser.add_argument("--no-serve", action="store_true")
    parser.add_argument("--send-timeout", type=float, default=5.0)
    parser.add_argument("--order", default=KV_AXES)
    parser.add_argument("--data-plane", default="rma")
    args = parser.parse_args()
    groups = [LayerGroup.decode(text) for text in args.group]
    agent = KVTransferAgent(
        TransportConfig(send_timeout_s=args.send_timeout, data_plane=args.data_plane)
    )
    agent.register_kv_caches(
        {name: in_order(t, args.order) for name, t in make_caches(args.seed, groups).items()}
    )
    if not args.no_serve:
        agent.start_server()
    layouts = {name: layout.as_dict() for name, layout in agent.kv_layouts().items()}
    print(json.dumps({"address": agent.address.hex(), "layouts": layouts, "pid": os.getpid()}))
    sys.stdout.flush()
    # Until stdin closes; a "counters" line is answered with what the server's code handled.
    for line in sys.stdin:
        if line.strip() == "counters":
            server = agent.server
            counters = {
                name: getattr(server, name, 0)
                for name in ("messages_received", "requests_served", "keys_served")
            }
            print(json.dumps(counters), flush=True)
    agent.close()


if __name__ == "__main__":
    main()
