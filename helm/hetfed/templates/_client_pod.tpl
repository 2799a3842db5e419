{{/*
One organization's pod template: one client container per run it takes part in.
Call with (dict "root" $ "org" ORG "runs" RUNS).
*/}}
{{- define "hetfed.client.podTemplate" -}}
{{- $root := .root }}
{{- $org := .org }}
{{- $runs := list }}
{{- range $r := .runs }}
{{- if has $org.name $r.organizations }}
{{- $runs = append $runs $r }}
{{- end }}
{{- end }}
metadata:
  labels:
    {{- include "hetfed.podLabels" $root | nindent 4 }}
    app.kubernetes.io/component: client
    hetfed.io/organization: {{ $org.name }}
    {{- with $org.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include "hetfed.client.configs" (dict "root" $root "org" $org "runs" $runs) | sha256sum }}
    {{- if and $root.Values.tls.enabled (not $org.tls.existingSecret) }}
    checksum/tls: {{ printf "%s%s%s" $org.tls.cert $org.tls.key $root.Values.tls.ca | sha256sum }}
    {{- end }}
    {{- if $org.metrics.enabled }}
    {{- include "hetfed.scrapeAnnotations" (dict "port" $org.metrics.port) | nindent 4 }}
    {{- end }}
    {{- with $org.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  # A client takes part in its runs until they finish, then exits 0: the Job completes and frees the GPU.
  restartPolicy: Never
  # Clients never call the Kubernetes API.
  automountServiceAccountToken: false
  enableServiceLinks: false
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $org.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $org.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $org.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $org.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $org.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $org.initContainers }}
  initContainers:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    {{- range $i, $run := $runs }}
    - name: {{ $run.id }}
      image: {{ include "hetfed.image" (dict "image" $org.image "root" $root) }}
      imagePullPolicy: {{ $org.image.pullPolicy }}
      args:
        {{- if eq $org.logLevel "DEBUG" }}
        - --verbose
        {{- end }}
        - client
        - --config
        - /etc/hetfed/config/{{ $run.id }}.toml
      env:
        # The root filesystem is read-only: caches and HOME live in /tmp.
        - name: HOME
          value: /tmp
        - name: MPLCONFIGDIR
          value: /tmp/matplotlib
        - name: XDG_CACHE_HOME
          value: /tmp/cache
        {{- with $org.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if $org.metrics.enabled }}
      ports:
        - name: {{ printf "metrics-%d" $i }}
          containerPort: {{ add $org.metrics.port $i }}
          protocol: TCP
      {{- end }}
      {{- with $org.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/hetfed/config
          readOnly: true
        - name: tmp
          mountPath: /tmp
        {{- if $root.Values.tls.enabled }}
        - name: tls
          mountPath: {{ include "hetfed.tlsDir" $root }}
          readOnly: true
        {{- end }}
        {{- if ne $org.dataVolume.type "none" }}
        - name: data
          mountPath: {{ $org.dataVolume.mountPath }}
          readOnly: {{ $org.dataVolume.readOnly }}
        {{- end }}
        {{- if $org.stateVolume.enabled }}
        # The private state (the config's state_dir): each run's client keeps it in <mountPath>/<run id>.
        - name: state
          mountPath: {{ $org.stateVolume.mountPath }}
        {{- end }}
        {{- if $org.outputVolume.enabled }}
        # The exported model and snapshots (the config's output_dir): each run's client writes <mountPath>/<run id>.
        - name: output
          mountPath: {{ $org.outputVolume.mountPath }}
        {{- end }}
        {{- with $org.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "hetfed.client.fullname" (list $root $org.name) }}
    - name: tmp
      emptyDir: {}
    {{- if $root.Values.tls.enabled }}
    - name: tls
      secret:
        secretName: {{ include "hetfed.client.tlsSecret" (list $root $org) }}
        defaultMode: 0440
    {{- end }}
    {{- $v := $org.dataVolume }}
    {{- if eq $v.type "persistentVolumeClaim" }}
    - name: data
      persistentVolumeClaim:
        claimName: {{ $v.existingClaim }}
        readOnly: {{ $v.readOnly }}
    {{- else if eq $v.type "hostPath" }}
    - name: data
      hostPath:
        path: {{ $v.hostPath }}
        type: Directory
    {{- else if eq $v.type "emptyDir" }}
    - name: data
      emptyDir:
        {{- with $v.sizeLimit }}
        sizeLimit: {{ . }}
        {{- end }}
    {{- end }}
    {{- if $org.stateVolume.enabled }}
    - name: state
      persistentVolumeClaim:
        claimName: {{ include "hetfed.client.stateClaim" (list $root $org) }}
    {{- end }}
    {{- if $org.outputVolume.enabled }}
    - name: output
      persistentVolumeClaim:
        claimName: {{ include "hetfed.client.outputClaim" (list $root $org) }}
    {{- end }}
    {{- with $org.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* Every client config of one organization, concatenated (for its checksum). */}}
{{- define "hetfed.client.configs" -}}
{{- range $run := .runs }}
{{ include "hetfed.client.config" (dict "root" $.root "org" $.org "run" $run) }}
{{- end }}
{{- end }}
