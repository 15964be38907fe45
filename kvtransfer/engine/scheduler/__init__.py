"""The scheduler side of one engine: requests, their KV blocks and the connector's scheduler
half. Nothing here runs the model; `SchedulerOutput` is what it hands the executor."""
