"""How an instance of a role is picked: the `Policy` interface and the built-in policies
(`policy`), the cache-aware policy (`cache_policy`) and what it knows of every instance's KV
cache: the prefix index (`prefix_index`), fed by KV cache events (`kv_events`). Below the
fleet, which offers the candidates and asks the role's policy to choose."""
