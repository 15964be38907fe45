"""Helpers for the deploy tests: an offline kustomize emulation (tests/test_deploy.py) and the
series PromQL expressions read (tests/test_deploy_dashboards.py)."""
