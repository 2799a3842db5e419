{{/*
Names, labels, the normalized organizations and runs, the rendered configs, and the chart's checks.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "hetfed.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
A name of at most `max` characters (default 63). A longer one is cut and ends in a hash of the whole,
so two long names that share a prefix stay distinct. Call with (dict "name" STRING "max" INT).
*/}}
{{- define "hetfed.fit" -}}
{{- $max := int (default 63 .max) }}
{{- if le (len .name) $max }}
{{- .name }}
{{- else }}
{{- printf "%s-%s" (trunc (int (sub $max 9)) .name | trimSuffix "-") (sha256sum .name | trunc 8) }}
{{- end }}
{{- end }}

{{/* The release's name prefix: `<release>-<chart>`, or the release name when it holds the chart name. */}}
{{- define "hetfed.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- include "hetfed.fit" (dict "name" .Values.fullnameOverride "max" 40) }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- include "hetfed.fit" (dict "name" .Release.Name "max" 40) }}
{{- else }}
{{- include "hetfed.fit" (dict "name" (printf "%s-%s" .Release.Name $name) "max" 40) }}
{{- end }}
{{- end }}
{{- end }}

{{/* chart label value */}}
{{- define "hetfed.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "hetfed.labels" -}}
helm.sh/chart: {{ include "hetfed.chart" . }}
{{ include "hetfed.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hetfed
{{- end }}

{{/*
Labels of pod templates: no chart version, so a new chart version that changes nothing for a pod leaves its
template, and a client Job's name, as they were (upgrades never replace a client mid-round for nothing).
*/}}
{{- define "hetfed.podLabels" -}}
{{ include "hetfed.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hetfed
{{- end }}

{{/* Labels that select the release's pods; they never change between releases (selectors are immutable). */}}
{{- define "hetfed.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hetfed.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The aggregator's name: at most 52 characters, so its StatefulSet's revision label fits in 63. */}}
{{- define "hetfed.aggregator.fullname" -}}
{{- include "hetfed.fit" (dict "name" (printf "%s-aggregator" (include "hetfed.fullname" .)) "max" 52) }}
{{- end }}

{{- define "hetfed.aggregator.selectorLabels" -}}
{{ include "hetfed.selectorLabels" . }}
app.kubernetes.io/component: aggregator
{{- end }}

{{- define "hetfed.aggregator.serviceAccountName" -}}
{{- if .Values.aggregator.serviceAccount.create }}
{{- default (include "hetfed.aggregator.fullname" .) .Values.aggregator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.aggregator.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The DNS name of the aggregator Service in the release's namespace. */}}
{{- define "hetfed.aggregator.host" -}}
{{- printf "%s.%s.svc" (include "hetfed.aggregator.fullname" .) .Release.Namespace }}
{{- end }}

{{/* The address clients dial: `aggregator.address`, or this release's aggregator Service. */}}
{{- define "hetfed.aggregator.address" -}}
{{- if .Values.aggregator.address }}
{{- .Values.aggregator.address }}
{{- else }}
{{- printf "%s:%d" (include "hetfed.aggregator.host" .) (int .Values.aggregator.service.grpcPort) }}
{{- end }}
{{- end }}

{{/* The name of one organization's state claim. Call with (list $ ORG). */}}
{{- define "hetfed.client.stateClaim" -}}
{{- $org := index . 1 }}
{{- default (include "hetfed.fit" (dict "name" (printf "%s-state" (include "hetfed.client.fullname" (list (index . 0) $org.name))))) $org.stateVolume.existingClaim }}
{{- end }}

{{/* The name of one organization's output claim (its exported models). Call with (list $ ORG). */}}
{{- define "hetfed.client.outputClaim" -}}
{{- $org := index . 1 }}
{{- default (include "hetfed.fit" (dict "name" (printf "%s-output" (include "hetfed.client.fullname" (list (index . 0) $org.name))))) $org.outputVolume.existingClaim }}
{{- end }}

{{/* The name of one organization's objects. Call with (list $ ORG). */}}
{{- define "hetfed.client.fullname" -}}
{{- $root := index . 0 }}
{{- include "hetfed.fit" (dict "name" (printf "%s-%s" (include "hetfed.fullname" $root) (index . 1)) "max" 54) }}
{{- end }}

{{/* Selector labels of one organization's pods. Call with (list $ ORG). */}}
{{- define "hetfed.client.selectorLabels" -}}
{{ include "hetfed.selectorLabels" (index . 0) }}
app.kubernetes.io/component: client
hetfed.io/organization: {{ index . 1 }}
{{- end }}

{{/*
An image reference: `<registry>/<repository>:<tag>`, where `global.imageRegistry` (when set) replaces the
image's own `registry` and an empty registry leaves the repository as it is. Call with (dict "image" IMAGE "root" $).
*/}}
{{- define "hetfed.image" -}}
{{- $registry := default .image.registry (get (default dict .root.Values.global) "imageRegistry") }}
{{- $ref := printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- if $registry }}
{{- printf "%s/%s" (trimSuffix "/" $registry) $ref }}
{{- else }}
{{- $ref }}
{{- end }}
{{- end }}

{{/*
Merge map `src` into map `dst` in place, recursively; any value of `src` (false, 0 and empty lists too)
replaces the one in `dst`, except that two maps are merged. Call with (list DST SRC).
*/}}
{{- define "hetfed.mergeInto" -}}
{{- $dst := index . 0 }}
{{- range $k, $v := index . 1 }}
{{- if and (kindIs "map" $v) (kindIs "map" (get $dst $k)) }}
{{- include "hetfed.mergeInto" (list (get $dst $k) $v) }}
{{- else }}
{{- $_ := set $dst $k (deepCopy $v) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Helm reads every number in values as a float: turn the whole ones back into integers, in place, so the
TOML says `rounds = 3` and not `rounds = 3.0` (the configs' integer fields refuse floats; their float
fields take integers).
*/}}
{{- define "hetfed.intify" -}}
{{- $m := . }}
{{- range $k, $v := $m }}
{{- if kindIs "map" $v }}
{{- include "hetfed.intify" $v }}
{{- else if kindIs "slice" $v }}
{{- $out := list }}
{{- range $item := $v }}
{{- if kindIs "map" $item }}
{{- include "hetfed.intify" $item }}
{{- $out = append $out $item }}
{{- else if and (kindIs "float64" $item) (lt $item 9007199254740992.0) (gt $item -9007199254740992.0) (eq (float64 (int64 $item)) $item) }}
{{- $out = append $out (int64 $item) }}
{{- else }}
{{- $out = append $out $item }}
{{- end }}
{{- end }}
{{- $_ := set $m $k $out }}
{{- else if and (kindIs "float64" $v) (lt $v 9007199254740992.0) (gt $v -9007199254740992.0) (eq (float64 (int64 $v)) $v) }}
{{- $_ := set $m $k (int64 $v) }}
{{- end }}
{{- end }}
{{- end }}

{{/* A map as TOML, whole numbers as integers. */}}
{{- define "hetfed.toml" -}}
{{- $m := deepCopy . }}
{{- include "hetfed.intify" $m }}
{{- toToml $m }}
{{- end }}

{{/*
The organizations, each merged over clientDefaults, checked (DNS-1123 label, unique, known to a run),
as JSON: {"items": [...]}. Each item gains "runs": the ids of the runs it takes part in.
*/}}
{{- define "hetfed.organizations" -}}
{{- $orgs := list }}
{{- $seen := dict }}
{{- if not .Values.organizations }}
{{- fail "organizations: list at least one organization (a name, or an object with a name)" }}
{{- end }}
{{- range $i, $entry := .Values.organizations }}
{{- $o := kindIs "string" $entry | ternary (dict "name" $entry) (deepCopy $entry) }}
{{- $name := toString $o.name }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $name) }}
{{- fail (printf "organizations[%d]: name %q must be a DNS-1123 label: lower-case letters, digits and '-', starting and ending with a letter or digit" $i $name) }}
{{- end }}
{{- if gt (len $name) 63 }}
{{- fail (printf "organizations[%d]: name %q is longer than 63 characters" $i $name) }}
{{- end }}
{{- if hasKey $seen $name }}
{{- fail (printf "organizations[%d]: name %q is listed twice; organization names must be unique" $i $name) }}
{{- end }}
{{- $_ := set $seen $name true }}
{{- $merged := deepCopy $.Values.clientDefaults }}
{{- /* An organization that names its architecture (name or builder) replaces both of the defaults': they exclude each other. */}}
{{- $ownModel := default dict $o.model }}
{{- if and (kindIs "map" $ownModel) (or (hasKey $ownModel "name") (hasKey $ownModel "builder")) }}
{{- $_ := set $merged "model" (omit (default dict $merged.model) "name" "builder") }}
{{- end }}
{{- /* An organization on another data set does not inherit the defaults' settings of theirs (path, factory, ...). */}}
{{- $ownData := default dict $o.data }}
{{- if and (kindIs "map" $ownData) (hasKey $ownData "dataset") (ne (toString $ownData.dataset) (toString (get (default dict $merged.data) "dataset"))) }}
{{- $_ := set $merged "data" (omit (default dict $merged.data) "path" "factory" "options" "image_size" "channels" "mean" "std" "verify_images") }}
{{- end }}
{{- include "hetfed.mergeInto" (list $merged (omit $o "name" "tls")) }}
{{- $_ := set $merged "name" $name }}
{{- $_ := set $merged "tls" (default dict $o.tls) }}
{{- $orgs = append $orgs $merged }}
{{- end }}
{{- $runs := (include "hetfed.runs" . | fromJson).items }}
{{- $withRuns := list }}
{{- range $o := $orgs }}
{{- $ids := list }}
{{- range $r := $runs }}
{{- if has $o.name $r.organizations }}
{{- $ids = append $ids $r.id }}
{{- end }}
{{- end }}
{{- if not $ids }}
{{- fail (printf "organization %q takes part in no run: add it to a run's organizations, or remove it" $o.name) }}
{{- end }}
{{- $_ := set $o "runs" $ids }}
{{- $withRuns = append $withRuns $o }}
{{- end }}
{{- dict "items" $withRuns | toJson }}
{{- end }}

{{/* The organization names in order. */}}
{{- define "hetfed.organizationNames" -}}
{{- $names := list }}
{{- range $entry := .Values.organizations }}
{{- if kindIs "string" $entry }}
{{- $names = append $names $entry }}
{{- else }}
{{- $names = append $names (toString (get $entry "name")) }}
{{- end }}
{{- end }}
{{- dict "items" $names | toJson }}
{{- end }}

{{/* The runs, each with its organizations filled in (every organization when it names none), as JSON. */}}
{{- define "hetfed.runs" -}}
{{- $all := (include "hetfed.organizationNames" . | fromJson).items }}
{{- $runs := list }}
{{- $seen := dict }}
{{- if not .Values.runs }}
{{- fail "runs: define at least one run (id, algorithm)" }}
{{- end }}
{{- range $i, $r := .Values.runs }}
{{- $run := deepCopy $r }}
{{- if hasKey $seen $run.id }}
{{- fail (printf "runs[%d]: id %q is used twice; run ids must be unique" $i $run.id) }}
{{- end }}
{{- $_ := set $seen $run.id true }}
{{- if not $run.organizations }}
{{- $_ := set $run "organizations" $all }}
{{- end }}
{{- range $org := $run.organizations }}
{{- if not (has $org $all) }}
{{- fail (printf "runs[%d] (%s): organization %q is not in organizations" $i $run.id $org) }}
{{- end }}
{{- end }}
{{- $runs = append $runs $run }}
{{- end }}
{{- dict "items" $runs | toJson }}
{{- end }}

{{/* Where the PEM files are mounted in every container that uses them. */}}
{{- define "hetfed.tlsDir" -}}/etc/hetfed/tls{{- end }}

{{/* The aggregator's config file (TOML). */}}
{{- define "hetfed.aggregator.config" -}}
{{- $server := deepCopy .Values.aggregator.server }}
{{- $_ := set $server "listen" (printf "0.0.0.0:%d" (int .Values.aggregator.service.grpcPort)) }}
{{- $_ := set $server "metrics_port" .Values.aggregator.service.metricsPort }}
{{- $_ := set $server "metrics_host" "0.0.0.0" }}
{{- $_ := set $server "health_listen" (printf "0.0.0.0:%d" (int .Values.aggregator.healthPort)) }}
{{- $_ := set $server "state_dir" "/var/lib/hetfed" }}
{{- if .Values.tls.enabled }}
{{- $dir := include "hetfed.tlsDir" . }}
{{- $_ := set $server "tls" (dict "cert" (printf "%s/tls.crt" $dir) "key" (printf "%s/tls.key" $dir) "ca" (printf "%s/ca.crt" $dir)) }}
{{- $_ := set $server "operators" (concat (default list $server.operators) (list .Values.tls.operator.name) | uniq) }}
{{- end }}
{{- $runs := (include "hetfed.runs" . | fromJson).items }}
{{- include "hetfed.toml" (dict "server" $server "runs" $runs) }}
{{- end }}

{{/* One organization's client config file for one run (TOML). Call with (dict "root" $ "org" ORG "run" RUN). */}}
{{- define "hetfed.client.config" -}}
{{- $root := .root }}
{{- $org := .org }}
{{- $run := .run }}
{{- $cfg := deepCopy $org.config }}
{{- $_ := set $cfg "organization" $org.name }}
{{- $_ := set $cfg "run" $run.id }}
{{- $_ := set $cfg "aggregator" (include "hetfed.aggregator.address" $root) }}
{{- $_ := set $cfg "device" $org.device }}
{{- /* model: the builder, else the name (lenet when neither is set, as before builders existed). */}}
{{- $model := omit $org.model "name" "builder" }}
{{- if $org.model.builder }}
{{- $_ := set $model "builder" $org.model.builder }}
{{- else }}
{{- $_ := set $model "name" (default "lenet" $org.model.name) }}
{{- end }}
{{- $_ := set $cfg "model" $model }}
{{- $data := deepCopy $org.data }}
{{- /* An empty partition: the organization's own data as it is (natural) for imagefolder and torch, else dirichlet. */}}
{{- if not $data.partition }}
{{- $_ := set $data "partition" (has (toString $data.dataset) (list "imagefolder" "torch") | ternary "natural" "dirichlet") }}
{{- end }}
{{- $_ := set $data "num_clients" (len $run.organizations) }}
{{- range $i, $name := $run.organizations }}
{{- if eq $name $org.name }}
{{- $_ := set $data "client_index" $i }}
{{- end }}
{{- end }}
{{- if not $data.path }}
{{- if or (has (toString $data.dataset) (list "npz" "imagefolder")) (and (eq (toString $data.dataset) "torch") (ne $org.dataVolume.type "none")) }}
{{- $_ := set $data "path" $org.dataVolume.mountPath }}
{{- end }}
{{- end }}
{{- $_ := set $cfg "data" $data }}
{{- if $org.stateVolume.enabled }}
{{- $_ := set $cfg "state_dir" $org.stateVolume.mountPath }}
{{- end }}
{{- if $org.outputVolume.enabled }}
{{- $_ := set $cfg "output_dir" (printf "%s/%s" (trimSuffix "/" $org.outputVolume.mountPath) $run.id) }}
{{- end }}
{{- $_ := set $cfg "metrics_port" ($org.metrics.enabled | ternary (int $org.metrics.port) -1) }}
{{- $_ := set $cfg "metrics_host" "0.0.0.0" }}
{{- if $root.Values.tls.enabled }}
{{- $dir := include "hetfed.tlsDir" $root }}
{{- $tls := dict "cert" (printf "%s/tls.crt" $dir) "key" (printf "%s/tls.key" $dir) "ca" (printf "%s/ca.crt" $dir) }}
{{- if $root.Values.tls.serverName }}
{{- $_ := set $tls "server_name" $root.Values.tls.serverName }}
{{- end }}
{{- $_ := set $cfg "tls" $tls }}
{{- end }}
{{- include "hetfed.toml" $cfg }}
{{- end }}

{{/* The name of the Secret holding the aggregator's certificate. */}}
{{- define "hetfed.aggregator.tlsSecret" -}}
{{- default (printf "%s-tls" (include "hetfed.aggregator.fullname" .)) .Values.tls.aggregator.existingSecret }}
{{- end }}

{{/* The name of the Secret holding the operator's certificate. */}}
{{- define "hetfed.operator.tlsSecret" -}}
{{- default (include "hetfed.fit" (dict "name" (printf "%s-operator-tls" (include "hetfed.fullname" .)))) .Values.tls.operator.existingSecret }}
{{- end }}

{{/* The name of the Secret holding one organization's certificate. Call with (list $ ORG). */}}
{{- define "hetfed.client.tlsSecret" -}}
{{- $org := index . 1 }}
{{- default (printf "%s-tls" (include "hetfed.client.fullname" (list (index . 0) $org.name))) (get $org.tls "existingSecret") }}
{{- end }}

{{/*
Checks that need more than one value: a certificate for every party under mTLS, a data volume that
names its source. Rendered (empty) by every template that depends on them.
*/}}
{{- define "hetfed.validate" -}}
{{- $orgs := list }}
{{- range $o := (include "hetfed.organizations" . | fromJson).items }}
{{- if $o.enabled }}
{{- $orgs = append $orgs $o }}
{{- end }}
{{- end }}
{{- $a := .Values.aggregator }}
{{- if and (not $a.enabled) (not $orgs) }}
{{- fail "aggregator.enabled is false and no organization is enabled: the release would deploy nothing" }}
{{- end }}
{{- if and (not $a.enabled) (not $a.address) }}
{{- fail "aggregator.enabled is false: set aggregator.address, the host:port of the aggregator the organizations dial" }}
{{- end }}
{{- if and $a.address (not (regexMatch "^[^:/ ]+:[0-9]+$|^\\[[0-9a-fA-F:.]+\\]:[0-9]+$" $a.address)) }}
{{- fail (printf "aggregator.address %q: expected host:port (for example aggregator.example.org:443)" $a.address) }}
{{- end }}
{{- if and (not .Values.tls.enabled) (or (not $a.enabled) $a.external.enabled) }}
{{- fail "tls.enabled: an aggregator reached from outside the cluster (aggregator.external.enabled, or aggregator.enabled false) needs mTLS end to end" }}
{{- end }}
{{- if .Values.tls.enabled }}
{{- $needCa := false }}
{{- if and $a.enabled (not .Values.tls.aggregator.existingSecret) }}
{{- if not (and .Values.tls.aggregator.cert .Values.tls.aggregator.key) }}
{{- fail "tls.enabled: set tls.aggregator.existingSecret, or tls.aggregator.cert and tls.aggregator.key (see `hetfed certs`)" }}
{{- end }}
{{- $needCa = true }}
{{- end }}
{{- range $o := $orgs }}
{{- if not $o.tls.existingSecret }}
{{- if not (and $o.tls.cert $o.tls.key) }}
{{- fail (printf "tls.enabled: organization %q needs tls.existingSecret, or tls.cert and tls.key" $o.name) }}
{{- end }}
{{- $needCa = true }}
{{- end }}
{{- end }}
{{- if and $a.enabled .Values.tests.enabled (not .Values.tls.operator.existingSecret) }}
{{- if not (and .Values.tls.operator.cert .Values.tls.operator.key) }}
{{- fail (printf "tls.enabled: the helm test calls Status as %q: set tls.operator.existingSecret, or tls.operator.cert and tls.operator.key, or tests.enabled=false" .Values.tls.operator.name) }}
{{- end }}
{{- $needCa = true }}
{{- end }}
{{- if and $needCa (not .Values.tls.ca) }}
{{- fail "tls.ca: the CA certificate (PEM) is needed for the Secrets the chart creates" }}
{{- end }}
{{- end }}
{{- range $o := $orgs }}
{{- $v := $o.dataVolume }}
{{- if and (eq $v.type "persistentVolumeClaim") (not $v.existingClaim) }}
{{- fail (printf "organization %q: dataVolume.type persistentVolumeClaim needs dataVolume.existingClaim" $o.name) }}
{{- end }}
{{- if and (eq $v.type "hostPath") (not $v.hostPath) }}
{{- fail (printf "organization %q: dataVolume.type hostPath needs dataVolume.hostPath" $o.name) }}
{{- end }}
{{- $dataset := toString $o.data.dataset }}
{{- if and (has $dataset (list "npz" "imagefolder")) (eq $v.type "none") (not $o.data.path) }}
{{- fail (printf "organization %q: data.dataset %s reads the organization's own files: set dataVolume.type (or data.path on a volume of extraVolumes)" $o.name $dataset) }}
{{- end }}
{{- if and (eq $dataset "torch") (not $o.data.factory) }}
{{- fail (printf "organization %q: data.dataset torch needs data.factory, the organization's data factory (package.module:function, installed in its image)" $o.name) }}
{{- end }}
{{- if and (ne $dataset "torch") (or $o.data.factory $o.data.options) }}
{{- fail (printf "organization %q: data.factory and data.options are only used with data.dataset torch, got dataset %s" $o.name $dataset) }}
{{- end }}
{{- if and $o.model.name $o.model.builder }}
{{- fail (printf "organization %q: model.name (%s) and model.builder (%s) exclude each other: set one" $o.name $o.model.name $o.model.builder) }}
{{- end }}
{{- /* Under DP the privacy ledger lives in state_dir: on a pod's own disk a restarted pod would count ε from zero. */}}
{{- $privacy := get (default dict $o.config) "privacy" | default dict }}
{{- $dp := or (hasKey $privacy "epsilon_budget") (hasKey $privacy "target_epsilon") (hasKey $privacy "noise_multiplier") }}
{{- if and $dp (not $o.stateVolume.enabled) }}
{{- fail (printf "organization %q: config.privacy needs stateVolume.enabled: the privacy ledger lives in the client's state_dir, and on the pod's own disk a restarted pod would count ε from zero (docs/privacy.md)" $o.name) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Prometheus annotations of a pod. Call with (dict "port" PORT). */}}
{{- define "hetfed.scrapeAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}

{{/* True when the Prometheus operator's API is there and the value asks for it. Call with (list $ VALUE). */}}
{{- define "hetfed.monitoringApi" -}}
{{- $root := index . 0 }}
{{- if and (index . 1) ($root.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") }}true{{ end }}
{{- end }}

{{/*
A live object as JSON ("{}" when there is none). `lookup` answers only against a cluster: under
`helm template` and `helm lint` it is empty, so the upgrade checks below pass there. Call with
(list $ API_VERSION KIND NAMESPACE NAME).
*/}}
{{- define "hetfed.lookup" -}}
{{- lookup (index . 1) (index . 2) (index . 3) (index . 4) | default dict | toJson }}
{{- end }}

{{/* A storage quantity (512Mi, 8Gi, 1.5G, 1000) in bytes, as a float. */}}
{{- define "hetfed.bytes" -}}
{{- $q := toString . }}
{{- $units := dict "" 1.0 "K" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- $unit := regexFind "[KMGTPE]i?$" $q }}
{{- mulf (float64 (trimSuffix $unit $q)) (get $units $unit) }}
{{- end }}

{{/*
Refuse, before anything is applied, an upgrade that edits what Kubernetes cannot change in place: the
aggregator StatefulSet's volumeClaimTemplates (aggregator.persistence enabled, size, storageClass,
accessModes) and the class or access modes of an organization's state claim, or a shrunk claim.
*/}}
{{- define "hetfed.checkUpgrade" -}}
{{- $a := .Values.aggregator }}
{{- $p := $a.persistence }}
{{- if $a.enabled }}
{{- $name := include "hetfed.aggregator.fullname" . }}
{{- $live := include "hetfed.lookup" (list . "apps/v1" "StatefulSet" .Release.Namespace $name) | fromJson }}
{{- if $live }}
{{- $was := dict }}
{{- range $c := (default list $live.spec.volumeClaimTemplates) }}
{{- if eq $c.metadata.name "state" }}
{{- $was = $c.spec }}
{{- end }}
{{- end }}
{{- $how := "to resize the state volume or move it to another class, follow docs/deploy.md, \"Resizing a state volume\"" }}
{{- if ne (not (empty $was)) $p.enabled }}
{{- fail (printf "aggregator.persistence.enabled: the StatefulSet %s was installed with persistence.enabled=%t; Kubernetes refuses to change a StatefulSet's volumeClaimTemplates. Keep %t, or start over (docs/deploy.md, \"Uninstalling and starting over\")" $name (not (empty $was)) (not (empty $was))) }}
{{- end }}
{{- if $was }}
{{- $size := toString $was.resources.requests.storage }}
{{- if ne (include "hetfed.bytes" $size) (include "hetfed.bytes" $p.size) }}
{{- fail (printf "aggregator.persistence.size: the StatefulSet %s keeps its state volume at %s and Kubernetes refuses to change a StatefulSet's volumeClaimTemplates: keep size %s; %s" $name $size $size $how) }}
{{- end }}
{{- $class := toString (default "" $was.storageClassName) }}
{{- if ne $class (toString $p.storageClass) }}
{{- fail (printf "aggregator.persistence.storageClass: the StatefulSet %s keeps its state volume in class %q and Kubernetes refuses to change a StatefulSet's volumeClaimTemplates: keep storageClass %q; %s" $name $class $class $how) }}
{{- end }}
{{- if ne (toJson (default list $was.accessModes)) (toJson $p.accessModes) }}
{{- fail (printf "aggregator.persistence.accessModes: the StatefulSet %s keeps its state volume with access modes %s and Kubernetes refuses to change a StatefulSet's volumeClaimTemplates: keep them" $name (toJson $was.accessModes)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- range $o := (include "hetfed.organizations" . | fromJson).items }}
{{- $v := $o.stateVolume }}
{{- if and $o.enabled $v.enabled (not $v.existingClaim) }}
{{- $claim := include "hetfed.client.stateClaim" (list $ $o) }}
{{- $live := include "hetfed.lookup" (list $ "v1" "PersistentVolumeClaim" $.Release.Namespace $claim) | fromJson }}
{{- if $live }}
{{- $class := toString (default "" $live.spec.storageClassName) }}
{{- if and $v.storageClass (ne $class (toString $v.storageClass)) }}
{{- fail (printf "organization %q: stateVolume.storageClass: the claim %s is in class %q and a claim's class cannot change: keep %q, or move the state to a new claim (docs/deploy.md, \"Resizing a state volume\")" $o.name $claim $class $class) }}
{{- end }}
{{- if ne (toJson (default list $live.spec.accessModes)) (toJson $v.accessModes) }}
{{- fail (printf "organization %q: stateVolume.accessModes: the claim %s has access modes %s, which cannot change: keep them" $o.name $claim (toJson $live.spec.accessModes)) }}
{{- end }}
{{- $size := toString $live.spec.resources.requests.storage }}
{{- if lt (float64 (include "hetfed.bytes" $v.size)) (float64 (include "hetfed.bytes" $size)) }}
{{- fail (printf "organization %q: stateVolume.size: the claim %s holds %s and a claim never shrinks: keep %s or more" $o.name $claim $size $size) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- range $o := (include "hetfed.organizations" . | fromJson).items }}
{{- $v := $o.outputVolume }}
{{- if and $o.enabled $v.enabled (not $v.existingClaim) }}
{{- $claim := include "hetfed.client.outputClaim" (list $ $o) }}
{{- $live := include "hetfed.lookup" (list $ "v1" "PersistentVolumeClaim" $.Release.Namespace $claim) | fromJson }}
{{- if $live }}
{{- $class := toString (default "" $live.spec.storageClassName) }}
{{- if and $v.storageClass (ne $class (toString $v.storageClass)) }}
{{- fail (printf "organization %q: outputVolume.storageClass: the claim %s is in class %q and a claim's class cannot change: keep %q" $o.name $claim $class $class) }}
{{- end }}
{{- if ne (toJson (default list $live.spec.accessModes)) (toJson $v.accessModes) }}
{{- fail (printf "organization %q: outputVolume.accessModes: the claim %s has access modes %s, which cannot change: keep them" $o.name $claim (toJson $live.spec.accessModes)) }}
{{- end }}
{{- $size := toString $live.spec.resources.requests.storage }}
{{- if lt (float64 (include "hetfed.bytes" $v.size)) (float64 (include "hetfed.bytes" $size)) }}
{{- fail (printf "organization %q: outputVolume.size: the claim %s holds %s and a claim never shrinks: keep %s or more" $o.name $claim $size $size) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
