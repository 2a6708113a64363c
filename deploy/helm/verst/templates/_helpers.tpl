{{/* Names, labels and the pieces every verst pod shares. */}}

{{- define "verst.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-verst, or the release name when it already says verst; at most 40 characters so that
"<fullname>-trainer-headless" and the pod names fit in 63. */}}
{{- define "verst.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else if contains (include "verst.name" .) .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "verst.name" .) | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "verst.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "verst.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "router") */}}
{{- define "verst.selectorLabels" -}}
app.kubernetes.io/name: {{ include "verst.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "verst.componentLabels" -}}
{{ include "verst.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "verst.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "verst.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "verst.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Secret of generated credentials (api token, Redis password). */}}
{{- define "verst.authSecretName" -}}
{{- printf "%s-auth" (include "verst.fullname" .) }}
{{- end }}

{{- define "verst.apiTokenSecretName" -}}
{{- default (include "verst.authSecretName" .) .Values.apiToken.existingSecret }}
{{- end }}

{{- define "verst.redisPasswordSecretName" -}}
{{- default (include "verst.authSecretName" .) .Values.redis.password.existingSecret }}
{{- end }}

{{- define "verst.redisHost" -}}
{{- printf "%s-redis" (include "verst.fullname" .) }}
{{- end }}

{{- define "verst.rewardAddress" -}}
{{- if .Values.reward.enabled }}
{{- printf "%s-reward:%d" (include "verst.fullname" .) (int .Values.reward.port) }}
{{- else }}
{{- required "reward.externalAddress: the host:port of your reward service (reward.enabled is false)" .Values.reward.externalAddress }}
{{- end }}
{{- end }}

{{- define "verst.routerAddress" -}}
{{- printf "%s-router:%d" (include "verst.fullname" .) (int .Values.router.port) }}
{{- end }}

{{- define "verst.checkpointClaim" -}}
{{- default (printf "%s-checkpoints" (include "verst.fullname" .)) .Values.checkpoints.existingClaim }}
{{- end }}

{{/* REDIS_URL (with the password from its Secret) and the log level: every verst container. */}}
{{- define "verst.commonEnv" -}}
{{- if .Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "verst.redisPasswordSecretName" . }}
      key: {{ .Values.redis.password.key }}
- name: REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "verst.redisHost" .) | quote }}
{{- else }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "redis.external.existingSecret: a Secret holding the Redis URL (redis.enabled is false)" .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.urlKey }}
{{- end }}
- name: VERST_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
{{- end }}

{{/* A component's `env` map as env entries: (dict "env" .Values.router.env) */}}
{{- define "verst.extraEnv" -}}
{{- range $name, $value := .env }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{/* Pod-level fields every verst pod shares: (dict "root" $ "values" .Values.router) */}}
{{- define "verst.podCommon" -}}
serviceAccountName: {{ include "verst.serviceAccountName" .root }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: checkpoints
    persistentVolumeClaim:
      claimName: {{ include "verst.checkpointClaim" .root }}
{{- end }}

{{- define "verst.checkpointMount" -}}
- name: checkpoints
  mountPath: {{ .Values.checkpoints.mountPath }}
{{- end }}

{{/* Kubernetes' own gRPC probes: every verst gRPC server serves grpc.health.v1. */}}
{{- define "verst.grpcProbes" -}}
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 5
livenessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- if .startupSeconds }}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ div .startupSeconds 10 | max 1 }}
{{- end }}
{{- end }}

{{/* The ports of a gRPC service with a /metrics endpoint: (dict "port" 50051 "metricsPort" 9461) */}}
{{- define "verst.containerPorts" -}}
- name: grpc
  containerPort: {{ .port }}
  protocol: TCP
- name: metrics
  containerPort: {{ .metricsPort }}
  protocol: TCP
{{- end }}

{{- define "verst.servicePorts" -}}
- name: grpc
  port: {{ .port }}
  targetPort: grpc
  protocol: TCP
- name: metrics
  port: {{ .metricsPort }}
  targetPort: metrics
  protocol: TCP
{{- end }}

{{/* Where a gRPC service listens: (dict "prefix" "VERST_ROUTER" "values" .Values.router) */}}
{{- define "verst.listenEnv" -}}
- name: {{ .prefix }}_HOST
  value: "0.0.0.0"
- name: {{ .prefix }}_PORT
  value: {{ .values.port | toString | quote }}
- name: {{ .prefix }}_METRICS_PORT
  value: {{ .values.metricsPort | toString | quote }}
{{- end }}

{{/* The router and reward addresses of a rollout client (runner, controller, api): (dict "root" $ "prefix" "VERST_RUNNER") */}}
{{- define "verst.rolloutClientEnv" -}}
- name: {{ .prefix }}_ROUTER_ADDRESS
  value: {{ include "verst.routerAddress" .root | quote }}
- name: {{ .prefix }}_REWARD_ADDRESS
  value: {{ include "verst.rewardAddress" .root | quote }}
{{- end }}

{{/* An engine advertises its own pod IP to the router (the downward API). */}}
{{- define "verst.engineEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: VERST_ENGINE_ADVERTISE_ADDRESS
  value: {{ printf "$(POD_IP):%d" (int .Values.engine.port) | quote }}
{{- end }}
