"""Helpers for tests/test_deploy.py: an offline kustomize emulation."""
