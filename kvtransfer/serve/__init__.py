"""The daemons' runtime: settings, the engine thread, the Generation service, KVAdmin answers,
metrics, and launching daemons as child processes (demo, tests)."""
