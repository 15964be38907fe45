"""Helpers of the control-plane tests: a fake engine and a prefill server run as a subprocess.

Importable as ``control_helpers`` because pytest puts ``tests/`` on ``sys.path``; subprocesses get
the same through ``PYTHONPATH`` (see `helper_processes`).
"""
