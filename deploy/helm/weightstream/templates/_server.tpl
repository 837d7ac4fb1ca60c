{{/* The weightstream server container, in either mode. */}}
{{- define "weightstream.serverContainer" -}}
- name: weightstream
  image: {{ include "weightstream.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- if eq .Values.mode "sidecar" }}
  # Native sidecar: started before the engine, which waits for its startup probe, and kept running
  # beside it; it gets SIGTERM only after the engine has exited.
  restartPolicy: Always
  {{- end }}
  envFrom:
    - configMapRef:
        name: {{ include "weightstream.fullname" . }}
  {{- if or (and (eq .Values.mode "shared") .Values.ports.data) .Values.extraEnv }}
  env:
    {{- if and (eq .Values.mode "shared") .Values.ports.data }}
    # The host each tcp stream tells its client to dial for the data port: this pod's own IP. Through
    # the Service a data connection would reach whichever replica is picked, which refuses the ticket.
    - name: WEIGHTSTREAM_DATA_ADVERTISE
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    {{- end }}
    {{- with .Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
  ports:
    - name: grpc
      containerPort: {{ .Values.ports.grpc }}
    {{- if .Values.ports.data }}
    - name: data
      containerPort: {{ .Values.ports.data }}
    {{- end }}
    - name: http
      containerPort: {{ .Values.ports.http }}
  {{- if eq .Values.mode "shared" }}
  lifecycle:
    preStop:
      exec:
        command: ["sleep", "{{ .Values.preStopSleepSeconds }}"]
  {{- end }}
  {{- /* Sidecar: the engine's start waits for this, so it waits for the upstream to answer. */}}
  startupProbe:
    httpGet:
      path: {{ ternary "/healthz" "/readyz" (eq .Values.mode "shared") }}
      port: http
    {{- toYaml .Values.probes.startup | nindent 4 }}
  {{- if eq .Values.mode "shared" }}
  readinessProbe:
    httpGet:
      path: /readyz
      port: http
    {{- toYaml .Values.probes.readiness | nindent 4 }}
  {{- end }}
  livenessProbe:
    httpGet:
      path: /healthz
      port: http
    {{- toYaml .Values.probes.liveness | nindent 4 }}
  resources:
    {{- toYaml .Values.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    # The only place the server process writes besides the caches (library caches, temporary files).
    - name: weightstream-home
      mountPath: /cache
    {{- if include "weightstream.tokensSecret" . }}
    - name: tokens
      mountPath: /etc/weightstream/tokens
      readOnly: true
    {{- end }}
    {{- if include "weightstream.publishSecret" . }}
    - name: publish-tokens
      mountPath: /etc/weightstream/publish-tokens
      readOnly: true
    {{- end }}
    {{- if .Values.tls.enabled }}
    - name: tls
      mountPath: /etc/weightstream/tls
      readOnly: true
    {{- end }}
    {{- if include "weightstream.upstreamTokenSecret" . }}
    - name: upstream-token
      mountPath: /etc/weightstream/upstream
      readOnly: true
    {{- end }}
    {{- if and .Values.upstream.tls.enabled .Values.upstream.tls.existingSecret }}
    - name: upstream-tls
      mountPath: /etc/weightstream/upstream-tls
      readOnly: true
    {{- end }}
    {{- if .Values.diskCache.enabled }}
    # Mounted in this container only: the server serves what it finds there.
    - name: disk-cache
      mountPath: /var/cache/weightstream
    {{- end }}
    {{- if and (eq .Values.mode "sidecar") .Values.sidecar.sharedMemory.enabled }}
    - name: weightstream-shm
      mountPath: {{ .Values.sidecar.sharedMemory.path }}
    {{- end }}
    {{- with .Values.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* The server's volumes. */}}
{{- define "weightstream.serverVolumes" -}}
- name: weightstream-home
  emptyDir:
    sizeLimit: 1Gi
{{- with include "weightstream.tokensSecret" . }}
- name: tokens
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- with include "weightstream.publishSecret" . }}
- name: publish-tokens
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- with include "weightstream.tlsSecret" . }}
- name: tls
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- with include "weightstream.upstreamTokenSecret" . }}
- name: upstream-token
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- if and .Values.upstream.tls.enabled .Values.upstream.tls.existingSecret }}
- name: upstream-tls
  secret:
    secretName: {{ .Values.upstream.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- if .Values.diskCache.enabled }}
- name: disk-cache
  {{- if .Values.diskCache.volume }}
  {{- toYaml .Values.diskCache.volume | nindent 2 }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ .Values.diskCache.sizeLimit }}
  {{- end }}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod fields both modes share. */}}
{{- define "weightstream.podCommon" -}}
serviceAccountName: {{ include "weightstream.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod template annotations: a changed ConfigMap rolls the pods (token Secrets do not: the server re-reads them). */}}
{{- define "weightstream.podAnnotations" -}}
checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- with .Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}
