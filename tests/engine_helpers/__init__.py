"""Helpers of the engine tests (dense model reference, scheduler and worker stand-ins).

Importable as ``engine_helpers`` because pytest puts ``tests/`` on ``sys.path``; processes
spawned with ``multiprocessing`` inherit the parent's ``sys.path``.
"""
