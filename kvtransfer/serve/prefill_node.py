"""The prefill daemon (``kvtransfer-prefill``): computes prompts' KV and lends it to decode.

Life cycle of a request:

1. A ``Generation.Generate`` call arrives (from the router) with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``; a bad field is INVALID_ARGUMENT, a daemon
   that is draining answers UNAVAILABLE.
2. The engine thread admits it: blocks are allocated (prefix-cache hits reused), the prompt is
   prefilled in one or more chunks, one token is sampled.
3. UcxConnector's ``request_finished`` keeps the blocks (delay free) under a lease and returns
   the params a decode engine pulls with: engine id, block ids, handshake host and port (the
   connector's ``kv_port``), TP x PP, token count. They end the call's stream.
4. A decode engine fetches the handshake (cached per engine and generation) and pulls the
   blocks over UCX from the workers that own them; its keep-alives extend the lease.
5. The decode scheduler reports the request done (Release); the next step frees the blocks
   (``finished_sending``). A consumer that never comes lets the lease expire, which frees them
   too. KVAdmin ``ListTransfers`` shows the KV still held.
6. When no decode will pull it (the decode call failed, the client went away), the router calls
   ``Generation.ReleaseKV`` with the params of step 3; UcxConnector's ``release_kv`` checks
   their ``remote_kv_secret`` and the next step frees the blocks, long before the lease ends.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from kvtransfer.serve.daemon import main as run_daemon

    return run_daemon("prefill", argv)


if __name__ == "__main__":
    sys.exit(main())
