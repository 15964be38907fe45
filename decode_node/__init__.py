"""The decode daemon (``kvtransfer-decode``).

Life cycle of a request (as it will be once the daemon issue lands; today only the skeleton
exists):

1. A `Generation` call arrives with the ``kv_transfer_params`` a prefill daemon returned.
2. The scheduler allocates blocks (skipping prefix-cache hits) and parks the request in
   ``WAITING_FOR_REMOTE_KVS``.
3. The worker connectors handshake with the prefill engine (cached) and pull the blocks.
4. Once every worker reported the receive finished, the last prompt token is recomputed and
   decoding streams tokens back.
"""
