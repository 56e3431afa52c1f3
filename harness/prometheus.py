"""A real Prometheus server for tests: Debian's /usr/bin/prometheus on a free 127.0.0.1 port.

    from harness.prometheus import PrometheusServer, prometheus_server  # fixture

    with PrometheusServer(targets=["127.0.0.1:8001"]) as prom:
        prom.query("up")                  # -> the `data.result` list
        prom.wait_for("sum(up) == 2")     # poll until the query returns a sample, or raise

The server scrapes and evaluates every second (`scrape_interval`, `evaluation_interval`),
keeps its TSDB in a temporary directory, and is stopped (SIGTERM, then SIGKILL) on exit.
`rule_files` are loaded as given.  Tests that use it skip with a clear reason when the
binary is missing (`.ci/run` installs Debian's `prometheus` package).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.server_process import ServerProcess

PROMETHEUS_BIN = os.environ.get("KVPILOT_PROMETHEUS", "/usr/bin/prometheus")
# The Accept header Prometheus 2.x scrapes with (2.42, Debian 12's, seen on the wire): OpenMetrics
# first, with no `escaping=allow-utf-8`.
PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                       "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
# A Prometheus 3.x Accept header: its scrape protocols ask for `escaping=allow-utf-8` (UTF-8 names kept).
# The q-values are illustrative; prometheus_client's choose_encoder takes the first OpenMetrics entry.
PROMETHEUS_3_ACCEPT = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8,"
                       "application/openmetrics-text;version=0.0.1;q=0.75,"
                       "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.5,"
                       "text/plain;version=0.0.4;q=0.4,*/*;q=0.1")
# The metric relabelling the README gives a scrape config of your own (`observability.monitor: None`)
# for vLLM's names on Prometheus 2.x, written out as the docs give it rather than from kvpilot's constants.
VLLM_METRIC_RELABEL_CONFIGS: list[dict[str, Any]] = [
    {"source_labels": ["__name__"], "regex": "vllm_(.+)", "target_label": "__name__",
     "replacement": "vllm:$1", "action": "replace"},
]
PROMTOOL_BIN = os.environ.get("KVPILOT_PROMTOOL", "/usr/bin/promtool")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prometheus_binary() -> str | None:
    return PROMETHEUS_BIN if os.access(PROMETHEUS_BIN, os.X_OK) else shutil.which("prometheus")


def promtool_binary() -> str | None:
    return PROMTOOL_BIN if os.access(PROMTOOL_BIN, os.X_OK) else shutil.which("promtool")


def require_prometheus() -> str:
    binary = prometheus_binary()
    if binary is None:
        pytest.skip(
            f"prometheus binary not found at {PROMETHEUS_BIN} or on PATH "
            "(apt-get install prometheus; .ci/run installs it)"
        )
    return binary


def require_promtool() -> str:
    binary = promtool_binary()
    if binary is None:
        pytest.skip(
            f"promtool not found at {PROMTOOL_BIN} or on PATH (apt-get install prometheus; .ci/run installs it)"
        )
    return binary


class PrometheusError(RuntimeError):
    pass


class PrometheusServer(ServerProcess):
    """One Prometheus process with its own config and TSDB in a temporary directory."""

    def __init__(
        self,
        targets: Sequence[str] = (),
        *,
        job: str = "vllm",
        scrape_interval: str = "1s",
        evaluation_interval: str = "1s",
        rule_files: Sequence[str | Path] = (),
        scrape_configs: Sequence[dict[str, Any]] | None = None,
        ready_timeout: float = 20.0,
        full_config: dict[str, Any] | None = None,
        binary: str | None = None,
    ) -> None:
        self.targets = list(targets)
        self.job = job
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.rule_files = [str(Path(f).resolve()) for f in rule_files]
        self.scrape_configs = scrape_configs
        self.ready_timeout = ready_timeout
        # A whole configuration as written elsewhere (Prometheus Operator's), used as-is.
        self.full_config = full_config
        # Another Prometheus than Debian's (which is built without Kubernetes service discovery).
        self.binary = binary
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.port is None:
            raise PrometheusError("Prometheus is not started")
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        if self.full_config is not None:
            return self.full_config
        scrape = (
            list(self.scrape_configs)
            if self.scrape_configs is not None
            else (
                [{"job_name": self.job, "static_configs": [{"targets": self.targets}]}] if self.targets else []
            )
        )
        return {
            "global": {
                "scrape_interval": self.scrape_interval,
                "scrape_timeout": self.scrape_interval,
                "evaluation_interval": self.evaluation_interval,
            },
            "rule_files": self.rule_files,
            "scrape_configs": scrape,
        }

    def start(self) -> PrometheusServer:
        binary = self.binary or require_prometheus()
        self._tmp = tempfile.TemporaryDirectory(prefix="kvpilot-prom-")
        root = Path(self._tmp.name)
        config = root / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self.log_path = root / "prometheus.log"
        self._argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'tsdb'}",
            "--web.enable-lifecycle",
            "--storage.tsdb.retention.time=1d",
            "--log.level=warn",
        ]
        last_error = ""
        for _attempt in range(3):  # a free port can be taken between picking and binding it
            self.port = free_port()
            try:
                self.up()
                return self
            except PrometheusError as exc:
                last_error = str(exc)
        self.stop()
        raise PrometheusError(f"Prometheus did not start: {last_error}")

    def down(self) -> None:
        """Stop the process (an outage), keeping its port, config and TSDB for `up()`."""
        self._terminate()

    def up(self) -> None:
        """Start the process (again) on the same port and TSDB; return once it is ready."""
        assert self._tmp is not None, "start() first"
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log = log
        self.proc = subprocess.Popen([*self._argv, f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=Path(self._tmp.name))
        try:
            self._wait_ready()
        except PrometheusError:
            self._terminate()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise PrometheusError(f"exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise PrometheusError(f"not ready after {self.ready_timeout}s: {self.log_tail()}")

    # -- HTTP API ----------------------------------------------------------------------------

    def api(self, path: str, params: dict[str, Any] | None = None, *, method: str = "GET") -> dict[str, Any]:
        """Call /api/v1/<path>; return the whole JSON body (status error bodies too)."""
        query = urllib.parse.urlencode(params or {})
        url = f"{self.url}/api/v1/{path}"
        data = None
        if method == "POST":
            data = query.encode()
        elif query:
            url += "?" + query
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/x-www-form-urlencoded")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                body: dict[str, Any] = json.loads(resp.read())
                return body
        except urllib.error.HTTPError as exc:  # 400/422/503 carry {"status": "error", ...}
            body = json.loads(exc.read() or b"{}")
            return body

    def query(self, expr: str, time_: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if time_ is not None:
            params["time"] = time_
        body = self.api("query", params, method="POST")
        if body.get("status") != "success":
            raise PrometheusError(f"{body.get('errorType')}: {body.get('error')} (query: {expr})")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, expr: str, timeout: float = 30.0, interval: float = 0.25) -> list[dict[str, Any]]:
        """Poll `expr` until it returns at least one sample; raise with the last result otherwise."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(interval)
        raise PrometheusError(f"no result for {expr!r} within {timeout}s; last: {result}; log: {self.log_tail()}")

    def version(self) -> str:
        """The server's version (`/api/v1/status/buildinfo`), e.g. "2.42.0+ds"."""
        return str(self.api("status/buildinfo")["data"]["version"])

    def wait_for_targets_up(self, count: int, timeout: float = 30.0) -> None:
        self.wait_for(f'count(up{{job="{self.job}"}} == 1) >= {count}', timeout=timeout)

    def reload(self) -> None:
        req = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass


@pytest.fixture
def prometheus_server() -> Iterator[PrometheusServer]:
    """A started Prometheus with no scrape targets (for parsing and evaluating PromQL)."""
    with PrometheusServer() as prom:
        yield prom
