"""KMock fixtures the integration modules share: `api` (a KMock API server for the module) and
`operator` (kvpilot's operator against it, with the module's `operator_args`).  A module that wants
other operator flags overrides `operator_args`; one that wants another server overrides `api`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # KMock is imported only by the modules that ask for these fixtures
    from harness.kmock_api import KMockAPI, OperatorProcess


@pytest.fixture(scope="module")
def api() -> Iterator[KMockAPI]:
    from harness.kmock_api import KMockAPI

    with KMockAPI() as server:
        yield server


@pytest.fixture(scope="module")
def operator_args() -> tuple[str, ...]:
    """The operator's extra command-line flags (none)."""
    return ()


@pytest.fixture(scope="module")
def operator(api: KMockAPI, operator_args: tuple[str, ...],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    from harness.kmock_api import kopf_operator

    with kopf_operator(api, tmp_path_factory.mktemp("operator"), *operator_args) as op:
        yield op
