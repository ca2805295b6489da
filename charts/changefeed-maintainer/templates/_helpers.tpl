{{/*
Names and labels shared by every template.
*/}}

{{/* The chart name, overridable. */}}
{{- define "cfm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name prefix of every resource (at most 52 characters: StatefulSet pods append -capture-N and a
controller-revision hash label must stay within 63). */}}
{{- define "cfm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "cfm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every resource. */}}
{{- define "cfm.labels" -}}
helm.sh/chart: {{ include "cfm.chart" . }}
app.kubernetes.io/name: {{ include "cfm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component (call with a dict: ctx, component). */}}
{{- define "cfm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cfm.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "cfm.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "cfm.maintainer.serviceAccountName" -}}
{{- if .Values.maintainer.serviceAccount.create }}
{{- default (printf "%s-maintainer" (include "cfm.fullname" .)) .Values.maintainer.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.maintainer.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "cfm.capture.serviceAccountName" -}}
{{- if .Values.capture.serviceAccount.create }}
{{- default (printf "%s-capture" (include "cfm.fullname" .)) .Values.capture.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.capture.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Name of the capture StatefulSet; its pods are <this>-0 .. <this>-(replicas-1), and each pod's name is
its capture name. */}}
{{- define "cfm.capture.statefulSetName" -}}
{{- printf "%s-capture" (include "cfm.fullname" .) }}
{{- end }}

{{/* Downward-API environment: POD_NAME, POD_NAMESPACE, POD_IP. */}}
{{- define "cfm.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}
