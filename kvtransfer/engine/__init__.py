"""The engine: a small paged-KV transformer engine (scheduler process + TPxPP workers).

Calls flow one way: `llm` -> `engine_core` -> `scheduler` (with `block_manager`) -> `executor`
-> `worker` -> `model_runner` -> `model` / `sampler` / `spec_decode`, with the KV connector
hooks called by `scheduler` (scheduler role) and `kv_connector` (worker role).
"""
