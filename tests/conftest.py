"""Suite-wide options: the real-cluster e2e tests are opt-in."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--e2e",
        action="store_true",
        default=False,
        help="run tests/e2e against the current kube context (also: KVPILOT_E2E=1)",
    )


def e2e_enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("--e2e")) or os.environ.get("KVPILOT_E2E") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if e2e_enabled(config):
        return
    skip = pytest.mark.skip(reason="real-cluster e2e: opt in with --e2e or KVPILOT_E2E=1 (needs a kube context)")
    for item in items:
        # The marker, not the keyword: every test under tests/e2e has the keyword "e2e" (its
        # package's name), but only the kube-context ones need a cluster of one's own.
        if item.get_closest_marker("e2e"):
            item.add_marker(skip)
