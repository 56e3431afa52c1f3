"""The operator's image allowlist: references normalized as container runtimes read them, then globs."""

from __future__ import annotations

import pytest

from kvpilot.operator.images import AllowlistError, ImageAllowlist, normalize_image


@pytest.mark.parametrize(
    ("image", "reference"),
    [
        # github.com/distribution/reference's ParseNormalizedNamed + TagNameOnly, case by case.
        ("ubuntu", "docker.io/library/ubuntu:latest"),
        ("vllm/vllm-openai", "docker.io/vllm/vllm-openai:latest"),
        ("vllm/vllm-openai:v0.33.0", "docker.io/vllm/vllm-openai:v0.33.0"),
        ("docker.io/vllm/vllm-openai:v0.33.0", "docker.io/vllm/vllm-openai:v0.33.0"),
        ("index.docker.io/vllm/vllm-openai:v1", "docker.io/vllm/vllm-openai:v1"),
        ("docker.io/ubuntu", "docker.io/library/ubuntu:latest"),
        ("localhost/vllm", "localhost/vllm:latest"),
        ("localhost:5000/team/vllm:dev", "localhost:5000/team/vllm:dev"),
        ("registry.example.com/ml/vllm", "registry.example.com/ml/vllm:latest"),
        ("ghcr.io/org/img@sha256:" + "a" * 64, "ghcr.io/org/img@sha256:" + "a" * 64),
        ("ghcr.io/org/img:v1@sha256:" + "a" * 64, "ghcr.io/org/img:v1@sha256:" + "a" * 64),
    ],
)
def test_references_are_normalized_as_the_runtime_reads_them(image: str, reference: str) -> None:
    assert normalize_image(image) == reference


def test_an_empty_allowlist_allows_every_image() -> None:
    allow = ImageAllowlist()
    assert not allow.enforced and allow.allows("anything/at:all")


def test_the_short_and_the_long_name_of_one_image_get_one_answer() -> None:
    allow = ImageAllowlist(("docker.io/vllm/vllm-openai:*",))
    for image in ("vllm/vllm-openai:v0.33.0", "docker.io/vllm/vllm-openai:v0.33.0",
                  "index.docker.io/vllm/vllm-openai:v0.33.0", "vllm/vllm-openai"):
        assert allow.allows(image), image
    for image in ("vllm/vllm-openai-evil:v1", "evil.io/vllm/vllm-openai:v1", "docker.io/vllm/other:v1",
                  "vllm-openai:v1"):
        assert not allow.allows(image), image


def test_a_registry_pattern_allows_everything_under_it_and_nothing_that_only_starts_alike() -> None:
    allow = ImageAllowlist(("registry.example.com/*",))
    assert allow.allows("registry.example.com/ml/vllm:v1")
    assert allow.allows("registry.example.com/vllm@sha256:" + "b" * 64)
    assert not allow.allows("registry.example.com.evil.io/ml/vllm:v1")
    assert not allow.allows("docker.io/registry.example.com/vllm:v1")  # a path, not the registry


def test_a_digest_pattern_pins_one_image() -> None:
    digest = "sha256:" + "c" * 64
    allow = ImageAllowlist((f"docker.io/vllm/vllm-openai@{digest}",))
    assert allow.allows(f"vllm/vllm-openai@{digest}")
    assert not allow.allows("vllm/vllm-openai:v0.33.0")


@pytest.mark.parametrize("pattern", ["vllm/*", "*", "vllm-openai:*", "ubuntu"])
def test_a_pattern_without_a_registry_is_refused_with_an_example(pattern: str) -> None:
    with pytest.raises(AllowlistError, match="must start with a registry host") as excinfo:
        ImageAllowlist((pattern,))
    assert repr(pattern) in str(excinfo.value) and "docker.io/vllm/vllm-openai:*" in str(excinfo.value)


def test_parse_takes_flags_and_comma_separated_lists() -> None:
    allow = ImageAllowlist.parse(["docker.io/vllm/*, ghcr.io/org/*", "", "docker.io/vllm/*"])
    assert allow.patterns == ("docker.io/vllm/*", "ghcr.io/org/*")


def test_the_refusal_names_the_image_as_given_and_as_read_and_the_allowlist() -> None:
    allow = ImageAllowlist(("registry.example.com/*", "docker.io/vllm/vllm-openai:*"))
    message = allow.refusal("evil/miner:v1")
    assert message.startswith("spec.engine.image evil/miner:v1 (docker.io/evil/miner:v1) matches none")
    assert "registry.example.com/*, docker.io/vllm/vllm-openai:*" in message
    assert "--allowed-image" in message and "operator.allowedImages" in message
