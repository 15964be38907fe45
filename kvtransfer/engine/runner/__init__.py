"""What runs inside one worker process: the worker, its model runner (batching, sampling,
drafting), its KV cache and the connector's worker half."""
