{{/*
The permissions of each component, kept in one place so the ClusterRole and the per-namespace
Roles grant exactly the same rules. tests/unit/ship/test_chart_rbac.py holds these against what
the code declares (kvpilot/operator/rbac.py) and against the calls a real operator run makes;
add a rule here only together with the code that needs it.
*/}}

{{/* The operator: kvpilot/operator/rbac.py (RULES) says why each rule is there. */}}
{{- define "kvpilot.operatorRules" -}}
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [prometheusrules]
  verbs: [get, create, patch]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors, podmonitors]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* The operator's leader election (rbac.py LEADER_ELECTION): its Lease, in the release namespace only. */}}
{{- define "kvpilot.operatorLeaseRules" -}}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, create, patch]
{{- end -}}

{{/* Cluster-scoped resources the operator reads (rbac.py CRD_WATCH): only when it watches every
namespace, where kopf watches CRDs to notice the InferenceService (or Prometheus Operator) CRDs
being installed while it runs. Watching a list of namespaces (exact names; the values schema admits
no patterns) the operator turns kopf's scanning off, so it reads no CRDs and no Namespaces, and
rbac.scope=namespace needs no ClusterRole at all. */}}
{{- define "kvpilot.operatorClusterRules" -}}
{{- if .Values.watch.allNamespaces }}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}
{{- end -}}

{{/* The tuner (kvpilot/tuner/incluster.py, adapters/kubernetes.py, scaler.py): list InferenceServices to
find those with tuning enabled or spec.autoscaling, read one, server-side apply its tuned engine fields
(field manager kvpilot-tuner), write status.tuning and the Scaling condition, post an Event per trial and
per scaling decision, and (autoscaling actor kvpilot) write spec.replicas through the scale subresource
(field manager kvpilot-planner). No Deployments: the operator stays their only writer. */}}
{{- define "kvpilot.tunerRules" -}}
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices]
  verbs: [get, list, patch]
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices/scale]
  verbs: [patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}
