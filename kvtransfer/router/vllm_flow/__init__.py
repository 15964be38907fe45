"""The P/D flow on vLLM OpenAI servers (``--engine vllm``), over HTTP: vLLM's own
``kv_transfer_params`` flow with this router's picks and retries (`proxy.VllmProxy`, life cycle
docstring), the request as the flow sees it (`request`), the HTTP calls (`calls`), vLLM's answers
read (`answers`) and what goes wrong with them (`failures`)."""
