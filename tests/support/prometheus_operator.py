"""What a Prometheus Operator monitor makes of a pod's series: the labels a scraped series carries.

This restates, for tests, the other systems' own rules, deliberately without kvpilot's constants:

* the scrape config the Prometheus Operator generates for a ServiceMonitor or PodMonitor endpoint
  (`relabelings`), as prometheus-operator's pkg/prometheus/promcfg.go writes it
  (generateServiceMonitorConfig / generatePodMonitorConfig): keep the targets the selector and the
  port pick, then `namespace`, `service` (ServiceMonitor), `pod`, `container`, the monitor's
  `targetLabels` (from the Service's labels) and `podTargetLabels` (from the pod's), each name
  through its `sanitizeLabelName` ([^a-zA-Z0-9_] -> `_`), then `job` (the Service's name, or
  `<namespace>/<PodMonitor name>`; `jobLabel` overrides) and `endpoint` (the port's name), then the
  endpoint's own `relabelings`; the endpoint's `metricRelabelings` become the scrape config's
  `metric_relabel_configs`, applied to every scraped sample (its name is the label `__name__`);
* the meta labels Prometheus's Kubernetes service discovery gives a target of role `endpoints`
  (ServiceMonitor) or `pod` (PodMonitor), from the Service and the pod as the endpoints controller
  pairs them (the Service's selector picks the pod, its targetPort names a container port);
* Prometheus's relabelling (`replace`, `keep`, `drop`, `labelmap`, `labeldrop`, `labelkeep`) and
  what it does after it: `instance` defaults to `__address__`, labels starting with `__` go, and a
  sample's own labels give way to the target's (they become `exported_<name>`) unless `honor_labels`.

`target_labels(...)` gives a target's labels; `series_labels(...)` the labels of one scraped series.
`scrape_config(...)` is the same relabelling as a Prometheus scrape config with a static target
whose meta labels are set by hand, so a real Prometheus can apply it (tests/integration).
Go's RE2 and Python's `re` agree on the simple patterns used here (anchored, as Prometheus anchors them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# promcfg.go: `invalidLabelCharRE = regexp.MustCompile(`[^a-zA-Z0-9_]`)`; Kubernetes SD sanitises
# meta label names the same way (strutil.SanitizeLabelName).
_INVALID_LABEL_CHAR = re.compile(r"[^a-zA-Z0-9_]")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
RESERVED_PREFIX = "__"


def sanitize_label_name(name: str) -> str:
    return _INVALID_LABEL_CHAR.sub("_", name)


# --- the scrape config the operator generates ---------------------------------------------------


def _keep_selected(meta: str, selector: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The keep/drop rules promcfg.go makes of a label selector (`meta` is `service` or `pod`)."""
    out: list[dict[str, Any]] = []
    for key in sorted(selector.get("matchLabels") or {}):
        out.append({"action": "keep",
                    "source_labels": [f"__meta_kubernetes_{meta}_label_{sanitize_label_name(key)}",
                                      f"__meta_kubernetes_{meta}_labelpresent_{sanitize_label_name(key)}"],
                    "regex": f"({selector['matchLabels'][key]});true"})
    for exp in selector.get("matchExpressions") or []:
        key = sanitize_label_name(exp["key"])
        value_and_present = [f"__meta_kubernetes_{meta}_label_{key}", f"__meta_kubernetes_{meta}_labelpresent_{key}"]
        present = [f"__meta_kubernetes_{meta}_labelpresent_{key}"]
        op = exp["operator"]
        if op in ("In", "NotIn"):
            out.append({"action": "keep" if op == "In" else "drop", "source_labels": value_and_present,
                        "regex": f"({'|'.join(exp.get('values') or [])});true"})
        elif op in ("Exists", "DoesNotExist"):
            out.append({"action": "keep" if op == "Exists" else "drop", "source_labels": present, "regex": "true"})
        else:
            raise ValueError(f"label selector operator {op!r} is not In, NotIn, Exists or DoesNotExist")
    return out


def _copy_labels(meta: str, names: Iterable[str]) -> list[dict[str, Any]]:
    return [{"source_labels": [f"__meta_kubernetes_{meta}_label_{sanitize_label_name(n)}"],
             "target_label": sanitize_label_name(n), "regex": "(.+)", "replacement": "${1}"} for n in names]


_RELABEL_KEYS = {"sourceLabels": "source_labels", "targetLabel": "target_label", "separator": "separator",
                 "regex": "regex", "replacement": "replacement", "action": "action", "modulus": "modulus"}


def _user_relabelings(rules: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{_RELABEL_KEYS[k]: v for k, v in rule.items()} for rule in rules]


def relabel_configs(monitor: Mapping[str, Any], endpoint_index: int = 0) -> list[dict[str, Any]]:
    """The `relabel_configs` the Prometheus Operator writes for one endpoint of a monitor."""
    kind, spec = monitor["kind"], monitor["spec"]
    meta = monitor["metadata"]
    rules: list[dict[str, Any]] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
    if kind == "ServiceMonitor":
        ep = spec["endpoints"][endpoint_index]
        rules += _keep_selected("service", spec.get("selector") or {})
        if ep.get("port"):
            rules.append({"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                          "regex": ep["port"]})
        elif ep.get("targetPort") is not None:
            raise NotImplementedError("targetPort endpoints are not modelled here; name the Service port")
        rules += [
            {"source_labels": ["__meta_kubernetes_endpoint_address_target_kind",
                               "__meta_kubernetes_endpoint_address_target_name"],
             "separator": ";", "regex": "Node;(.*)", "replacement": "${1}", "target_label": "node"},
            {"source_labels": ["__meta_kubernetes_endpoint_address_target_kind",
                               "__meta_kubernetes_endpoint_address_target_name"],
             "separator": ";", "regex": "Pod;(.*)", "replacement": "${1}", "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        ]
        rules += _copy_labels("service", spec.get("targetLabels") or [])
        rules += _copy_labels("pod", spec.get("podTargetLabels") or [])
        rules.append({"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job",
                      "replacement": "${1}"})
        if spec.get("jobLabel"):
            rules.append({"source_labels": [f"__meta_kubernetes_service_label_{sanitize_label_name(spec['jobLabel'])}"],
                          "target_label": "job", "regex": "(.+)", "replacement": "${1}"})
    elif kind == "PodMonitor":
        ep = spec["podMetricsEndpoints"][endpoint_index]
        rules += _keep_selected("pod", spec.get("selector") or {})
        if ep.get("port"):
            rules.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                          "regex": ep["port"]})
        elif ep.get("targetPort") is not None or ep.get("portNumber") is not None:
            raise NotImplementedError("numbered ports are not modelled here; name the container port")
        rules += [
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ]
        rules += _copy_labels("pod", spec.get("podTargetLabels") or [])
        rules.append({"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"})
        if spec.get("jobLabel"):
            rules.append({"source_labels": [f"__meta_kubernetes_pod_label_{sanitize_label_name(spec['jobLabel'])}"],
                          "target_label": "job", "regex": "(.+)", "replacement": "${1}"})
    else:
        raise ValueError(f"{kind} is not a ServiceMonitor or PodMonitor")
    if ep.get("port"):
        rules.append({"target_label": "endpoint", "replacement": ep["port"]})
    rules += _user_relabelings(ep.get("relabelings") or [])
    return rules


def _endpoint(monitor: Mapping[str, Any], endpoint_index: int) -> Mapping[str, Any]:
    spec = monitor["spec"]
    endpoints = spec["endpoints"] if monitor["kind"] == "ServiceMonitor" else spec["podMetricsEndpoints"]
    return endpoints[endpoint_index]  # type: ignore[no-any-return]


def metric_relabel_configs(monitor: Mapping[str, Any], endpoint_index: int = 0) -> list[dict[str, Any]]:
    """The `metric_relabel_configs` the Prometheus Operator writes for one endpoint: the endpoint's
    `metricRelabelings`, keys in Prometheus's spelling (promcfg.go, generateRelabelConfig)."""
    return _user_relabelings(_endpoint(monitor, endpoint_index).get("metricRelabelings") or [])


def honor_labels(monitor: Mapping[str, Any], endpoint_index: int = 0) -> bool:
    return bool(_endpoint(monitor, endpoint_index).get("honorLabels", False))


def job_name(monitor: Mapping[str, Any], endpoint_index: int = 0) -> str:
    """The scrape config's name: `serviceMonitor/<ns>/<name>/<i>` (`podMonitor/...`)."""
    prefix = "serviceMonitor" if monitor["kind"] == "ServiceMonitor" else "podMonitor"
    meta = monitor["metadata"]
    return f"{prefix}/{meta['namespace']}/{meta['name']}/{endpoint_index}"


# --- Kubernetes service discovery ----------------------------------------------------------------


def _labels_meta(meta: str, labels: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in labels.items():
        out[f"__meta_kubernetes_{meta}_label_{sanitize_label_name(key)}"] = value
        out[f"__meta_kubernetes_{meta}_labelpresent_{sanitize_label_name(key)}"] = "true"
    return out


def _pod_meta(pod: Mapping[str, Any], container: Mapping[str, Any], port: Mapping[str, Any]) -> dict[str, str]:
    meta = pod["metadata"]
    return {
        "__meta_kubernetes_namespace": meta["namespace"],
        "__meta_kubernetes_pod_name": meta["name"],
        "__meta_kubernetes_pod_ip": pod["status"]["podIP"],
        "__meta_kubernetes_pod_ready": "true",
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_pod_container_name": container["name"],
        "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
        "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
        "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP"),
        **_labels_meta("pod", meta.get("labels") or {}),
    }


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _container_port(pod: Mapping[str, Any], target: int | str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            if target in (port.get("name"), port["containerPort"]):
                return container, port
    return None


def endpoints_targets(service: Mapping[str, Any], pod: Mapping[str, Any]) -> list[dict[str, str]]:
    """Role `endpoints`: one target per Service port whose targetPort the pod has, if the Service selects it."""
    if not _selects(service["spec"].get("selector") or {}, pod["metadata"].get("labels") or {}):
        return []
    if service["metadata"]["namespace"] != pod["metadata"]["namespace"]:
        return []
    targets = []
    for sport in service["spec"]["ports"]:
        found = _container_port(pod, sport.get("targetPort", sport["port"]))
        if found is None:
            continue
        container, port = found
        targets.append({
            "__address__": f"{pod['status']['podIP']}:{port['containerPort']}",
            "__meta_kubernetes_endpoints_name": service["metadata"]["name"],
            "__meta_kubernetes_endpoint_port_name": sport.get("name", ""),
            "__meta_kubernetes_endpoint_port_protocol": sport.get("protocol", "TCP"),
            "__meta_kubernetes_endpoint_ready": "true",
            "__meta_kubernetes_endpoint_address_target_kind": "Pod",
            "__meta_kubernetes_endpoint_address_target_name": pod["metadata"]["name"],
            "__meta_kubernetes_service_name": service["metadata"]["name"],
            **_labels_meta("service", service["metadata"].get("labels") or {}),
            **_pod_meta(pod, container, port),
        })
    return targets


def pod_targets(pod: Mapping[str, Any]) -> list[dict[str, str]]:
    """Role `pod`: one target per declared container port."""
    return [{"__address__": f"{pod['status']['podIP']}:{port['containerPort']}", **_pod_meta(pod, c, port)}
            for c in pod["spec"]["containers"] for port in c.get("ports") or []]


def pod_from_template(deployment: Mapping[str, Any], name: str, ip: str = "10.0.0.7") -> dict[str, Any]:
    """A pod as the Deployment's ReplicaSet creates it: the template's labels (plus the
    pod-template-hash the ReplicaSet adds), its spec, in the Deployment's namespace."""
    template = deployment["spec"]["template"]
    labels = {**(template["metadata"].get("labels") or {}), "pod-template-hash": "5d8f7c9b6"}
    return {"metadata": {"name": name, "namespace": deployment["metadata"]["namespace"], "labels": labels},
            "spec": template["spec"], "status": {"podIP": ip, "phase": "Running"}}


# --- Prometheus's relabelling ---------------------------------------------------------------------


def _expand(template: str, match: re.Match[str]) -> str:
    """Go's Regexp.Expand: `$1`, `${1}`, `$name`, `${name}`; `$$` is a dollar."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        ref = m.group(1) or m.group(2)
        group = int(ref) if ref.isdigit() else ref
        try:
            return match.group(group) or ""
        except IndexError:  # no such group: Go expands it to nothing
            return ""
    return re.sub(r"\$\$|\$\{(\w+)\}|\$(\w+)", one, template)


def relabel(labels: Mapping[str, str], configs: Iterable[Mapping[str, Any]]) -> dict[str, str] | None:
    """Prometheus's relabel.Process: the labels after every rule, or None when a rule drops the target."""
    out = dict(labels)
    for cfg in configs:
        action = cfg.get("action", "replace").lower()
        regex = re.compile(f"^(?:{cfg.get('regex', '(.*)')})$")
        value = cfg.get("separator", ";").join(out.get(name, "") for name in cfg.get("source_labels", []))
        replacement = cfg.get("replacement", "$1")
        if action == "keep":
            if not regex.match(value):
                return None
        elif action == "drop":
            if regex.match(value):
                return None
        elif action == "replace":
            match = regex.match(value)
            if match is None:
                continue
            target = _expand(cfg["target_label"], match)
            result = _expand(replacement, match)
            if not _LABEL_NAME.match(target):
                continue
            if result:
                out[target] = result
            else:
                out.pop(target, None)
        elif action == "labelmap":
            for name, val in list(out.items()):
                match = regex.match(name)
                if match:
                    out[_expand(replacement, match)] = val
        elif action == "labeldrop":
            out = {k: v for k, v in out.items() if not regex.match(k)}
        elif action == "labelkeep":
            out = {k: v for k, v in out.items() if regex.match(k)}
        else:
            raise NotImplementedError(f"relabel action {action!r} is not modelled here")
    return out


def target_labels(discovered: Mapping[str, str], configs: Iterable[Mapping[str, Any]], *,
                  job: str, scheme: str = "http", metrics_path: str = "/metrics") -> dict[str, str] | None:
    """scrape.PopulateLabels: defaults, relabelling, `instance` from `__address__`, `__` labels dropped."""
    labels = {"job": job, "__scheme__": scheme, "__metrics_path__": metrics_path, **discovered}
    result = relabel(labels, configs)
    if result is None:
        return None
    result.setdefault("instance", result["__address__"])
    return {k: v for k, v in result.items() if not k.startswith(RESERVED_PREFIX) and v != ""}


def series_labels(target: Mapping[str, str], exposed: Mapping[str, str], *, honor: bool) -> dict[str, str]:
    """The labels of a scraped sample: the exposition's and the target's; on a clash the target
    wins and the sample's value moves to `exported_<name>`, unless `honor_labels`."""
    if honor:
        return {**target, **exposed}
    out = dict(exposed)
    for name, value in target.items():
        if name in out:
            out[f"exported_{name}"] = out.pop(name)
        out[name] = value
    return out


def metric_relabel(name: str, labels: Mapping[str, str],
                   configs: Iterable[Mapping[str, Any]]) -> tuple[str, dict[str, str]] | None:
    """A scraped sample after `metric_relabel_configs`: (metric name, labels), or None when dropped.
    Its name is the label `__name__` while the rules run, as in Prometheus."""
    result = relabel({**labels, "__name__": name}, configs)
    if result is None:
        return None
    out = {k: v for k, v in result.items() if v != ""}
    return out.pop("__name__"), out


def monitor_targets(monitor: Mapping[str, Any], service: Mapping[str, Any] | None,
                    pod: Mapping[str, Any]) -> list[dict[str, str]]:
    """The labels of every target the monitor makes of this pod (and, for a ServiceMonitor, its Service)."""
    spec = monitor["spec"]
    namespaces = (spec.get("namespaceSelector") or {}).get("matchNames") or [monitor["metadata"]["namespace"]]
    if pod["metadata"]["namespace"] not in namespaces:
        return []
    if monitor["kind"] == "ServiceMonitor":
        if service is None:
            raise ValueError("a ServiceMonitor scrapes through a Service: pass it")
        discovered = endpoints_targets(service, pod)
        endpoints = spec["endpoints"]
    else:
        discovered = pod_targets(pod)
        endpoints = spec["podMetricsEndpoints"]
    out = []
    for i, ep in enumerate(endpoints):
        for d in discovered:
            labels = target_labels(d, relabel_configs(monitor, i), job=job_name(monitor, i),
                                   metrics_path=ep.get("path", "/metrics"))
            if labels is not None:
                out.append(labels)
    return out


def scrape_config(monitor: Mapping[str, Any], discovered: Mapping[str, str], *, address: str,
                  endpoint_index: int = 0, scrape_interval: str = "1s") -> dict[str, Any]:
    """A Prometheus scrape config that applies the operator's relabelling to one target found by
    hand: a static target at `address` carrying the discovered meta labels."""
    meta = {k: v for k, v in discovered.items() if k != "__address__"}
    return {
        "job_name": job_name(monitor, endpoint_index),
        "metrics_path": _endpoint(monitor, endpoint_index).get("path", "/metrics"),
        "scrape_interval": scrape_interval,
        "scrape_timeout": scrape_interval,
        "honor_labels": honor_labels(monitor, endpoint_index),
        "static_configs": [{"targets": [address], "labels": meta}],
        "relabel_configs": relabel_configs(monitor, endpoint_index),
        "metric_relabel_configs": metric_relabel_configs(monitor, endpoint_index),
    }
