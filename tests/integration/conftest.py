"""Fixtures of tests/integration; the helpers live in integration_harness.py."""

from integration_harness import driver_run, tiny_models  # noqa: F401  (pytest fixtures)
