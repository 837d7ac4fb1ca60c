{{/* The chart's name, or nameOverride. */}}
{{- define "weightstream.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The objects' name: fullnameOverride, else the release name, with the chart's unless it holds it. */}}
{{- define "weightstream.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "weightstream.selectorLabels" -}}
app.kubernetes.io/name: {{ include "weightstream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ ternary "server" "inference" (eq .Values.mode "shared") }}
{{- end }}

{{- define "weightstream.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "weightstream.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: weightstream
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "weightstream.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "weightstream.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "weightstream.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The Secret names the server's files come from; empty when off. */}}
{{- define "weightstream.tokensSecret" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecret }}{{ else if .Values.auth.tokens }}{{ include "weightstream.fullname" . }}-tokens{{ end }}
{{- end }}
{{- define "weightstream.publishSecret" -}}
{{- if .Values.publish.existingSecret }}{{ .Values.publish.existingSecret }}{{ else if .Values.publish.tokens }}{{ include "weightstream.fullname" . }}-publish-tokens{{ end }}
{{- end }}
{{- define "weightstream.tlsSecret" -}}
{{- if .Values.tls.enabled }}{{ default (printf "%s-tls" (include "weightstream.fullname" .)) .Values.tls.existingSecret }}{{ end }}
{{- end }}
{{- define "weightstream.upstreamTokenSecret" -}}
{{- if .Values.upstream.existingTokenSecret }}{{ .Values.upstream.existingTokenSecret }}{{ else if .Values.upstream.token }}{{ include "weightstream.fullname" . }}-upstream-token{{ end }}
{{- end }}

{{/* The Secret (name) holding the bearer token Prometheus sends to /metrics; empty without auth. */}}
{{- define "weightstream.metricsTokenSecret" -}}
{{- if include "weightstream.tokensSecret" . }}
{{- if .Values.serviceMonitor.tokenSecret.name }}{{ .Values.serviceMonitor.tokenSecret.name }}
{{- else if .Values.auth.tokens }}{{ include "weightstream.fullname" . }}-metrics-token
{{- end }}
{{- end }}
{{- end }}

{{/* config.drain_seconds, or the server's default. */}}
{{- define "weightstream.drainSeconds" -}}
{{- if kindIs "invalid" .Values.config.drain_seconds }}30{{ else }}{{ .Values.config.drain_seconds }}{{ end }}
{{- end }}

{{/* A config value as the server reads it from the environment: lists comma-joined, whole numbers without exponent. */}}
{{- define "weightstream.envValue" -}}
{{- if kindIs "slice" . }}{{ join "," . }}
{{- else if and (kindIs "float64" .) (eq (float64 (int64 .)) .) }}{{ int64 . }}
{{- else }}{{ toString . }}
{{- end }}
{{- end }}

{{/* Values the chart cannot render right: fail at template time, naming the value. */}}
{{- define "weightstream.validate" -}}
{{- if not (has .Values.mode (list "shared" "sidecar")) }}
{{- fail (printf "mode must be shared or sidecar, not %q" .Values.mode) }}
{{- end }}
{{- if not (and .Values.ports.grpc .Values.ports.http) }}
{{- fail "ports.grpc and ports.http must be set: the probes and the metrics scrape use the REST port" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) (not (and .Values.tls.cert .Values.tls.key)) }}
{{- fail "tls.enabled needs tls.existingSecret, or tls.cert and tls.key" }}
{{- end }}
{{- if and .Values.tls.clientAuth (not .Values.tls.existingSecret) (not .Values.tls.clientCA) }}
{{- fail "tls.clientAuth needs tls.existingSecret (with ca.crt) or tls.clientCA" }}
{{- end }}
{{- if and .Values.auth.tokens .Values.auth.existingSecret }}
{{- fail "auth: give tokens or existingSecret, not both" }}
{{- end }}
{{- if and .Values.upstream.tls.enabled (not .Values.upstream.address) }}
{{- fail "upstream.tls.enabled needs upstream.address" }}
{{- end }}
{{- if and .Values.upstream.tls.clientCertificate (not .Values.upstream.tls.existingSecret) }}
{{- fail "upstream.tls.clientCertificate needs upstream.tls.existingSecret (with tls.crt and tls.key)" }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled (include "weightstream.tokensSecret" .) (not (include "weightstream.metricsTokenSecret" .)) }}
{{- fail "serviceMonitor with auth.existingSecret needs serviceMonitor.tokenSecret.name: /metrics requires a reader token" }}
{{- end }}
{{- if and (eq .Values.mode "sidecar") (not .Values.sidecar.engine.image) }}
{{- fail "sidecar mode needs sidecar.engine.image" }}
{{- end }}
{{- end }}
