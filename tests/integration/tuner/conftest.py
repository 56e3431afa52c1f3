"""The tuner's Kubernetes client against the module's KMock `api`, in the module's namespace `NS`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from harness.kmock_api import KMockAPI


@pytest.fixture(scope="module")
def client(api: KMockAPI, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from harness.kmock_api import tuner_client

    return tuner_client(api, tmp_path_factory.mktemp("kube"), request.module.NS)
