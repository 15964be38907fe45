"""The decode daemon (``kvtransfer-decode``): pulls a prompt's KV, then generates.

Life cycle of a request:

1. A ``Generation.Generate`` call arrives (from the router) with the prompt, the sampling
   options and the ``kv_transfer_params`` the prefill daemon returned; malformed params are
   INVALID_ARGUMENT (naming the key) before anything is allocated.
2. The scheduler offers the prompt to the connector: blocks already in the local prefix cache
   are kept, the rest are allocated and the request parks in ``WAITING_FOR_REMOTE_KVS``.
3. Each worker handshakes with the producer off the step thread (cached), then pulls exactly its
   layers and head slice of the missing blocks over UCX and reports ``finished_recving``
   (or ``failed_recving``: ``kv_load_failure_policy`` fails the request or recomputes it).
4. The request resumes: the last prompt token is recomputed and decoding streams tokens back,
   stop strings applied; the producer is told to free its blocks.
5. The final message carries finish_reason and the transfer's measurements (blocks and bytes
   received, time waited, tokens recomputed); KVAdmin counters add them up.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from kvtransfer.serve.daemon import main as run_daemon

    return run_daemon("decode", argv)


if __name__ == "__main__":
    sys.exit(main())
