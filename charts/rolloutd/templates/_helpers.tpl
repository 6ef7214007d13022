{{- define "rolloutd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rolloutd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rolloutd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rolloutd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rolloutd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "rolloutd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "rolloutd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rolloutd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rolloutd.secretName" -}}
{{- default (printf "%s-tokens" (include "rolloutd.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "rolloutd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Namespace of the kubernetes executor's Jobs */}}
{{- define "rolloutd.executorNamespace" -}}
{{- default .Release.Namespace .Values.executor.kubernetes.namespace -}}
{{- end -}}

{{/* The URL node daemons reach the controller at (the Service's cluster DNS name) */}}
{{- define "rolloutd.url" -}}
{{- printf "http://%s.%s.svc:%v" (include "rolloutd.fullname" .) .Release.Namespace .Values.service.port -}}
{{- end -}}

{{/* What the kubernetes executor calls: a Role's rules in controller mode, the ClusterRole's in operator mode */}}
{{- define "rolloutd.executorRules" -}}
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, update, delete]
{{- end -}}
