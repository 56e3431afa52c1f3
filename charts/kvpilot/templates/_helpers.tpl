{{/*
Names and labels shared by every template.
*/}}

{{- define "kvpilot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
<release>-kvpilot, or just <release> when the release name already says kvpilot.
Truncated to 50 so "-operator" / "-dashboard" suffixes still fit the 63-character DNS label.
*/}}
{{- define "kvpilot.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpilot.labels" -}}
helm.sh/chart: {{ include "kvpilot.chart" . }}
app.kubernetes.io/name: {{ include "kvpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvpilot
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component; call with (dict "ctx" $ "component" "operator"). */}}
{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpilot.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvpilot.componentLabels" -}}
{{ include "kvpilot.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* repository:tag@digest; the tag defaults to the chart's appVersion. */}}
{{- define "kvpilot.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.operatorServiceAccountName" -}}
{{- default (printf "%s-operator" (include "kvpilot.fullname" .)) .Values.serviceAccount.operatorName -}}
{{- end -}}

{{- define "kvpilot.tunerServiceAccountName" -}}
{{- default (printf "%s-tuner" (include "kvpilot.fullname" .)) .Values.serviceAccount.tunerName -}}
{{- end -}}

{{/* The namespaces watched when not watching all of them: the list, or the release namespace. */}}
{{- define "kvpilot.watchNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- toJson .Values.watch.namespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/*
Pod and container security contexts fit for the "restricted" Pod Security Standard.
They are not values on purpose: loosening them is a fork, not a setting.
*/}}
{{- define "kvpilot.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.runAsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvpilot.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/*
The tuner's command line. The storage URL is not on it: `kvpilot tuner` reads KVPILOT_TUNER_STORAGE
from its environment (set from a Secret for PostgreSQL). A `--storage=$(VAR)` argument would have
the kubelet expand the password into the process's command line, which `ps` and
/proc/PID/cmdline show; the tuner refuses a URL with a password there.
`kvpilot tuner` watches one namespace or all of them.
*/}}
{{- define "kvpilot.tunerArgs" -}}
- tuner
- --prometheus={{ .Values.tuner.prometheusUrl }}
{{- if not .Values.watch.allNamespaces }}
{{- $namespaces := include "kvpilot.watchNamespaces" . | fromJsonArray }}
{{- if gt (len $namespaces) 1 }}
{{- fail (printf "the tuner watches one namespace or all of them, and watch.namespaces lists %d: set tuner.enabled=false, list one namespace, or set watch.allNamespaces=true" (len $namespaces)) }}
{{- end }}
- --namespace={{ first $namespaces }}
{{- end }}
- --metrics-port={{ .Values.tuner.metricsPort }}
{{- end -}}

{{/* The Secret holding the webhook's serving certificate (Helm's or cert-manager's). */}}
{{- define "kvpilot.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "kvpilot.fullname" .) -}}
{{- end -}}

{{/* The namespaces the webhook reviews when not watching all of them: the watched ones except the
release namespace, which the webhook never reviews (the operator's own namespace is never blocked). */}}
{{- define "kvpilot.webhookNamespaces" -}}
{{- $namespaces := list -}}
{{- if not .Values.watch.allNamespaces -}}
{{- range (include "kvpilot.watchNamespaces" . | fromJsonArray) -}}
{{- if ne . $.Release.Namespace -}}{{- $namespaces = append $namespaces . -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $namespaces -}}
{{- end -}}

{{/* "true" when the webhook is served: webhook.enabled, and a namespace for it to review (watching only
the release namespace leaves none, and then no webhook objects are installed). */}}
{{- define "kvpilot.webhookServed" -}}
{{- if and .Values.webhook.enabled (or .Values.watch.allNamespaces (include "kvpilot.webhookNamespaces" . | fromJsonArray)) -}}
true
{{- end -}}
{{- end -}}
