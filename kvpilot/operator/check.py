"""`kvpilot check`: is an installed kvpilot working? The chart's `helm test` hook runs it in a pod.

Two checks, each reported on its own line: the operator answers `/healthz` with 200 (a replica is
watching, or ready to take over), and the API server serves the InferenceService resource (its CRD is
installed and Established: the group's discovery lists it). Discovery is readable by every authenticated
client (the `system:discovery` ClusterRole), so the hook's pod needs no RBAC of its own.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.api.vocabulary import GROUP, PLURAL, VERSION

EXIT_OK = 0
EXIT_FAILED = 1


@dataclass(frozen=True)
class Outcome:
    what: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok' if self.ok else 'FAILED'}: {self.what}: {self.detail}"


def check_healthz(operator_url: str, timeout_s: float) -> Outcome:
    url = operator_url.rstrip("/") + "/healthz"
    what = f"operator {url}"
    req = urllib.request.Request(url, headers={"User-Agent": "kvpilot-check"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            return Outcome(what, resp.status == 200, f"HTTP {resp.status}")
    except urllib.error.HTTPError as exc:
        return Outcome(what, False, f"HTTP {exc.code}: {exc.read(200).decode(errors='replace').strip()}")
    except (OSError, urllib.error.URLError) as exc:
        return Outcome(what, False, f"unreachable: {getattr(exc, 'reason', exc)}")


Discover = Callable[[str], object]


def check_crd_served(discover: Discover) -> Outcome:
    path = f"/apis/{GROUP}/{VERSION}"
    what = f"{PLURAL}.{GROUP}/{VERSION} served"
    try:
        listing = discover(path)
    except urllib.error.HTTPError as exc:
        return Outcome(what, False, f"GET {path}: HTTP {exc.code}")
    except (OSError, urllib.error.URLError) as exc:
        return Outcome(what, False, f"GET {path}: API server unreachable: {getattr(exc, 'reason', exc)}")
    names = {r.get("name") for r in listing.get("resources", [])} if isinstance(listing, dict) else set()
    if PLURAL in names:
        return Outcome(what, True, f"GET {path} lists {PLURAL}")
    return Outcome(what, False, f"GET {path} does not list {PLURAL} (served: {sorted(n for n in names if n)})")


def api_discovery(timeout_s: float) -> Discover:
    """GET on the API server with the pod's service account (in a cluster) or $KUBECONFIG (elsewhere),
    through kopf's login, as the operator itself authenticates."""
    import kopf

    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no in-cluster service account and no kubeconfig (set KUBECONFIG)")
    context: ssl.SSLContext | None = info.as_ssl_context() if info.server.startswith("https") else None
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    headers = {"Accept": "application/json", "User-Agent": "kvpilot-check", **info.as_http_headers()}

    def get(path: str) -> object:
        req = urllib.request.Request(info.server.rstrip("/") + path, headers=headers)
        with opener.open(req, timeout=timeout_s) as resp:
            return json.loads(resp.read().decode())

    return get
