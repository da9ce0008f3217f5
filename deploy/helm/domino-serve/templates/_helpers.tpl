{{/* Names and labels shared by every object of the release. */}}

{{- define "domino-serve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "domino-serve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "domino-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "domino-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "domino-serve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "domino-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The Secret holding the API key: the user's, or the one this chart creates from apiKey.value. */}}
{{- define "domino-serve.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else -}}
{{- printf "%s-api-key" (include "domino-serve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "domino-serve.modelClaim" -}}
{{- if .Values.model.pvc.existingClaim -}}
{{- .Values.model.pvc.existingClaim -}}
{{- else -}}
{{- printf "%s-models" (include "domino-serve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Seconds a pod may take to stop: the preStop pause, the server's drain, and a margin for exit. */}}
{{- define "domino-serve.gracePeriod" -}}
{{- add (int .Values.preStopSleepSeconds) (ceil .Values.server.drainTimeout | int) 10 -}}
{{- end -}}
