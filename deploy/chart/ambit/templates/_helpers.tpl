{{- define "ambit.labels" -}}
app.kubernetes.io/name: ambit
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "ambit.selector" -}}
app.kubernetes.io/name: ambit
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ambit.image" -}}
{{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
