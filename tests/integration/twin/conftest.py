"""Fixtures for the twin server's integration tests: real `kvpilot twin serve` processes."""

from harness.twin_process import twin_factory  # noqa: F401  (re-exported fixture)
