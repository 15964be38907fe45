"""Helpers of the `UcxConnector` tests: real engines on the tiny model, synthetic engines of bare
connector halves with seeded caches, and a thread that keeps a producer stepping.

Importable as ``ucx_helpers`` because pytest puts ``tests/`` on ``sys.path``.
"""
