"""The prefill daemon (``kvtransfer-prefill``).

Life cycle of a request (as it will be once the daemon issue lands; today only the skeleton
exists):

1. A `Generation` call arrives with ``kv_transfer_params={"do_remote_decode": true}``.
2. The engine admits it, prefills the prompt and samples one token.
3. The connector's ``request_finished`` keeps the blocks (delay free) and returns the params a
   decode engine needs to pull them (engine id, block ids, handshake address).
4. Decode engines fetch the handshake payload over ``KVHandshake`` and pull the blocks.
5. When every consumer reported the pull finished (or the lease expired) the blocks are freed.
"""
