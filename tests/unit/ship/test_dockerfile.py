"""Static checks of the Dockerfile (there is no Docker engine on the CI machines).

The parser below reads what a Dockerfile means rather than grepping for strings: it joins
continuation lines, drops comments, expands build ARGs declared before the first FROM, and
splits the file into stages, so each rule is checked against the stage it is about.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

# The UID the chart sets in runAsUser; the image and the chart must agree.
EXPECTED_UID = 65532

COMPILERS = ("gcc", "g++", "cc", "clang", "build-essential", "make", "cmake", "python3-dev", "libc6-dev")


@dataclass
class Instruction:
    keyword: str
    args: str


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def _logical_lines(text: str) -> list[str]:
    """Dockerfile lines with comments removed and backslash continuations joined."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        if current.strip():
            lines.append(current.strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return lines


def _expand(value: str, args: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        return args.get(m.group(1) or m.group(2), m.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, value)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword == "FROM":
            words = rest.split()
            base = _expand(words[0], global_args)
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=name))
        elif not stages:
            if keyword == "ARG" and "=" in rest:
                key, _, value = rest.partition("=")
                global_args[key.strip()] = value.strip().strip('"')
        else:
            stages[-1].instructions.append(Instruction(keyword, rest))
    return global_args, stages


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    if not DOCKERFILE.exists():
        pytest.fail(f"{DOCKERFILE} is missing")
    return parse(DOCKERFILE.read_text())[1]


@pytest.fixture(scope="module")
def final(stages: list[Stage]) -> Stage:
    return stages[-1]


def test_multi_stage_final_copies_from_builder(stages: list[Stage], final: Stage) -> None:
    assert len(stages) >= 2, "the image must be built in a builder stage and copied into a clean final stage"
    builder_names = {s.name for s in stages[:-1] if s.name}
    copies_from = [m.group(1) for i in final.all("COPY") if (m := re.search(r"--from=(\S+)", i.args))]
    assert copies_from and set(copies_from) <= builder_names, copies_from


@pytest.mark.parametrize("index", [0, -1], ids=["builder", "final"])
def test_base_image_pinned_by_exact_version(stages: list[Stage], index: int) -> None:
    base = stages[index].base
    assert "$" not in base, f"unexpanded build arg in FROM: {base}"
    image, _, digest = base.partition("@")
    name, _, tag = image.partition(":")
    assert name in ("python", "docker.io/library/python"), base
    # An exact patch release on a named Debian release of the slim variant: 3.11.14-slim-bookworm.
    assert re.fullmatch(r"3\.1[1-9]\.\d+-slim-(bookworm|trixie)", tag), f"base tag not pinned exactly: {base}"
    if digest:
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), digest


def test_no_latest_anywhere() -> None:
    for line in _logical_lines(DOCKERFILE.read_text()):
        assert not re.search(r":latest\b", line), line


def test_final_stage_runs_as_fixed_numeric_non_root_user(final: Stage) -> None:
    users = final.all("USER")
    assert users, "the final stage must set USER"
    user = users[-1].args.split()[0]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER must be a numeric non-root UID, got {user!r}"
    assert int(uid) == EXPECTED_UID, "the chart's runAsUser and the image's USER must agree"
    assert not gid or (gid.isdigit() and int(gid) != 0)


def test_entrypoint_is_kvpilot_in_exec_form(final: Stage) -> None:
    entrypoints = final.all("ENTRYPOINT")
    assert entrypoints, "the final stage must set ENTRYPOINT"
    # Exec form (JSON array) so signals reach kvpilot directly, not a shell.
    assert json.loads(entrypoints[-1].args) == ["kvpilot"]


def test_entrypoint_script_is_declared_by_the_package() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["kvpilot"] == "kvpilot.cli:main"


def test_no_compilers_in_final_stage(final: Stage) -> None:
    for instruction in final.all("RUN"):
        words = set(shlex.split(instruction.args.replace("&&", " ").replace(";", " ")))
        found = words & set(COMPILERS)
        assert not found, f"final stage installs or runs a compiler toolchain: {sorted(found)}"
    for instruction in final.all("COPY") + final.all("ADD"):
        assert "--from=" in instruction.args, f"final stage copies from the build context: {instruction.args}"


def test_final_stage_keeps_root_filesystem_read_only_friendly(final: Stage) -> None:
    env = " ".join(i.args for i in final.all("ENV"))
    # The chart mounts / read-only and an emptyDir at /tmp; home and caches must live there.
    assert "HOME=/tmp" in env
    assert "PYTHONDONTWRITEBYTECODE=1" in env


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    entries = {
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for needed in (".git", ".venv", "*.db", "tests"):
        assert needed in entries, f".dockerignore should exclude {needed}"
    # What the builder COPYs must not be ignored.
    for needed in ("pyproject.toml", "README.md", "kvpilot"):
        assert needed not in entries


def test_parser_catches_a_bad_dockerfile() -> None:
    """The checks above can fail: a root, unpinned, single-stage file breaks each rule."""
    _, bad = parse("FROM python:latest\nRUN apt-get install -y gcc\nUSER root\nENTRYPOINT kvpilot\n")
    assert len(bad) == 1
    assert bad[0].base.endswith(":latest")
    assert bad[0].all("USER")[0].args == "root"
    with pytest.raises(json.JSONDecodeError):
        json.loads(bad[0].all("ENTRYPOINT")[0].args)


def test_build_context_sources_exist(stages: list[Stage]) -> None:
    """Every path the builder COPYs from the context is in the repository."""
    for stage in stages:
        for instruction in stage.all("COPY"):
            if "--from=" in instruction.args:
                continue
            *sources, _dest = instruction.args.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_image_carries_the_postgresql_driver(stages: list[Stage]) -> None:
    """The chart offers tuner.storage.type=postgresql: the image installs the extra with its driver
    (tests/image checks the driver imports in the built image)."""
    installs = " ".join(i.args for s in stages[:-1] for i in s.all("RUN"))
    assert "[postgresql,tracing]" in installs
    assert "[report]" not in installs  # plotting is not a run-time need


def test_image_carries_the_otlp_http_exporter_but_not_grpc(stages: list[Stage]) -> None:
    """A twin pod with spec.observability.tracing exports over OTLP/HTTP; grpcio (~27 MB) stays out."""
    installs = " ".join(i.args for s in stages[:-1] for i in s.all("RUN"))
    assert "tracing]" in installs and "tracing-grpc" not in installs
    assert "opentelemetry.exporter.otlp.proto.http" in installs
