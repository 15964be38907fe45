"""Helpers of the `SharedStorageConnector` tests (engines, prompts, cache access).

Importable as ``shared_storage_helpers`` because pytest puts ``tests/`` on ``sys.path``.
"""
