"""How the e2e suite reaches a cluster: the real `kubectl`, and Helm's install and uninstall.

The CLIs, not a client library, so the suite does exactly what the quickstarts tell a person to
do. Two targets (conftest.py):

- the current kube context: `kubectl` and `helm` from PATH;
- the `cluster` tests' control plane (harness/cluster.py): its own `kubectl` (the same
  Kubernetes build as the server) with the control plane's kubeconfig, and Helm's own install
  and uninstall actions through helm-python-sdk (the Helm library the chart tests already render
  with), because no `helm` binary is built there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class CommandError(AssertionError):
    pass


def run(
    args: Sequence[str], *, timeout: float = 120, input_text: str | None = None, check: bool = True
) -> str:
    """Run a command; return stdout. Fail with the command and its stderr on a non-zero exit."""
    try:
        result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, input=input_text)
    except subprocess.TimeoutExpired as exc:
        raise CommandError(f"`{' '.join(args)}` did not finish in {timeout} s") from exc
    if check and result.returncode != 0:
        raise CommandError(f"`{' '.join(args)}` exited {result.returncode}:\n{result.stderr.strip()}")
    return result.stdout


@dataclass(frozen=True)
class Kubectl:
    """`kubectl`, with the binary and kubeconfig of the target (PATH and the current context by default)."""

    binary: str = "kubectl"
    kubeconfig: Path | None = None

    def __call__(self, *args: str, timeout: float = 120, input_text: str | None = None, check: bool = True) -> str:
        config = [f"--kubeconfig={self.kubeconfig}"] if self.kubeconfig else []
        return run([self.binary, *config, *args], timeout=timeout, input_text=input_text, check=check)

    def json(self, *args: str, timeout: float = 60) -> Any:
        return json.loads(self(*args, "-o", "json", timeout=timeout))

    def apply(self, obj: dict[str, Any]) -> None:
        self("apply", "-f", "-", input_text=json.dumps(obj))


class Helm(Protocol):
    def install(self, release: str, chart: Path, namespace: str, values: Mapping[str, Any], *,
                timeout_s: int) -> None:
        """Install and wait until every object is ready (`helm install --wait`)."""
        ...

    def uninstall(self, release: str, namespace: str, *, timeout_s: int) -> None:
        """Uninstall and wait until its objects are gone (`helm uninstall --wait`)."""
        ...


@dataclass(frozen=True)
class HelmCLI:
    """The `helm` binary on PATH, against the current kube context."""

    def install(self, release: str, chart: Path, namespace: str, values: Mapping[str, Any], *,
                timeout_s: int) -> None:
        with tempfile.TemporaryDirectory(prefix="kvpilot-e2e-helm-") as tmp:
            values_file = Path(tmp) / "values.json"
            values_file.write_text(json.dumps(values))
            run(["helm", "install", release, str(chart), "--namespace", namespace, "--values", str(values_file),
                 "--wait", "--timeout", f"{timeout_s}s"], timeout=timeout_s + 60)

    def uninstall(self, release: str, namespace: str, *, timeout_s: int) -> None:
        run(["helm", "uninstall", release, "--namespace", namespace, "--wait", "--timeout", f"{timeout_s}s"],
            timeout=timeout_s + 60)


@dataclass(frozen=True)
class HelmLibrary:
    """Helm's own install/uninstall actions (helm-python-sdk), release Secrets and all, with a kubeconfig."""

    kubeconfig: Path

    def _config(self, namespace: str) -> Any:
        import helm_python

        return helm_python.Config(kubeconfig_path=self.kubeconfig, namespace=namespace)

    def install(self, release: str, chart: Path, namespace: str, values: Mapping[str, Any], *,
                timeout_s: int) -> None:
        with self._config(namespace) as config:
            config.install(chart, release, dict(values), namespace=namespace, wait="watcher", timeout=timeout_s)

    def uninstall(self, release: str, namespace: str, *, timeout_s: int) -> None:
        with self._config(namespace) as config:
            config.uninstall(release, wait="watcher", timeout=timeout_s)


def missing_tools() -> list[str]:
    return [tool for tool in ("kubectl", "helm") if shutil.which(tool) is None]


def wait_for(predicate: Callable[[], Any], *, timeout: float, what: str, interval: float = 2.0) -> Any:
    """Poll until `predicate` returns something truthy; fail after `timeout` s naming `what`."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
        except (CommandError, KeyError, IndexError, TypeError, ValueError) as exc:
            last_error, result = exc, None
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.0f} s waiting for {what}"
        + (f" (last error: {last_error})" if last_error else "")
    )


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions", []):
        if cond.get("type") == type_:
            return dict(cond)
    return None
