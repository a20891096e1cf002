{{/* The prefix of every object's name: the release's name (kiln-node, kiln-control … for a release named "kiln"). */}}
{{- define "kiln.name" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; `part` is the component (node, control, etcd) or empty. */}}
{{- define "kiln.labels" -}}
{{- $root := index . 0 -}}
{{- $part := index . 1 -}}
{{- if $part -}}
app.kubernetes.io/name: {{ include "kiln.name" $root }}-{{ $part }}
{{ end -}}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/part-of: kiln
{{- end -}}

{{/* The labels a component's selector matches. */}}
{{- define "kiln.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "kiln.name" $root }}-{{ index . 1 }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
{{- end -}}

{{/* The kiln image. */}}
{{- define "kiln.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* The Secret holding KILN_CLUSTER_SECRET. */}}
{{- define "kiln.clusterSecret" -}}
{{- .Values.clusterSecret.existingSecret | default (printf "%s-cluster" (include "kiln.name" .)) -}}
{{- end -}}

{{/* The Secret holding the object store's credentials. */}}
{{- define "kiln.s3Secret" -}}
{{- .Values.s3.existingSecret | default (printf "%s-s3" (include "kiln.name" .)) -}}
{{- end -}}

{{/* etcd's client URLs: the chart's StatefulSet members, or the external ones. */}}
{{- define "kiln.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- $name := printf "%s-etcd" (include "kiln.name" .) -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s:2379" $name $i $name) -}}
{{- end -}}
{{- join "," $urls -}}
{{- else -}}
{{- required "etcd.external: give the client URLs of your etcd (or set etcd.enabled)" (join "," .Values.etcd.external | default "") -}}
{{- end -}}
{{- end -}}

{{/* The etcd StatefulSet's --initial-cluster. */}}
{{- define "kiln.etcdInitialCluster" -}}
{{- $name := printf "%s-etcd" (include "kiln.name" .) -}}
{{- $peers := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $peers = append $peers (printf "%s-%d=http://%s-%d.%s:2380" $name $i $name $i $name) -}}
{{- end -}}
{{- join "," $peers -}}
{{- end -}}

{{/* The cluster secret's environment entry, for node and control pods. */}}
{{- define "kiln.clusterSecretEnv" -}}
- name: KILN_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "kiln.clusterSecret" . }}
      key: KILN_CLUSTER_SECRET
{{- end -}}
