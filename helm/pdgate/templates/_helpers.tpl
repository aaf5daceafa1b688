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
{{- $_ := set $nixl "kv_connector_extra_config" (dict "backends" (include "pdgate.nixlBackends" $ | fromJsonArray)) }}
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

{{/* NIXL backends as a JSON list: nixl.backends, or LIBFABRIC with EFA and UCX without */}}
{{- define "pdgate.nixlBackends" -}}
{{- $b := .Values.nixl.backends }}
{{- if not $b }}
{{- $b = ternary (list "LIBFABRIC") (list "UCX") .Values.efa.enabled }}
{{- end }}
{{- toJson $b }}
{{- end }}

{{/* LMCache's own config file for pool (list $ "prefill"). LMCache allocates max_local_cpu_size in
every GPU worker (one per tensor parallel rank): the pod's L1 is split over them. */}}
{{- define "pdgate.lmcacheConfig" -}}
{{- $ := index . 0 }}
{{- $p := index $.Values (index . 1) }}
{{- $l := $.Values.lmcache }}
{{- $c := dict "chunk_size" (int $l.chunkSize) "local_cpu" $l.l1.enabled }}
{{- if $l.l1.enabled }}
{{- $_ := set $c "max_local_cpu_size" (divf $l.l1.sizeGB (int $p.tensorParallelSize)) }}
{{- end }}
{{- if $l.l2.enabled }}
{{- with include "pdgate.lmcacheL2Url" $ }}{{/* empty with urlSecret: LMCACHE_REMOTE_URL */}}
{{- $_ := set $c "remote_url" . }}
{{- end }}
{{- $_ := set $c "remote_serde" $l.l2.serde }}
{{- end }}
{{- toYaml (mustMergeOverwrite $c (deepCopy $l.extraConfig)) }}
{{- end }}

{{/* The L2 store the chart runs (lmcache.l2.deploy): its port, and the remote_url the engines use */}}
{{- define "pdgate.lmcacheL2Port" -}}
{{- $st := .Values.lmcache.l2.store }}
{{- if $st.port }}{{ $st.port | int }}
{{- else }}{{ ternary 6379 65432 (eq $st.kind "redis") }}
{{- end }}
{{- end }}

{{/* The engines' LMCache remote_url: the chart's store (deploy), lmcache.l2.url, or "" (urlSecret) */}}
{{- define "pdgate.lmcacheL2Url" -}}
{{- $l2 := .Values.lmcache.l2 }}
{{- if $l2.deploy }}
{{- printf "%s://%s:%s" (ternary "redis" "lm" (eq $l2.store.kind "redis")) (include "pdgate.componentName" (list . "lmcache-l2")) (include "pdgate.lmcacheL2Port" .) }}
{{- else if not $l2.urlSecret.name }}
{{- $l2.url }}
{{- end }}
{{- end }}

{{/* The chart's L2 store: does this release run one? */}}
{{- define "pdgate.lmcacheL2Deployed" -}}
{{- $l := .Values.lmcache }}
{{- if and $l.enabled $l.l2.enabled $l.l2.deploy }}true{{ end }}
{{- end }}

{{/* The gateway's config file (validated by the gateway itself: see tests/helm) */}}
{{- define "pdgate.gatewayConfig" -}}
{{- $v := .Values }}
{{- $cfg := dict "server" (dict "host" "0.0.0.0" "port" (int $v.gateway.port) "log_level" $v.gateway.logLevel "workers" (include "pdgate.gatewayWorkers" . | int)) }}
{{- $model := dict "name" $v.model.name "tokenizer" (default $v.model.id $v.model.tokenizer) "max_model_len" (int $v.model.maxModelLen) }}
{{- $_ := set $cfg "models" (list $model) }}
{{- if $v.lora.enabled }}
{{- /* the adapters' paths as the engines' --lora-modules give them: the same strings */}}
{{- $adapters := list }}
{{- range include "pdgate.loraAdapters" . | fromJsonArray }}
{{- $a := dict "name" .name "path" .path }}
{{- if .maxRank }}{{ $_ := set $a "max_rank" (int .maxRank) }}{{ end }}
{{- $adapters = append $adapters $a }}
{{- end }}
{{- if $adapters }}
{{- $_ := set $model "adapters" $adapters }}
{{- end }}
{{- $l := $v.lora }}
{{- $_ := set $cfg "lora" (dict "discover" $l.discover "refresh_s" (float64 $l.refreshSeconds) "dynamic_loading" $l.dynamicLoading "load_timeout_s" (float64 $l.loadTimeoutSeconds) "max_adapters_per_engine" (int $l.maxAdaptersPerEngine)) }}
{{- end }}
{{- $pools := dict }}
{{- range $pool := list "prefill" "decode" }}
{{- $p := index $v $pool }}
{{- $pc := dict }}
{{- $static := index $v.gateway.staticEndpoints $pool }}
{{- if $static }}
{{- $_ := set $pc "endpoints" $static }}
{{- end }}
{{- if and $v.gateway.discovery.enabled $p.enabled }}
{{- /* address_type: IPv4 only, one slice family (a dual-stack Service has two for the same pods) */}}
{{- $d := dict "label_selector" (printf "kubernetes.io/service-name=%s" (include "pdgate.componentName" (list $ $pool))) "port" "http" "address_type" "IPv4" }}
{{- if $v.engines.kvEvents.enabled }}
{{- $_ := set $d "kv_events_port" (int $v.engines.kvEvents.port) }}
{{- $_ := set $d "kv_events_replay_port" (int $v.engines.kvEvents.replayPort) }}
{{- end }}
{{- if eq $v.placement.pairing "spine" }}
{{- /* each engine's Node labels: the gateway's ClusterRole gets `get` on nodes for them */}}
{{- $_ := set $d "node_labels" (list $v.placement.spineLabel) }}
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
{{- if ne (toString $v.engines.pythonHashSeed) "" }}{{/* --set engines.pythonHashSeed=0 is an integer 0 */}}
{{- $_ := set $prefix "hash_seed" (toString $v.engines.pythonHashSeed) }}
{{- end }}
{{- $routing := dict "decider" (dict "name" "token_threshold" "threshold" (int $v.gateway.routing.threshold)) "prefix" $prefix }}
{{- if and (ne $v.placement.pairing "off") $pools.prefill }}
{{- /* Pairing: a prefill engine in the decode engine's zone (EFA does not cross zones); the
scorers are the gateway's defaults, written out because a pool's routing replaces them whole */}}
{{- $scorers := list (dict "name" "prefix_affinity" "weight" 2) (dict "name" "load" "weight" 1) }}
{{- if eq $v.placement.pairing "spine" }}
{{- $scorers = append $scorers (dict "name" "topology" "weight" 2 "levels" (list "topology.kubernetes.io/zone" $v.placement.spineLabel)) }}
{{- end }}
{{- $_ := set $routing "prefill" (dict "filters" (list (dict "name" "same_zone")) "scorers" $scorers) }}
{{- end }}
{{- $_ := set $cfg "routing" $routing }}
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
{{- if or $v.planner.enabled (eq $v.autoscaling.signal "planner") }}
{{- $pl := dict "enabled" true "profile" $v.planner.profile "target" (float64 $v.planner.target) "tail" $v.planner.tail "window_s" (float64 $v.planner.windowSeconds) }}
{{- if $v.planner.slos }}
{{- $slos := list }}
{{- range $slo := $v.planner.slos }}{{/* seconds given with --set arrive as strings */}}
{{- $one := deepCopy $slo }}
{{- range $k := list "ttft_s" "itl_p90_s" "itl_p99_s" }}
{{- if hasKey $one $k }}{{ $_ := set $one $k (float64 (index $one $k)) }}{{ end }}
{{- end }}
{{- $slos = append $slos $one }}
{{- end }}
{{- $_ := set $pl "slos" $slos }}
{{- end }}
{{- $_ := set $cfg "planner" $pl }}
{{- end }}
{{- if eq $v.gateway.mode "epp" }}
{{- $e := $v.gateway.epp }}
{{- /* the chart's Envoy routes to one address per request (ORIGINAL_DST): no fallbacks */}}
{{- $fallbacks := ternary 0 (int $e.fallbacks) $e.envoy.enabled }}
{{- $_ := set $cfg "epp" (dict "port" (int $e.grpcPort) "fallbacks" $fallbacks "prefill" $e.prefill) }}
{{- end }}
{{- if $v.gateway.apiKeysSecret.name }}
{{- $_ := set $cfg "auth" (dict "api_keys_env" "PDGATE_API_KEYS") }}
{{- end }}
{{- if $v.gateway.adminTokenSecret.name }}
{{- $_ := set $cfg "admin" (dict "token_env" "PDGATE_ADMIN_TOKEN") }}
{{- end }}
{{- toYaml (mustMergeOverwrite $cfg (deepCopy $v.gateway.config)) }}
{{- end }}

{{/* A Kubernetes memory quantity ("64Gi", "200G", "1.5Ti", bytes) in GiB, as a string */}}
{{- define "pdgate.gib" -}}
{{- $q := toString . }}
{{- $n := regexFind "^[0-9]+(\\.[0-9]+)?" $q }}
{{- $unit := trimPrefix $n $q }}
{{- $per := dict "" (divf 1 1073741824) "k" (divf 1000 1073741824) "Ki" (divf 1 1048576) "M" (divf 1000000 1073741824) "Mi" (divf 1 1024) "G" (divf 1000000000 1073741824) "Gi" 1.0 "T" (divf 1000000000000 1073741824) "Ti" 1024.0 "P" (divf 1000000000000000 1073741824) "Pi" 1048576.0 }}
{{- if not (hasKey $per $unit) }}
{{- fail (printf "cannot read the memory quantity %q" $q) }}
{{- end }}
{{- mulf (float64 $n) (index $per $unit) }}
{{- end }}

{{/* Settings that are each valid but do not work together: fail the install with the reason. */}}
{{- define "pdgate.validate" -}}
{{- $v := .Values }}
{{- if $v.efa.enabled }}
{{- if not (has "LIBFABRIC" (include "pdgate.nixlBackends" . | fromJsonArray)) }}
{{- fail (printf "efa.enabled needs NIXL's LIBFABRIC backend (nixl.backends is %s): NIXL documents LIBFABRIC for EFA, and UCX without an EFA transport moves the KV cache over TCP. Set nixl.backends to [LIBFABRIC] or leave it empty" (toJson $v.nixl.backends)) }}
{{- end }}
{{- range $pool := list "prefill" "decode" }}
{{- $p := index $v $pool }}
{{- if and $p.enabled (lt (int $p.efaDevices) 1) }}
{{- fail (printf "efa.enabled needs %s.efaDevices >= 1 (vpc.amazonaws.com/efa per pod, e.g. 32 on p5.48xlarge): without EFA devices NIXL falls back to TCP" $pool) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $v.networkPolicy.enabled (eq $v.gateway.mode "epp") (not $v.gateway.epp.envoy.enabled) (not $v.networkPolicy.dataPlaneIngress) }}
{{- fail "networkPolicy.enabled with gateway.mode epp needs networkPolicy.dataPlaneIngress (the NetworkPolicyPeers of your Gateway's data plane, e.g. [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: envoy-gateway-system}}}]): the policies would block it from the picker and the decode engines" }}
{{- end }}
{{- if and $v.networkPolicy.enabled $v.monitoring.serviceMonitor.enabled (not $v.networkPolicy.monitoringNamespaceSelector) }}
{{- fail "networkPolicy.enabled with monitoring.serviceMonitor.enabled needs networkPolicy.monitoringNamespaceSelector (the namespace Prometheus runs in, e.g. {matchLabels: {kubernetes.io/metadata.name: monitoring}}): the policies would block its scrapes" }}
{{- end }}
{{- $l2 := $v.lmcache.l2 }}
{{- if and $l2.deploy (not (and $v.lmcache.enabled $l2.enabled)) }}
{{- fail "lmcache.l2.deploy runs a store that only the engines' LMCache uses: also set lmcache.enabled=true and lmcache.l2.enabled=true, or leave deploy off" }}
{{- end }}
{{- if and $v.lmcache.enabled $l2.enabled }}
{{- $sources := list }}
{{- if $l2.deploy }}{{ $sources = append $sources "deploy" }}{{ end }}
{{- if $l2.url }}{{ $sources = append $sources "url" }}{{ end }}
{{- if $l2.urlSecret.name }}{{ $sources = append $sources "urlSecret.name" }}{{ end }}
{{- if gt (len $sources) 1 }}
{{- fail (printf "lmcache.l2: %s are all set; choose one store: deploy=true (this release runs it) or url / urlSecret.name (an existing one)" (join " and " $sources)) }}
{{- end }}
{{- if not $sources }}
{{- fail "lmcache.l2.enabled needs a store: lmcache.l2.deploy=true (this release runs one) or lmcache.l2.url / lmcache.l2.urlSecret.name (an existing one)" }}
{{- end }}
{{- if $l2.deploy }}
{{- $r := $l2.store.resources | default dict }}
{{- $req := $r.requests | default dict }}
{{- $lim := $r.limits | default dict }}
{{- if not (and (index $req "cpu") (index $req "memory") (index $lim "memory")) }}
{{- fail "lmcache.l2.store.resources needs requests.cpu, requests.memory and limits.memory: the memory limit is the cache's size (Redis gets --maxmemory from it) and keeps the store from taking its node's memory" }}
{{- end }}
{{- if lt (include "pdgate.gib" (index $lim "memory") | float64) 0.25 }}
{{- fail (printf "lmcache.l2.store.resources.limits.memory %s is below 256Mi: too small for a KV cache (a single chunk of a 70B model's KV is tens of MiB)" (toString (index $lim "memory"))) }}
{{- end }}
{{- $users := list }}
{{- range $pool := list "prefill" "decode" }}
{{- if and (index $v $pool).enabled (include "pdgate.lmcacheOn" (list $ $pool)) }}{{ $users = append $users $pool }}{{ end }}
{{- end }}
{{- if not $users }}
{{- fail (printf "lmcache.l2.deploy: no enabled pool loads LMCache (lmcache.pools %s): the store would have no clients, and its NetworkPolicy nobody to admit" (toJson $v.lmcache.pools)) }}
{{- end }}
{{- if and (ne $l2.store.kind "redis") $l2.store.extraArgs }}
{{- fail "lmcache.l2.store.extraArgs: only the redis kind takes extra arguments (lmcache_server takes host, port and device only)" }}
{{- end }}
{{- end }}
{{- end }}
{{- range $pool := list "prefill" "decode" }}
{{- $p := index $v $pool }}
{{- if $p.enabled }}
{{- range $section := list "requests" "limits" }}
{{- $r := index $p.resources $section | default dict }}
{{- if and (hasKey $r "nvidia.com/gpu") (ne (toString (index $r "nvidia.com/gpu")) (toString $p.gpus)) }}
{{- fail (printf "%s.resources.%s sets nvidia.com/gpu to %v but %s.gpus is %v: set the GPU count in %s.gpus only" $pool $section (index $r "nvidia.com/gpu") $pool $p.gpus $pool) }}
{{- end }}
{{- end }}
{{- if and (include "pdgate.lmcacheOn" (list $ $pool)) $v.lmcache.l1.enabled }}
{{- $mem := or (index ($p.resources.limits | default dict) "memory") (index ($p.resources.requests | default dict) "memory") }}
{{- if $mem }}
{{- $l1 := divf (mulf $v.lmcache.l1.sizeGB 1000000000) 1073741824 }}
{{- $need := addf $l1 (include "pdgate.gib" $p.shmSize | float64) }}
{{- if lt (include "pdgate.gib" $mem | float64) $need }}
{{- fail (printf "%s: a memory limit of %s cannot hold LMCache's L1 (lmcache.l1.sizeGB %v GB per pod, %v GB in each of %d GPU workers) plus /dev/shm (%s); raise %s.resources.limits.memory above %.0fGi plus vLLM's own memory, or lower lmcache.l1.sizeGB" $pool (toString $mem) $v.lmcache.l1.sizeGB (divf $v.lmcache.l1.sizeGB (int $p.tensorParallelSize)) (int $p.tensorParallelSize) $p.shmSize $pool $need) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- /* GPUs, parallelism, replicas, labels, grace periods: per enabled pool */}}
{{- range $pool := list "prefill" "decode" }}
{{- $p := index $v $pool }}
{{- if $p.enabled }}
{{- range $a := $p.extraArgs }}
{{- $flag := regexReplaceAll "=.*$" (toString $a) "" }}
{{- if has $flag (list "--tensor-parallel-size" "-tp" "--pipeline-parallel-size" "-pp" "--nnodes" "--node-rank" "--master-addr" "--headless") }}
{{- fail (printf "%s.extraArgs sets %s: the chart sets it from %s.tensorParallelSize / pipelineParallelSize / multiNode, and checks them against %s.gpus" $pool $flag $pool $pool) }}
{{- end }}
{{- if eq $flag "--shutdown-timeout" }}
{{- fail (printf "%s.extraArgs sets --shutdown-timeout: the chart sets it from engines.shutdownTimeoutSeconds and checks it against %s.terminationGracePeriodSeconds" $pool $pool) }}
{{- end }}
{{- end }}
{{- $nodes := ternary (int $p.multiNode.size) 1 $p.multiNode.enabled }}
{{- $ranks := mul (int $p.tensorParallelSize) (int $p.pipelineParallelSize) }}
{{- if ne (mul (int $p.gpus) $nodes) $ranks }}
{{- if $p.multiNode.enabled }}
{{- fail (printf "%s: %d GPUs per pod x multiNode.size %d = %d GPUs, but tensorParallelSize %d x pipelineParallelSize %d = %d ranks: vLLM needs one GPU per rank (e.g. 8 GPUs x 2 nodes: tensorParallelSize 8, pipelineParallelSize 2)" $pool (int $p.gpus) $nodes (mul (int $p.gpus) $nodes) (int $p.tensorParallelSize) (int $p.pipelineParallelSize) $ranks) }}
{{- else }}
{{- fail (printf "%s: gpus is %d but tensorParallelSize %d x pipelineParallelSize %d = %d: vLLM needs one GPU per rank on the node (set %s.gpus to %d, or the parallel sizes to use %d GPUs; more GPUs than one node has: %s.multiNode)" $pool (int $p.gpus) (int $p.tensorParallelSize) (int $p.pipelineParallelSize) $ranks $pool $ranks (int $p.gpus) $pool) }}
{{- end }}
{{- end }}
{{- if and $p.autoscaling.enabled (gt (int $p.autoscaling.minReplicas) (int $p.autoscaling.maxReplicas)) }}
{{- fail (printf "%s.autoscaling: minReplicas %d is above maxReplicas %d" $pool (int $p.autoscaling.minReplicas) (int $p.autoscaling.maxReplicas)) }}
{{- end }}
{{- if ge (int $v.engines.preStopSleepSeconds) (int $p.terminationGracePeriodSeconds) }}
{{- fail (printf "engines.preStopSleepSeconds (%d) must stay below %s.terminationGracePeriodSeconds (%d): the kubelet kills the pod at the end of the grace period, preStop included, and vLLM would get no time to stop" (int $v.engines.preStopSleepSeconds) $pool (int $p.terminationGracePeriodSeconds)) }}
{{- end }}
{{- $drain := include "pdgate.engineShutdownTimeout" (list $ $pool) | int }}
{{- if kindIs "invalid" $v.engines.shutdownTimeoutSeconds }}
{{- if lt $drain 1 }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%d) leaves no time for vLLM to drain after engines.preStopSleepSeconds (%d) and 15 s to exit: raise the grace period, or set engines.shutdownTimeoutSeconds: 0 to abort requests in flight on purpose" $pool (int $p.terminationGracePeriodSeconds) (int $v.engines.preStopSleepSeconds)) }}
{{- end }}
{{- else if gt (add (int $v.engines.preStopSleepSeconds) $drain 15) (int $p.terminationGracePeriodSeconds) }}
{{- fail (printf "engines.shutdownTimeoutSeconds (%d) + engines.preStopSleepSeconds (%d) + 15 s to exit must fit in %s.terminationGracePeriodSeconds (%d): the kubelet kills vLLM at the end of the grace period, cutting the drain short" $drain (int $v.engines.preStopSleepSeconds) $pool (int $p.terminationGracePeriodSeconds)) }}
{{- end }}
{{- if and $p.multiNode.enabled (eq (toString (dig "type" "" ($p.strategy | default dict))) "Recreate") }}
{{- fail (printf "%s.strategy.type Recreate: a LeaderWorkerSet (%s.multiNode) only rolls out with RollingUpdate (set %s.strategy.rollingUpdate.maxUnavailable instead)" $pool $pool $pool) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $c := list "gateway" "prefill" "decode" }}
{{- range $k := keys ((index $v $c).podLabels | default dict) | sortAlpha }}
{{- if has $k (list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component") }}
{{- fail (printf "%s.podLabels sets %s: the chart's selector labels place the pod in its Service, Deployment and NetworkPolicies and cannot be changed" $c $k) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* UCX moves GPU memory only with a CUDA transport; UCX_TLS as the container ends up with it
(the last entry of a name wins) */}}
{{- if has "UCX" (include "pdgate.nixlBackends" . | fromJsonArray) }}
{{- range $pool := list "prefill" "decode" }}
{{- $p := index $v $pool }}
{{- if $p.enabled }}
{{- $tls := "" }}
{{- range concat ($v.nixl.env | default list) ($v.engines.extraEnv | default list) ($p.extraEnv | default list) }}
{{- if and (eq .name "UCX_TLS") (hasKey . "value") }}
{{- $tls = toString .value }}
{{- end }}
{{- end }}
{{- if $tls }}
{{- $names := splitList "," (lower (trimPrefix "^" $tls)) }}
{{- $cuda := false }}
{{- if hasPrefix "^" $tls }}
{{- $cuda = not (or (has "cuda" $names) (has "cuda_copy" $names)) }}
{{- else }}
{{- $cuda = or (has "cuda" $names) (has "cuda_copy" $names) (has "all" $names) }}
{{- end }}
{{- if not $cuda }}
{{- fail (printf "%s: UCX_TLS=%s has no CUDA transport: NIXL's UCX backend cannot move the GPU-resident KV cache without cuda_copy (NIXL refuses it). Add cuda_copy (and cuda_ipc for GPUs on one node), e.g. sm,cuda_ipc,cuda_copy,tcp as llm-d uses" $pool $tls) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- /* Model loading */}}
{{- if hasPrefix "s3://" $v.model.id }}
{{- if not (hasPrefix "runai_streamer" $v.model.loadFormat) }}
{{- fail (printf "model.id %s is on S3: vLLM reads it only with model.loadFormat runai_streamer (or runai_streamer_sharded)" $v.model.id) }}
{{- end }}
{{- if not $v.model.tokenizer }}
{{- fail "model.id is on S3: set model.tokenizer to the model's Hugging Face id (or a path in the gateway image): the gateway loads the tokenizer itself and cannot read S3" }}
{{- end }}
{{- end }}
{{- if $v.model.preload.enabled }}
{{- if ne $v.model.cache.type "pvc" }}
{{- fail (printf "model.preload needs model.cache.type pvc (a claim every engine pod mounts, e.g. FSx for Lustre); with %s the Job's download would land where no engine reads it" $v.model.cache.type) }}
{{- end }}
{{- if hasPrefix "s3://" $v.model.id }}
{{- fail "model.preload downloads a Hugging Face model id; model.id is on S3 (streamed by the engines): turn one of them off" }}
{{- end }}
{{- end }}
{{- if $v.lora.enabled }}
{{- include "pdgate.loraCheck" . }}
{{- end }}
{{- with $v.gateway.service.awsHealthCheck }}
{{- $grace := add 40 (int $v.gateway.preStopSleepSeconds) }}
{{- $delay := include "pdgate.nlbDeregistrationDelay" $ | int }}
{{- if and .enabled (eq $v.gateway.service.type "LoadBalancer") (lt $delay $grace) }}
{{- fail (printf "gateway.service.awsHealthCheck.deregistrationDelaySeconds (%d) is below the gateway's grace period (%d s: preStopSleepSeconds + 40 s of stream draining): the NLB would reset streams the gateway is still finishing" $delay $grace) }}
{{- end }}
{{- end }}
{{- include "pdgate.referencesExist" . }}
{{- end }}

{{/* Claims and Secrets the release uses but does not create (model cache, adapters, compile cache;
the Hugging Face token, API keys, admin token, Redis and L2 URLs): against a live cluster (helm
install/upgrade, --dry-run=server) a missing one fails the install by name, rather than leaving
engines Pending or a hook Job waiting for the whole --timeout. Only named objects are looked up, in
the release's namespace (Helm itself needs Secrets there), and claims by listing them. helm template
has no cluster: the list comes back empty, with no items key, and the check is skipped. */}}
{{- define "pdgate.referencesExist" -}}
{{- $v := .Values }}
{{- $ns := .Release.Namespace }}
{{- $claims := dict }}
{{- if eq $v.model.cache.type "pvc" }}{{ $_ := set $claims $v.model.cache.claimName "model.cache.claimName (the model weights, e.g. FSx for Lustre: deploy/eks/README.md step 6)" }}{{ end }}
{{- if and $v.lora.enabled $v.lora.source.pvc.claimName }}{{ $_ := set $claims $v.lora.source.pvc.claimName "lora.source.pvc.claimName (the adapters)" }}{{ end }}
{{- if eq $v.engines.compileCache.type "pvc" }}{{ $_ := set $claims $v.engines.compileCache.claimName "engines.compileCache.claimName (compiled kernels)" }}{{ end }}
{{- if $claims }}
{{- $list := lookup "v1" "PersistentVolumeClaim" $ns "" }}
{{- if hasKey $list "items" }}
{{- $have := list }}{{ range $list.items }}{{ $have = append $have .metadata.name }}{{ end }}
{{- range $claim, $what := $claims }}
{{- if not (has $claim $have) }}
{{- fail (printf "PersistentVolumeClaim %q does not exist in namespace %s: %s. Create it first (kubectl -n %s get pvc), or change the value" $claim $ns $what $ns) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- $secrets := list }}
{{- if $v.model.hfTokenSecret }}{{ $secrets = append $secrets (list $v.model.hfTokenSecret "HF_TOKEN" "model.hfTokenSecret") }}{{ end }}
{{- with $v.gateway.apiKeysSecret }}{{ if .name }}{{ $secrets = append $secrets (list .name .key "gateway.apiKeysSecret") }}{{ end }}{{ end }}
{{- with $v.gateway.adminTokenSecret }}{{ if .name }}{{ $secrets = append $secrets (list .name .key "gateway.adminTokenSecret") }}{{ end }}{{ end }}
{{- with $v.redis.urlSecret }}{{ if .name }}{{ $secrets = append $secrets (list .name .key "redis.urlSecret") }}{{ end }}{{ end }}
{{- with $v.lmcache.l2.urlSecret }}{{ if and $v.lmcache.enabled $v.lmcache.l2.enabled .name }}{{ $secrets = append $secrets (list .name .key "lmcache.l2.urlSecret") }}{{ end }}{{ end }}
{{- if $secrets }}
{{- if hasKey (lookup "v1" "Secret" $ns "") "items" }}{{/* a live cluster (Helm lists Secrets to store releases) */}}
{{- range $secrets }}
{{- $name := index . 0 }}{{ $key := index . 1 }}{{ $what := index . 2 }}
{{- $secret := lookup "v1" "Secret" $ns $name }}
{{- if not $secret }}
{{- fail (printf "Secret %q (%s) does not exist in namespace %s: create it first (deploy/eks/README.md step 5: kubectl -n %s create secret generic %s --from-literal=%s=...)" $name $what $ns $ns $name $key) }}
{{- else if not (hasKey ($secret.data | default dict) $key) }}
{{- fail (printf "Secret %q (%s) in namespace %s has no key %q (it has: %s)" $name $what $ns $key (keys ($secret.data | default dict) | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The pool's rollout strategy: <pool>.strategy, else no surge unless the pool may be one replica */}}
{{- define "pdgate.strategy" -}}
{{- $p := . }}
{{- if $p.strategy }}
{{- toYaml $p.strategy }}
{{- else }}
{{- $min := ternary $p.autoscaling.minReplicas $p.replicas $p.autoscaling.enabled | int }}
{{- if le $min 1 }}
type: RollingUpdate
rollingUpdate: {maxSurge: 1, maxUnavailable: 0}  # one replica: start the new engine before stopping the old
{{- else }}
type: RollingUpdate
rollingUpdate: {maxSurge: 0, maxUnavailable: 1}  # GPUs are scarce: replace one engine at a time
{{- end }}
{{- end }}
{{- end }}

{{/*
Gateway worker processes: gateway.workers, or the pod's CPU request rounded up ("2" -> 2,
"1500m" -> 2, none -> 1). Inside a container the process may see every core of the node, so the
chart never leaves the count to the gateway.
*/}}
{{- define "pdgate.gatewayWorkers" -}}
{{- $w := int .Values.gateway.workers }}
{{- if gt $w 0 }}{{ $w }}
{{- else }}
{{- $cpu := toString (dig "requests" "cpu" "1" (.Values.gateway.resources | default dict)) }}
{{- if hasSuffix "m" $cpu }}
{{- $milli := trimSuffix "m" $cpu | int }}
{{- max 1 (div (add $milli 999) 1000) }}
{{- else }}
{{- max 1 (ceil (float64 $cpu)) | int }}
{{- end }}
{{- end }}
{{- end }}

{{/* The last value <args> give one of <flags> (list ARGS (list "--flag" "-f")): "--flag=V" or
"--flag V", vLLM's underscore spellings (--flag_name) included; "" when none does */}}
{{- define "pdgate.extraArgValue" -}}
{{- $flags := index . 1 }}
{{- $value := "" }}
{{- $take := false }}
{{- range (index . 0) | default list }}
{{- $a := toString . }}
{{- if $take }}
{{- $value = $a }}
{{- $take = false }}
{{- else }}
{{- $flag := regexReplaceAll "=.*$" $a "" }}
{{- if hasPrefix "--" $flag }}{{ $flag = replace "_" "-" $flag }}{{ end }}
{{- if has $flag $flags }}
{{- if contains "=" $a }}{{ $value = regexReplaceAll "^[^=]*=" $a "" }}{{ else }}{{ $take = true }}{{ end }}
{{- end }}
{{- end }}
{{- end }}
{{- $value }}
{{- end }}

{{/* Where the LoRA adapters' files come from: "pvc", "s3" or "" (no volume: paths given) */}}
{{- define "pdgate.loraSource" -}}
{{- $s := .Values.lora.source }}
{{- if $s.pvc.claimName }}pvc
{{- else if $s.s3.uri }}s3
{{- end }}
{{- end }}

{{/* LoRA settings that are each valid but do not work together (lora.enabled only) */}}
{{- define "pdgate.loraCheck" -}}
{{- $v := .Values }}
{{- $l := $v.lora }}
{{- $ranks := list 1 8 16 32 64 128 256 320 512 }}
{{- if not (has (int $l.maxLoraRank) $ranks) }}
{{- fail (printf "lora.maxLoraRank %v is not a rank vLLM accepts: one of 1, 8, 16, 32, 64, 128, 256, 320, 512 (vLLM --max-lora-rank; at least every adapter's rank)" $l.maxLoraRank) }}
{{- end }}
{{- if and $l.maxCpuLoras (lt (int $l.maxCpuLoras) (int $l.maxLoras)) }}
{{- fail (printf "lora.maxCpuLoras %d is below lora.maxLoras %d: vLLM refuses it (--max-cpu-loras, the adapters kept loaded, must hold the ones in a batch); raise it or leave it null" (int $l.maxCpuLoras) (int $l.maxLoras)) }}
{{- end }}
{{- if and $l.source.pvc.claimName $l.source.s3.uri }}
{{- fail "lora.source: pvc.claimName and s3.uri are both set; the adapters come from one of them" }}
{{- end }}
{{- $source := include "pdgate.loraSource" . }}
{{- $names := list }}
{{- range $i, $a := $l.adapters }}
{{- if has $a.name $names }}
{{- fail (printf "lora.adapters: two adapters are named %s (each name is a model clients ask for)" $a.name) }}
{{- end }}
{{- $names = append $names $a.name }}
{{- if eq $a.name $v.model.name }}
{{- fail (printf "lora.adapters[%d]: %s is model.name: an adapter is served under a name of its own" $i $a.name) }}
{{- end }}
{{- if and (not $a.path) (not $source) }}
{{- fail (printf "lora.adapters[%d] (%s) has no path and lora.source mounts nothing: set lora.source.pvc.claimName or lora.source.s3.uri (the path is then %s/%s), or give the adapter's path" $i $a.name $l.mountPath $a.name) }}
{{- end }}
{{- if and $a.maxRank (gt (int $a.maxRank) (int $l.maxLoraRank)) }}
{{- fail (printf "lora.adapters[%d] (%s): maxRank %d is above lora.maxLoraRank %d: vLLM cannot load it (and an adapter that fails at start stops the engine); raise lora.maxLoraRank" $i $a.name (int $a.maxRank) (int $l.maxLoraRank)) }}
{{- end }}
{{- if and (eq (toString $a.preload) "false") (not $l.dynamicLoading) }}
{{- fail (printf "lora.adapters[%d] (%s): preload false needs lora.dynamicLoading (the gateway loads it when first asked for); without it no engine would ever hold it" $i $a.name) }}
{{- end }}
{{- end }}
{{- range $pool := list "prefill" "decode" }}
{{- $p := index $v $pool }}
{{- if $p.enabled }}
{{- range $a := $p.extraArgs }}
{{- $flag := regexReplaceAll "=.*$" (toString $a) "" | replace "_" "-" }}
{{- if has $flag (list "--enable-lora" "--no-enable-lora" "--max-loras" "--max-cpu-loras" "--max-lora-rank" "--lora-modules") }}
{{- fail (printf "%s.extraArgs sets %s: with lora.enabled the chart sets it from lora.* (the same on both pools; a second --lora-modules would replace the chart's list)" $pool $flag) }}
{{- end }}
{{- end }}
{{- if $l.dynamicLoading }}
{{- $asc := include "pdgate.extraArgValue" (list $p.extraArgs (list "--api-server-count" "-asc")) }}
{{- if $asc }}
{{- if gt (int $asc) 1 }}
{{- fail (printf "%s.extraArgs sets --api-server-count %s: vLLM refuses runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING, lora.dynamicLoading) with more than one API server per engine; drop it or turn lora.dynamicLoading off" $pool $asc) }}
{{- end }}
{{- else }}
{{- $dp := include "pdgate.extraArgValue" (list $p.extraArgs (list "--data-parallel-size" "-dp")) }}
{{- if and $dp (gt (int $dp) 1) }}
{{- fail (printf "%s.extraArgs sets --data-parallel-size %s, and vLLM then runs that many API servers per engine (its default --api-server-count), which runtime LoRA loading (lora.dynamicLoading) refuses: add --api-server-count 1 to %s.extraArgs or turn lora.dynamicLoading off" $pool $dp $pool) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The LoRA adapters as a JSON list of {name, path, maxRank, preload}, each path exactly as the
engines load it and the gateway names it: the adapter's own, else lora.mountPath/name */}}
{{- define "pdgate.loraAdapters" -}}
{{- include "pdgate.loraCheck" . }}
{{- $l := .Values.lora }}
{{- $out := list }}
{{- range $l.adapters }}
{{- $a := dict "name" .name "path" (.path | default (printf "%s/%s" $l.mountPath .name)) "preload" (ne (toString .preload) "false") }}
{{- if .maxRank }}{{ $_ := set $a "maxRank" (int .maxRank) }}{{ end }}
{{- $out = append $out $a }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* vLLM --lora-modules items: name=path, or the JSON form where the path holds "=" or ","
(vLLM reads an item with "=" and no "," as name=path, anything else as JSON) */}}
{{- define "pdgate.loraModules" -}}
{{- $items := list }}
{{- range include "pdgate.loraAdapters" . | fromJsonArray }}
{{- if .preload }}
{{- if or (contains "=" .path) (contains "," .path) }}
{{- $items = append $items (toJson (dict "name" .name "path" .path)) }}
{{- else }}
{{- $items = append $items (printf "%s=%s" .name .path) }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $items }}
{{- end }}

{{/* vLLM's --shutdown-timeout for a pool ((list $ pool)): engines.shutdownTimeoutSeconds, or what the
grace period leaves after the preStop sleep and 15 s for the exit itself (never below 0). */}}
{{- define "pdgate.engineShutdownTimeout" -}}
{{- $ := index . 0 }}{{- $p := index $.Values (index . 1) }}{{- $e := $.Values.engines }}
{{- if kindIs "invalid" $e.shutdownTimeoutSeconds }}
{{- max 0 (sub (sub (int $p.terminationGracePeriodSeconds) (int $e.preStopSleepSeconds)) 15) }}
{{- else }}
{{- int $e.shutdownTimeoutSeconds }}
{{- end }}
{{- end }}

{{/* The compiled-kernel cache volume's source (engines.compileCache), or nothing with type none */}}
{{- define "pdgate.compileCacheVolume" -}}
{{- $c := .Values.engines.compileCache }}
{{- if eq $c.type "emptyDir" }}
emptyDir: {sizeLimit: {{ $c.sizeLimit }}}
{{- else if eq $c.type "hostPath" }}
hostPath: {path: {{ $c.path | quote }}, type: DirectoryOrCreate}
{{- else if eq $c.type "pvc" }}
{{- if not $c.claimName }}{{ fail "engines.compileCache.type pvc needs engines.compileCache.claimName" }}{{ end }}
persistentVolumeClaim: {claimName: {{ $c.claimName | quote }}}
{{- end }}
{{- end }}

{{/* The NLB's deregistration delay: gateway.service.awsHealthCheck.deregistrationDelaySeconds, or the
gateway's grace period (preStop sleep + 40 s of draining), so no stream is cut before the gateway ends it */}}
{{- define "pdgate.nlbDeregistrationDelay" -}}
{{- $d := .Values.gateway.service.awsHealthCheck.deregistrationDelaySeconds }}
{{- if kindIs "invalid" $d }}{{ add 40 (int .Values.gateway.preStopSleepSeconds) }}{{ else }}{{ int $d }}{{ end }}
{{- end }}

{{/* The chart's Envoy config: deploy/envoy/envoy-epp.yaml's (shipped in files/), with the picker's
Service as its ext_proc and access log target and the ORIGINAL_DST cluster as the route's: engines
come and go, and Envoy routes to the address the picker names. */}}
{{- define "pdgate.envoyConfig" -}}
{{- $cfg := .Files.Get "files/envoy-epp.yaml" | fromYaml }}
{{- $g := .Values.gateway }}
{{- $res := $cfg.static_resources }}
{{- $listener := index $res.listeners 0 }}
{{- $_ := set $listener.address.socket_address "port_value" (int $g.epp.envoy.port) }}
{{- $hcm := (index (index $listener.filter_chains 0).filters 0).typed_config }}
{{- $vhost := index $hcm.route_config.virtual_hosts 0 }}
{{- $routes := list }}
{{- range $route := $vhost.routes }}
{{- if eq $route.route.cluster "decode" }}
{{- $_ := set $route.route "cluster" "decode_by_address" }}
{{- $_ := unset $route.route "retry_policy" }}{{/* one address: nothing to retry on */}}
{{- $routes = append $routes $route }}
{{- else if and (eq $route.route.cluster "pdgate_relay") $g.epp.relay.enabled }}
{{- $routes = append $routes $route }}
{{- end }}
{{- end }}
{{- $_ := set $vhost "routes" $routes }}
{{- if not $g.epp.relay.enabled }}{{/* no relay: every request is the picker's to account for */}}
{{- range $log := $hcm.access_log }}{{ $_ := unset $log "filter" }}{{ end }}
{{- end }}
{{- $gateway := include "pdgate.componentName" (list . "gateway") }}
{{- $picker := printf "%s-picker.%s.svc.cluster.local" $gateway .Release.Namespace }}
{{- $clusters := list }}
{{- range $c := $res.clusters }}
{{- if and (eq $c.name "pdgate_relay") $g.epp.relay.enabled }}
{{- $_ := set $c "type" "STRICT_DNS" }}
{{- $relay := printf "%s.%s.svc.cluster.local" $gateway $.Release.Namespace }}
{{- $ep := dict "endpoint" (dict "address" (dict "socket_address" (dict "address" $relay "port_value" (int $g.service.port)))) }}
{{- $_ := set $c "load_assignment" (dict "cluster_name" "pdgate_relay" "endpoints" (list (dict "lb_endpoints" (list $ep)))) }}
{{- $clusters = append $clusters $c }}
{{- else if eq $c.name "pdgate_epp" }}
{{- $_ := set $c "type" "STRICT_DNS" }}
{{- $ep := dict "endpoint" (dict "address" (dict "socket_address" (dict "address" $picker "port_value" (int $g.epp.grpcPort)))) }}
{{- $_ := set $c "load_assignment" (dict "cluster_name" "pdgate_epp" "endpoints" (list (dict "lb_endpoints" (list $ep)))) }}
{{- $clusters = append $clusters $c }}
{{- else if eq $c.name "decode_by_address" }}
{{- $clusters = append $clusters $c }}
{{- end }}
{{- end }}
{{- $_ := set $res "clusters" $clusters }}
{{- $_ := set $cfg "admin" (dict "address" (dict "socket_address" (dict "address" "127.0.0.1" "port_value" 9901))) }}
{{- toYaml $cfg }}
{{- end }}
