"""The real helm CLI for tests: built by scripts/build-helm.sh (helm.sh/helm/v4, pinned in tools/helm/go.mod)
and cached by version, like the control plane's binaries; and the chart README's helm commands, so the tests
run exactly what users are told to run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from harness.cluster import not_built, print_dir

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "scripts" / "build-helm.sh"
CHART_README = ROOT / "charts" / "kvpilot" / "README.md"


def built_helm() -> Path:
    """The helm binary; without it a test skips, saying how to build it, and in CI fails."""
    binary = print_dir(BUILD_SCRIPT) / "helm"
    if not os.access(binary, os.X_OK):
        not_built(f"helm CLI not built: {binary} missing; run `make helm` "
                  "(scripts/build-helm.sh; needs Go >= 1.26 and the Go module proxy)")
    return binary


def readme_commands(section: str | None = None, readme: Path = CHART_README) -> list[list[str]]:
    """Every `helm ...` line of the README's fenced blocks (continuation lines joined), split as a shell
    would; only those under the `## <section>` heading when given."""
    text = readme.read_text()
    if section is not None:
        parts = re.split(r"^## ", text, flags=re.M)
        found = [p for p in parts if p.split("\n", 1)[0].strip() == section]
        assert found, f"{readme} has no section '## {section}'"
        text = found[0]
    commands = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv[:1] == ["helm"]:
                commands.append(argv)
    return commands


def readme_command(verb: str, section: str | None = None) -> list[str]:
    """The one `helm <verb>` command of the README (of one section when given)."""
    found = [c for c in readme_commands(section) if c[1:2] == [verb]]
    assert len(found) == 1, f"expected one `helm {verb}` in {CHART_README.name} (section {section!r}), found {found}"
    return found[0]


@dataclass(frozen=True)
class Helm:
    """Runs the helm binary against one kubeconfig, with its caches and config in `home` (never the user's)."""

    binary: Path
    kubeconfig: Path
    home: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "HELM_CACHE_HOME": str(self.home / "cache"),
                "HELM_CONFIG_HOME": str(self.home / "config"), "HELM_DATA_HOME": str(self.home / "data")}

    def argv(self, command: list[str]) -> list[str]:
        assert command[0] == "helm", command
        return [str(self.binary), *command[1:]]

    def run(self, command: list[str], *, check: bool = True, timeout: float = 120,
            extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(self.argv(command), capture_output=True, text=True, timeout=timeout,
                                cwd=ROOT, env={**self.env(), **(extra_env or {})})
        if check and result.returncode != 0:
            raise AssertionError(f"{shlex.join(command)} exited {result.returncode}:\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def popen(self, command: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            return subprocess.Popen(self.argv(command), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env())
