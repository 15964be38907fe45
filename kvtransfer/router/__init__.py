"""The OpenAI-compatible router in front of prefill and decode daemons (``kvtransfer-router``)."""
