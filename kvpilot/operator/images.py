"""Which engine images the operator may run: an allowlist of image patterns, set by the cluster admin.

Whoever may create an InferenceService chooses `spec.engine.image`; the operator then creates a
Deployment running it.  On a shared cluster an admin names the images (registries, repositories,
tags) tenants may run, and the operator refuses others with a condition and an Event.

A pattern is a shell-style glob (`*` matches any run of characters, `/` and `:` included; `?` one
character) matched against the image reference *as the container runtime reads it*: `vllm/vllm-openai`
is `docker.io/vllm/vllm-openai:latest`, `ubuntu` is `docker.io/library/ubuntu:latest`
(github.com/distribution/reference's normalization, which containerd and CRI-O apply).  Matching
the normalized reference is what makes the list hold: `vllm/vllm-openai:v1` and
`docker.io/vllm/vllm-openai:v1` are the same image and must get the same answer.

Each pattern must start with a registry host (`docker.io/...`, `registry.example.com/...`,
`localhost:5000/...`), so `vllm/*` cannot be read two ways.  End a repository with `:*` (any tag)
or `@*` (any digest): `docker.io/vllm/vllm-openai*` would also allow `docker.io/vllm/vllm-openai-evil`.
An empty list allows every image (no policy), as before there was one.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

DEFAULT_DOMAIN = "docker.io"
_LEGACY_DOMAIN = "index.docker.io"
OFFICIAL_REPO_PREFIX = "library/"
DEFAULT_TAG = "latest"

# The host part of a pattern: a domain with a dot, a port, or localhost (distribution/reference's test
# for "the first component is a registry") - then a slash and something after it.
_HOST = re.compile(r"^(localhost|[^/]*[.:][^/]*|\[[0-9a-fA-F:]+\](:[0-9]+)?)/.+")


class AllowlistError(ValueError):
    """A pattern the operator cannot use: says which and why."""


def _split_domain(name: str) -> tuple[str, str]:
    """(registry host, repository path) as distribution/reference's splitDockerDomain reads them."""
    head, sep, rest = name.partition("/")
    if not sep or (head != "localhost" and "." not in head and ":" not in head and head == head.lower()):
        domain, path = DEFAULT_DOMAIN, name
    else:
        domain, path = head, rest
    if domain == _LEGACY_DOMAIN:
        domain = DEFAULT_DOMAIN
    if domain == DEFAULT_DOMAIN and "/" not in path:
        path = OFFICIAL_REPO_PREFIX + path
    return domain, path


def normalize_image(image: str) -> str:
    """The fully qualified reference a container runtime pulls for `image`: registry host, full
    repository path, and the tag `latest` when neither a tag nor a digest is given."""
    name, at, digest = image.partition("@")
    slash, colon = name.rfind("/"), name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    domain, path = _split_domain(name)
    reference = f"{domain}/{path}"
    if tag:
        reference += f":{tag}"
    elif not at:
        reference += f":{DEFAULT_TAG}"
    return reference + (f"@{digest}" if at else "")


@dataclass(frozen=True, slots=True)
class ImageAllowlist:
    patterns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for pattern in self.patterns:
            if not _HOST.match(pattern):
                raise AllowlistError(
                    f"allowed image pattern {pattern!r} must start with a registry host and a slash, "
                    f"e.g. docker.io/vllm/vllm-openai:* or registry.example.com/*")

    @classmethod
    def parse(cls, values: list[str] | tuple[str, ...]) -> ImageAllowlist:
        """From --allowed-image flags and/or comma-separated lists (the environment's form)."""
        patterns = [p.strip() for value in values for p in value.split(",")]
        return cls(tuple(dict.fromkeys(p for p in patterns if p)))

    @property
    def enforced(self) -> bool:
        return bool(self.patterns)

    def allows(self, image: str) -> bool:
        if not self.patterns:
            return True
        reference = normalize_image(image)
        return any(fnmatch.fnmatchcase(reference, pattern) for pattern in self.patterns)

    def refusal(self, image: str, field: str = "spec.engine.image") -> str:
        """The condition's message: the image as given, as the runtime reads it, and the list."""
        reference = normalize_image(image)
        shown = image if reference == image else f"{image} ({reference})"
        return (f"{field} {shown} matches none of the images this operator may run: "
                f"{', '.join(self.patterns)}; use an allowed image or ask the cluster admin to allow it "
                f"(operator flag --allowed-image, Helm value operator.allowedImages)")
