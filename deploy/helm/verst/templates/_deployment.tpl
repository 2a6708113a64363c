{{/*
A verst gRPC service as a Deployment: (dict "root" $ "component" "router" "values" .Values.router
  "replicas" 1 "image" "verst:0.1.0" "command" (list ...) "env" "<yaml list>" "resources" (dict ...)
  ["securityContext" (dict ...): the container's own, in place of .Values.securityContext])
The Deployment of every component but the api (HTTP) and the trainers (a StatefulSet).
*/}}
{{- define "verst.grpcDeployment" -}}
{{- $root := .root -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "verst.fullname" $root }}-{{ .component }}
  labels:
    {{- include "verst.componentLabels" . | nindent 4 }}
spec:
  replicas: {{ .replicas }}
  {{- with .strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "verst.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "verst.selectorLabels" . | nindent 8 }}
      annotations:
        checksum/auth: {{ include (print $root.Template.BasePath "/secrets.yaml") $root | sha256sum }}
    spec:
      {{- include "verst.podCommon" (dict "root" $root "values" .values) | nindent 6 }}
      containers:
        - name: {{ .component }}
          image: {{ .image | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: {{ toJson .command }}
          {{- with .securityContext | default $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          ports:
            {{- include "verst.containerPorts" .values | nindent 12 }}
          env:
            {{- include "verst.commonEnv" $root | trim | nindent 12 }}
            {{- .env | nindent 12 }}
            {{- with include "verst.extraEnv" .values | trim }}{{ . | nindent 12 }}{{ end }}
          {{- include "verst.grpcProbes" (dict "port" .values.port "startupSeconds" .values.startupSeconds) | nindent 10 }}
          resources:
            {{- toYaml .resources | nindent 12 }}
          volumeMounts:
            {{- include "verst.checkpointMount" $root | nindent 12 }}
{{- end }}

{{/* The Service in front of a gRPC component (its gRPC and metrics ports). */}}
{{- define "verst.grpcService" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "verst.fullname" .root }}-{{ .component }}
  labels:
    {{- include "verst.componentLabels" . | nindent 4 }}
spec:
  type: ClusterIP
  selector:
    {{- include "verst.selectorLabels" . | nindent 4 }}
  ports:
    {{- include "verst.servicePorts" .values | nindent 4 }}
{{- end }}
