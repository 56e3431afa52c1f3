"""The "restricted" Pod Security Standard as a checker of pod specs, shared by the chart's tests
and the operator's (the twin pods it creates must be admitted where the standard is enforced)."""

from __future__ import annotations

from typing import Any


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in a pod spec the "restricted" Pod Security Standard (v1.30+) forbids."""
    problems: list[str] = []
    pod_sc = pod.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            problems.append(f"{flag} is set")
    for volume in pod.get("volumes", []):
        allowed = {
            "configMap",
            "csi",
            "downwardAPI",
            "emptyDir",
            "ephemeral",
            "persistentVolumeClaim",
            "projected",
            "secret",
        }
        kinds = set(volume) - {"name"}
        if not kinds <= allowed:
            problems.append(f"volume {volume['name']} uses {sorted(kinds - allowed)}")
    for c in pod.get("initContainers", []) + pod.get("containers", []):
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            problems.append(f"{name}: runAsNonRoot is not true")
        uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
        if not isinstance(uid, int) or uid == 0:
            problems.append(f"{name}: runAsUser {uid!r} is not a numeric non-root id")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("capabilities", {}).get("drop") != ["ALL"]:
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile {seccomp!r}")
        # Not part of the standard, but kvpilot holds its pods to it: nothing writes outside volumes.
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: readOnlyRootFilesystem is not true")
        for port in c.get("ports", []):
            if "hostPort" in port:
                problems.append(f"{name}: hostPort")
    return problems
