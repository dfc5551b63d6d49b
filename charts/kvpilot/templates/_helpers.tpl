{{/* Names: "<release>" when it already contains "kvpilot", else "<release>-kvpilot"; 63 characters at most. */}}
{{- define "kvpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.operatorName" -}}
{{- printf "%s-operator" (include "kvpilot.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpilot.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selects the operator's pod; never change (a Deployment's selector is immutable). */}}
{{- define "kvpilot.operatorSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvpilot.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Prometheus Operator objects render when the cluster serves their API, or when forced. */}}
{{- define "kvpilot.monitoringAPI" -}}
{{- if or .Values.monitoring.force (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") -}}true{{- end -}}
{{- end -}}

{{/* The fleet routers' ClusterRole: the operator binds it (RoleBindings in the fleets' namespaces) and may
     bind nothing else. */}}
{{- define "kvpilot.routerRoleName" -}}
{{- printf "%s-router" (include "kvpilot.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* One rule list of files/rbac-rules.yaml, generated from operator/rbac.py by hack/chart/sync.py: "part" is
     a path in it (clusterwide, namespaced.clusterRole, namespaced.role, router). `tpl` fills in the router
     ClusterRole's name. */}}
{{- define "kvpilot.rbacRules" -}}
{{- $rules := tpl (.root.Files.Get "files/rbac-rules.yaml") .root | fromYaml -}}
{{- $part := $rules -}}
{{- range splitList "." .part }}{{ $part = get $part . }}{{ end -}}
{{- toYaml $part -}}
{{- end -}}
