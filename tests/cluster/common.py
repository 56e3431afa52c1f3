"""Names the `cluster` tests share (tests/cluster/conftest.py starts what they name)."""

from __future__ import annotations

from pathlib import Path

from harness.cluster import ROOT

NODE = "kwok-gpu-0"
SERVING = "serving"
# kwok's default pod stages plus a "bad engine" image whose pods never become Ready.
KWOK_STAGES = Path(__file__).resolve().parent / "kwok-stages.yaml"
NEVER_READY_IMAGE = "vllm/vllm-openai:kvpilot-never-ready"
# kwok shows its engine container as vLLM refusing to start (tests.support.vllm_text.KV_SHORT's words).
START_UP_FAILS_IMAGE = "vllm/vllm-openai:kvpilot-start-up-fails"
# ... and one whose pods stay Pending until a test annotates them with RELEASE_ANNOTATION.
HELD_IMAGE = "vllm/vllm-openai:kvpilot-held"
RELEASE_ANNOTATION = "kvpilot.dev/test-release"
CRD_FILE = ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml"
# The kinds of the chart's ServiceAccounts and RBAC, which the operator under test runs as.
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
