"""Thin wrappers around the real `kubectl` and `helm` CLIs for the e2e suite.

The CLIs, not a client library: the suite then does exactly what the quickstarts tell a person
to do, against whatever the current kube context is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any


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


def kubectl(*args: str, timeout: float = 120, input_text: str | None = None, check: bool = True) -> str:
    return run(["kubectl", *args], timeout=timeout, input_text=input_text, check=check)


def kubectl_json(*args: str, timeout: float = 60) -> Any:
    return json.loads(kubectl(*args, "-o", "json", timeout=timeout))


def apply(obj: dict[str, Any]) -> None:
    kubectl("apply", "-f", "-", input_text=json.dumps(obj))


def helm(*args: str, timeout: float = 600) -> str:
    return run(["helm", *args], timeout=timeout)


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
