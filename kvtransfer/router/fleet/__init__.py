"""The fleet and its health: the instances of every role (`fleet.Fleet`: membership, picking,
leases), each one's state (`instance`), health checks and load (`health`), circuit breakers
(`breaker`), DNS names (`dns`), vLLM servers reached over HTTP (`vllm_endpoint`), and what the
fleet tells as it changes (`listener`): the metrics, and the cache-aware policies' indexes
(`cache_wiring`)."""
