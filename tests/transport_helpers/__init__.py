"""Helpers of the data-plane tests: seeded KV caches and a KV server run as a subprocess.

Importable as ``transport_helpers`` because pytest puts ``tests/`` on ``sys.path``; subprocesses
get the same through ``PYTHONPATH`` (see `helper_processes`).
"""
