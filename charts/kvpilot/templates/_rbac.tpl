{{/*
The permissions of each component, kept in one place so the ClusterRole and the per-namespace
Roles grant exactly the same rules. tests/unit/ship/test_chart_rbac.py holds these against what
the code declares (kvpilot/operator/rbac.py) and against the calls a real operator run makes;
add a rule here only together with the code that needs it.
*/}}

{{/* The operator: kopf's own needs (watch the resource, patch its finalizer and status,
post Events) plus the children it owns. */}}
{{- define "kvpilot.operatorRules" -}}
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices/status]
  verbs: [get, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors, prometheusrules]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* The tuner: read an InferenceService, patch its tuned engine fields (field manager
kvpilot-tuner), and say what it did in Events. */}}
{{- define "kvpilot.tunerRules" -}}
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}
