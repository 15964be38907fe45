"""A KV transfer agent serving seeded caches until stdin closes.

    python -m transport_helpers.kv_server --seed 3 --group model.layers:0:3:float32 [--no-serve]
        [--order BH2ND] [--data-plane tagged] [--push-lease ID:SECRET:7,3,9]

``--order`` stores every layer physically in that axis order (registered as its ``B2HND``
view, values unchanged). ``--push-lease`` also takes pushes, and grants that push lease of its
blocks (every layer) to the producer presenting the secret.

Prints one JSON line ``{"address": hex, "layouts": {...}, "pid": n}`` once serving; then
answers each ``counters`` line on stdin with one JSON line of its server's counters
(``messages_received``: every message its code handled).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvtransfer.transport import (
    KV_AXES,
    KVTransferAgent,
    LeaseGrants,
    TransportConfig,
    secret_digest,
)
from transport_helpers.kv import LayerGroup, in_order, make_caches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--group", action="append", required=True)
    parser.add_argument("--no-serve", action="store_true")
    parser.add_argument("--send-timeout", type=float, default=5.0)
    parser.add_argument("--order", default=KV_AXES)
    parser.add_argument("--data-plane", default="rma")
    parser.add_argument("--push-lease", default=None)
    args = parser.parse_args()
    groups = [LayerGroup.decode(text) for text in args.group]
    agent = KVTransferAgent(
        TransportConfig(send_timeout_s=args.send_timeout, data_plane=args.data_plane)
    )
    agent.register_kv_caches(
        {name: in_order(t, args.order) for name, t in make_caches(args.seed, groups).items()}
    )
    push_grants = None
    if args.push_lease is not None:
        lease_id, secret, blocks = args.push_lease.split(":")
        push_grants = LeaseGrants()
        names = [name for group in groups for name in group.names()]
        ids = [int(b) for b in blocks.split(",")]
        push_grants.grant_push(lease_id, secret_digest(secret), ids, names)
    if not args.no_serve:
        agent.start_server(push_grants=push_grants)
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
