{{/* Names */}}
{{- define "pdgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* (list $ "component") -> "<fullname>-<component>" */}}
{{- define "pdgate.componentName" -}}
{{- printf "%s-%s" (include "pdgate.fullname" (index . 0)) (index . 1) }}
{{- end }}

{{- define "pdgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* (list $ "component") */}}
{{- define "pdgate.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "pdgate.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* (list $ "component") */}}
{{- define "pdgate.labels" -}}
{{- $ := index . 0 -}}
helm.sh/chart: {{ include "pdgate.chart" $ }}
{{ include "pdgate.selectorLabels" . }}
app.kubernetes.io/version: {{ $.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $.Release.Service }}
app.kubernetes.io/part-of: pdgate
{{- end }}

{{- define "pdgate.gatewayImage" -}}
{{- printf "%s:%s" .Values.gateway.image.repository (default .Chart.AppVersion .Values.gateway.image.tag) }}
{{- end }}

{{/* Shared state: "" (memory), "chart" (in-chart Redis), "url" or "secret" */}}
{{- define "pdgate.redisMode" -}}
{{- if .Values.redis.urlSecret.name }}secret
{{- else if .Values.redis.url }}url
{{- else if .Values.redis.enabled }}chart
{{- end }}
{{- end }}

{{/* Does pool (list $ "prefill") load LMCache? */}}
{{- define "pdgate.lmcacheOn" -}}
{{- $ := index . 0 -}}
{{- if and $.Values.lmcache.enabled (has (index . 1) $.Values.lmcache.pools) }}true{{ end }}
{{- end }}

{{/* vLLM --kv-transfer-config for pool (list $ "prefill"): NIXL, or NIXL + LMCache through MultiConnector */}}
{{- define "pdgate.kvTransferConfig" -}}
{{- $ := index . 0 -}}
{{- $nixl := dict "kv_connector" "NixlConnector" "kv_role" "kv_both" }}
{{- if $.Values.nixl.backends }}
{{- $_ := set $nixl "kv_connector_extra_config" (dict "backends" $.Values.nixl.backends) }}
{{- end }}
{{- if include "pdgate.lmcacheOn" . }}
{{- $lm := dict "kv_connector" "LMCacheConnectorV1" "kv_role" "kv_both" }}
{{- toJson (dict "kv_connector" "MultiConnector" "kv_role" "kv_both" "kv_connector_extra_config" (dict "connectors" (list $nixl $lm))) }}
{{- else }}
{{- toJson $nixl }}
{{- end }}
{{- end }}

{{/* vLLM --kv-events-config: publish on every interface (vLLM binds a wildcard address) */}}
{{- define "pdgate.kvEventsConfig" -}}
{{- $k := .Values.engines.kvEvents }}
{{- toJson (dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $k.port)) "replay_endpoint" (printf "tcp://*:%d" (int $k.replayPort))) }}
{{- end }}

{{/* LMCache's own config file */}}
{{- define "pdgate.lmcacheConfig" -}}
{{- $l := .Values.lmcache }}
{{- $c := dict "chunk_size" (int $l.chunkSize) "local_cpu" $l.l1.enabled }}
{{- if $l.l1.enabled }}
{{- $_ := set $c "max_local_cpu_size" $l.l1.sizeGB }}
{{- end }}
{{- if $l.l2.enabled }}
{{- $_ := set $c "remote_url" $l.l2.url }}
{{- $_ := set $c "remote_serde" $l.l2.serde }}
{{- end }}
{{- toYaml (mustMergeOverwrite $c (deepCopy $l.extraConfig)) }}
{{- end }}

{{/* The gateway's config file (validated by the gateway itself: see tests/helm) */}}
{{- define "pdgate.gatewayConfig" -}}
{{- $v := .Values }}
{{- $cfg := dict "server" (dict "host" "0.0.0.0" "port" (int $v.gateway.port) "log_level" $v.gateway.logLevel) }}
{{- $model := dict "name" $v.model.name "tokenizer" (default $v.model.id $v.model.tokenizer) "max_model_len" (int $v.model.maxModelLen) }}
{{- $_ := set $cfg "models" (list $model) }}
{{- $pools := dict }}
{{- range $pool := list "prefill" "decode" }}
{{- $p := index $v $pool }}
{{- $pc := dict }}
{{- $static := index $v.gateway.staticEndpoints $pool }}
{{- if $static }}
{{- $_ := set $pc "endpoints" $static }}
{{- end }}
{{- if and $v.gateway.discovery.enabled $p.enabled }}
{{- $d := dict "label_selector" (printf "kubernetes.io/service-name=%s" (include "pdgate.componentName" (list $ $pool))) "port" "http" }}
{{- if $v.engines.kvEvents.enabled }}
{{- $_ := set $d "kv_events_port" (int $v.engines.kvEvents.port) }}
{{- $_ := set $d "kv_events_replay_port" (int $v.engines.kvEvents.replayPort) }}
{{- end }}
{{- $_ := set $pc "discovery" $d }}
{{- end }}
{{- if and (eq $pool "decode") (not $pc) }}
{{- fail "gateway: no decode engines: enable decode with gateway.discovery.enabled, or list gateway.staticEndpoints.decode" }}
{{- end }}
{{- $_ := set $pools $pool $pc }}
{{- end }}
{{- $_ := set $cfg "pools" $pools }}
{{- $prefix := dict "hash_algo" $v.engines.prefixHashAlgo }}
{{- if $v.engines.pythonHashSeed }}
{{- $_ := set $prefix "hash_seed" (toString $v.engines.pythonHashSeed) }}
{{- end }}
{{- $_ := set $cfg "routing" (dict "decider" (dict "name" "token_threshold" "threshold" (int $v.gateway.routing.threshold)) "prefix" $prefix) }}
{{- $mode := include "pdgate.redisMode" . }}
{{- if eq $mode "chart" }}
{{- $_ := set $cfg "state" (dict "backend" "redis" "url" (printf "redis://%s:6379/0" (include "pdgate.componentName" (list . "redis")))) }}
{{- else if eq $mode "url" }}
{{- $_ := set $cfg "state" (dict "backend" "redis" "url" $v.redis.url) }}
{{- else if eq $mode "secret" }}
{{- $_ := set $cfg "state" (dict "backend" "redis" "url_env" "PDGATE_REDIS_URL") }}
{{- else if gt (int $v.gateway.replicas) 1 }}
{{- fail "gateway.replicas > 1 needs shared state: set redis.enabled=true, redis.url or redis.urlSecret.name" }}
{{- end }}
{{- if $v.gateway.apiKeysSecret.name }}
{{- $_ := set $cfg "auth" (dict "api_keys_env" "PDGATE_API_KEYS") }}
{{- end }}
{{- if $v.gateway.adminTokenSecret.name }}
{{- $_ := set $cfg "admin" (dict "token_env" "PDGATE_ADMIN_TOKEN") }}
{{- end }}
{{- toYaml (mustMergeOverwrite $cfg (deepCopy $v.gateway.config)) }}
{{- end }}
