{{/*
The engine pod, written once: (dict "root" $ "pool" "prefill" "role" ROLE) renders a PodTemplateSpec
(metadata + spec) for
  engine: one pod per engine (the pool's Deployment);
  leader: worker index 0 of a multi-node engine (LeaderWorkerSet): serves the API, probed;
  worker: the other pods of that engine: vLLM --headless, no API and so no HTTP probes.
*/}}
{{- define "pdgate.enginePodTemplate" -}}
{{- $ := .root }}
{{- $pool := .pool }}
{{- $role := .role }}
{{- $v := $.Values }}
{{- $e := $v.engines }}
{{- $p := index $v $pool }}
{{- $lmcache := include "pdgate.lmcacheOn" (list $ $pool) }}
{{- $api := ne $role "worker" }}
{{- $lora := $v.lora.enabled }}
{{- $loraSource := ternary (include "pdgate.loraSource" $) "" $lora }}
{{- $annotations := dict }}
{{- if $lmcache }}
{{- $_ := set $annotations "checksum/lmcache" (include "pdgate.lmcacheConfig" (list $ $pool) | sha256sum) }}
{{- end }}
{{- $annotations = mustMergeOverwrite $annotations (deepCopy ($p.podAnnotations | default dict)) }}
metadata:
  labels:
    {{- /* the selector labels last: podLabels cannot move a pod out of its pool (pdgate.validate) */}}
    {{- toYaml (mustMergeOverwrite (deepCopy ($p.podLabels | default dict)) (include "pdgate.selectorLabels" (list $ $pool) | fromYaml)) | nindent 4 }}
  {{- with $annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with (include "pdgate.engineServiceAccount" $) }}
  serviceAccountName: {{ . }}
  {{- end }}
  automountServiceAccountToken: {{ $e.serviceAccount.automountToken }}
  {{- with $e.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $p.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $p.schedulerName }}
  schedulerName: {{ . }}
  {{- end }}
  {{- with $p.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ $p.terminationGracePeriodSeconds }}
  {{- $preflight := include "pdgate.preflightInit" $ }}
  {{- if or $p.initContainers $preflight (eq $loraSource "s3") }}
  initContainers:
    {{- with $p.initContainers }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- if $preflight }}
    # Before vLLM loads the model: can this pod move KV at all? (preflight.initContainer)
    - name: preflight
      image: "{{ $e.image.repository }}:{{ $e.image.tag }}"
      imagePullPolicy: {{ $e.image.pullPolicy }}
      command: [python3, {{ include "pdgate.preflightScript" $ }}, check, --backend, {{ $preflight }}
        {{- if eq $preflight "LIBFABRIC" }}, --efa-devices, {{ $p.efaDevices | quote }}{{ end }}, --device, {{ $v.preflight.device }}]
      {{- with (include "pdgate.engineFabricEnv" (list $ $pool)) }}
      env:
        {{- . | trim | nindent 8 }}
      {{- end }}
      resources:
        {{- /* the same devices as vLLM: the device plugins hand the init container's devices on
        (a pod's effective request is the max of its init containers and the sum of the others) */}}
        {{- range $section := list "requests" "limits" }}
        {{- $r := deepCopy (index $v.preflight.resources $section | default dict) }}
        {{- $_ := set $r "nvidia.com/gpu" $p.gpus }}
        {{- include "pdgate.fabricResources" (list $ $pool $r) }}
        {{ $section }}:
          {{- toYaml $r | nindent 10 }}
        {{- end }}
      securityContext:
        {{- include "pdgate.engineSecurityContext" $ | trim | nindent 8 }}
      volumeMounts:
        {{- include "pdgate.engineFabricMounts" $ | trim | nindent 8 }}
    {{- end }}
    {{- if eq $loraSource "s3" }}
    {{- $s3 := $v.lora.source.s3 }}
    # The LoRA adapters: lora.source.s3.uri copied into the emptyDir vLLM loads them from
    # (credentials: the pod's ServiceAccount, IRSA or EKS Pod Identity)
    - name: lora-sync
      image: "{{ $s3.image.repository }}:{{ $s3.image.tag }}"
      imagePullPolicy: {{ $s3.image.pullPolicy }}
      command:
        {{- toYaml (concat (list "aws" "s3" "sync" $s3.uri $v.lora.mountPath "--no-progress") ($s3.extraArgs | default list)) | nindent 8 }}
      {{- with $s3.region }}
      env:
        - {name: AWS_REGION, value: {{ . | quote }}}
      {{- end }}
      {{- with $s3.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        allowPrivilegeEscalation: false
        capabilities: {drop: [ALL]}
      volumeMounts:
        - {name: lora-adapters, mountPath: {{ $v.lora.mountPath | quote }}}
    {{- end }}
  {{- end }}
  containers:
    - name: vllm
      image: "{{ $e.image.repository }}:{{ $e.image.tag }}"
      imagePullPolicy: {{ $e.image.pullPolicy }}
      command: [vllm, serve]
      args:
        - {{ $v.model.id | quote }}
        - --served-model-name
        - {{ $v.model.name | quote }}
        - --host
        - 0.0.0.0
        - --port
        - {{ $e.port | quote }}
        - --tensor-parallel-size
        - {{ $p.tensorParallelSize | quote }}
        {{- if or (gt (int $p.pipelineParallelSize) 1) $p.multiNode.enabled }}
        - --pipeline-parallel-size
        - {{ $p.pipelineParallelSize | quote }}
        {{- end }}
        - --max-model-len
        - {{ $v.model.maxModelLen | int | quote }}
        - --gpu-memory-utilization
        - {{ $p.gpuMemoryUtilization | toString | quote }}
        - --prefix-caching-hash-algo
        - {{ $e.prefixHashAlgo }}
        - --enable-prompt-tokens-details  # the gateway checks its prefix beliefs against usage's cached_tokens
        {{- with (include "pdgate.engineShutdownTimeout" (list $ $pool) | int) }}
        - --shutdown-timeout  # SIGTERM drains the requests in flight (engines.shutdownTimeoutSeconds)
        - {{ . | quote }}
        {{- end }}
        - --kv-transfer-config
        - {{ include "pdgate.kvTransferConfig" (list $ $pool) | squote }}
        {{- if $e.kvEvents.enabled }}
        - --kv-events-config
        - {{ include "pdgate.kvEventsConfig" $ | squote }}
        {{- end }}
        {{- with $v.model.loadFormat }}
        - --load-format
        - {{ . }}
        {{- end }}
        {{- if $lora }}
        {{- $l := $v.lora }}
        - --enable-lora
        - --max-loras
        - {{ $l.maxLoras | int | quote }}
        {{- if $l.maxCpuLoras }}
        - --max-cpu-loras
        - {{ $l.maxCpuLoras | int | quote }}
        {{- end }}
        - --max-lora-rank
        - {{ $l.maxLoraRank | int | quote }}
        {{- with include "pdgate.loraModules" $ | fromJsonArray }}
        - --lora-modules  # one flag, every item: vLLM keeps only the last --lora-modules
        {{- range . }}
        - {{ . | toJson }}
        {{- end }}
        {{- end }}
        {{- end }}
        {{- if $p.multiNode.enabled }}
        {{- /* vLLM's own multi-node launch (no Ray): every pod runs vllm serve with the same
        engine flags; LWS sets LWS_GROUP_SIZE and LWS_LEADER_ADDRESS, which Kubernetes expands in
        args; the node rank is the pod's worker-index label (LWS_WORKER_INDEX exists only from LWS
        0.6 on), read through the downward API */}}
        - --distributed-executor-backend
        - mp
        - --nnodes
        - $(LWS_GROUP_SIZE)
        - --node-rank
        - {{ ternary "0" "$(PDGATE_NODE_RANK)" (eq $role "leader") | quote }}
        - --master-addr
        - $(LWS_LEADER_ADDRESS)
        - --master-port
        - {{ $p.multiNode.masterPort | quote }}
        {{- if eq $role "worker" }}
        - --headless
        {{- end }}
        {{- end }}
        {{- range $p.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      ports:
        {{- if $api }}
        - {name: http, containerPort: {{ $e.port }}, protocol: TCP}
        {{- end }}
        - {name: nixl, containerPort: {{ $v.nixl.sideChannelPort }}, protocol: TCP}
        {{- if and $api $e.kvEvents.enabled }}
        - {name: kv-events, containerPort: {{ $e.kvEvents.port }}, protocol: TCP}
        - {name: kv-replay, containerPort: {{ $e.kvEvents.replayPort }}, protocol: TCP}
        {{- end }}
      env:
        - {name: PYTHONHASHSEED, value: {{ $e.pythonHashSeed | quote }}}
        - {name: HF_HOME, value: /models/huggingface}
        {{- if ne $e.compileCache.type "none" }}
        {{- /* every kernel cache on one volume (engines.compileCache): a restart does not recompile */}}
        - {name: VLLM_CACHE_ROOT, value: /compile-cache/vllm}
        - {name: TRITON_CACHE_DIR, value: /compile-cache/triton}
        - {name: TORCHINDUCTOR_CACHE_DIR, value: /compile-cache/inductor}
        - {name: CUDA_CACHE_PATH, value: /compile-cache/nv}  # the driver's PTX JIT cache
        - {name: FLASHINFER_WORKSPACE_BASE, value: /compile-cache}
        {{- end }}
        - name: VLLM_NIXL_SIDE_CHANNEL_HOST  # the decode engine pulls KV from this address
          valueFrom: {fieldRef: {fieldPath: status.podIP}}
        - {name: VLLM_NIXL_SIDE_CHANNEL_PORT, value: {{ $v.nixl.sideChannelPort | quote }}}
        {{- if and $p.multiNode.enabled (eq $role "worker") }}
        - name: PDGATE_NODE_RANK  # --node-rank (any LWS version)
          valueFrom: {fieldRef: {fieldPath: "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"}}
        {{- end }}
        {{- if $v.model.hfTokenSecret }}
        - name: HF_TOKEN
          valueFrom: {secretKeyRef: {name: {{ $v.model.hfTokenSecret }}, key: HF_TOKEN}}
        {{- end }}
        {{- if hasPrefix "runai_streamer" $v.model.loadFormat }}
        - {name: RUNAI_STREAMER_CONCURRENCY, value: {{ $v.model.streamer.concurrency | quote }}}
        {{- with $v.model.streamer.memoryLimit }}
        - {name: RUNAI_STREAMER_MEMORY_LIMIT, value: {{ . | toString | quote }}}
        {{- end }}
        {{- end }}
        {{- if $lmcache }}
        - {name: LMCACHE_CONFIG_FILE, value: /etc/lmcache/{{ $pool }}.yaml}
        - {name: LMCACHE_TRACK_USAGE, value: "false"}
        {{- with $v.lmcache.l2 }}
        {{- if and .enabled .urlSecret.name }}
        - name: LMCACHE_REMOTE_URL  # LMCache applies LMCACHE_* variables over its config file
          valueFrom: {secretKeyRef: {name: {{ .urlSecret.name }}, key: {{ .urlSecret.key }}}}
        {{- end }}
        {{- end }}
        {{- end }}
        {{- if and $lora $v.lora.dynamicLoading }}
        - {name: VLLM_ALLOW_RUNTIME_LORA_UPDATING, value: "1"}  # /v1/load_lora_adapter (lora.dynamicLoading)
        {{- end }}
        {{- include "pdgate.engineFabricEnv" (list $ $pool) | trim | nindent 8 }}
      resources:
        {{- range $section := list "requests" "limits" }}
        {{- $r := deepCopy (index $p.resources $section | default dict) }}
        {{- $_ := set $r "nvidia.com/gpu" $p.gpus }}
        {{- include "pdgate.fabricResources" (list $ $pool $r) }}
        {{- if and (eq $section "requests") (not (hasKey $r "ephemeral-storage")) }}
        {{- /* the model cache (and the adapters copied from S3) live on the node's disk: let the scheduler count them */}}
        {{- $disk := list }}
        {{- if eq $v.model.cache.type "emptyDir" }}{{ $disk = append $disk $v.model.cache.sizeLimit }}{{ end }}
        {{- if eq $e.compileCache.type "emptyDir" }}{{ $disk = append $disk $e.compileCache.sizeLimit }}{{ end }}
        {{- if eq $loraSource "s3" }}{{ $disk = append $disk $v.lora.source.s3.sizeLimit }}{{ end }}
        {{- if eq (len $disk) 1 }}
        {{- $_ := set $r "ephemeral-storage" (first $disk) }}
        {{- else if $disk }}
        {{- $mi := 0.0 }}
        {{- range $disk }}{{ $mi = addf $mi (mulf (include "pdgate.gib" . | float64) 1024) }}{{ end }}
        {{- $mi = ceil $mi | int }}
        {{- $_ := set $r "ephemeral-storage" (ternary (printf "%dGi" (div $mi 1024)) (printf "%dMi" $mi) (eq (mod $mi 1024) 0)) }}
        {{- end }}
        {{- end }}
        {{ $section }}:
          {{- toYaml $r | nindent 10 }}
        {{- end }}
      securityContext:
        {{- include "pdgate.engineSecurityContext" $ | trim | nindent 8 }}
      {{- if and $api $e.preStopSleepSeconds }}
      lifecycle:
        # Keep serving while the pod's removal from the EndpointSlice reaches the gateway's
        # watch; vLLM gets SIGTERM only after this (inside terminationGracePeriodSeconds).
        preStop:
          exec: {command: [sleep, {{ $e.preStopSleepSeconds | quote }}]}
      {{- end }}
      {{- if $api }}
      startupProbe:
        httpGet: {path: /health, port: http}
        periodSeconds: 10
        failureThreshold: {{ div (int $p.startupTimeoutSeconds) 10 }}
      readinessProbe:
        httpGet: {path: /health, port: http}
        {{- toYaml $e.probes.readiness | nindent 8 }}
      livenessProbe:
        httpGet: {path: /health, port: http}
        {{- toYaml $e.probes.liveness | nindent 8 }}
      {{- end }}
      volumeMounts:
        - {name: dshm, mountPath: /dev/shm}
        - {name: models, mountPath: /models}
        {{- if ne $e.compileCache.type "none" }}
        - {name: compile-cache, mountPath: /compile-cache}
        {{- end }}
        {{- if $lmcache }}
        - {name: lmcache, mountPath: /etc/lmcache, readOnly: true}
        {{- end }}
        {{- if $loraSource }}
        - name: lora-adapters
          mountPath: {{ $v.lora.mountPath | quote }}
          readOnly: true
          {{- if and (eq $loraSource "pvc") $v.lora.source.pvc.subPath }}
          subPath: {{ $v.lora.source.pvc.subPath | quote }}
          {{- end }}
        {{- end }}
        {{- include "pdgate.engineFabricMounts" $ | trim | nindent 8 }}
        {{- with $p.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: dshm
      emptyDir: {medium: Memory, sizeLimit: {{ $p.shmSize }}}
    - name: models
      {{- include "pdgate.modelCacheVolume" $ | trim | nindent 6 }}
    {{- if ne $e.compileCache.type "none" }}
    - name: compile-cache
      {{- include "pdgate.compileCacheVolume" $ | trim | nindent 6 }}
    {{- end }}
    {{- if $lmcache }}
    - name: lmcache
      configMap:
        name: {{ include "pdgate.componentName" (list $ "lmcache") }}
    {{- end }}
    {{- if and $v.efa.enabled $v.efa.hugepages2Mi }}
    - name: hugepages
      emptyDir: {medium: HugePages-2Mi}
    {{- end }}
    {{- if $v.preflight.enabled }}
    - name: preflight
      configMap:
        name: {{ include "pdgate.componentName" (list $ "preflight") }}
        defaultMode: 0444
    {{- end }}
    {{- if eq $loraSource "pvc" }}
    - name: lora-adapters
      persistentVolumeClaim: {claimName: {{ $v.lora.source.pvc.claimName | quote }}, readOnly: true}
    {{- else if eq $loraSource "s3" }}
    - name: lora-adapters  # filled by the lora-sync init container
      emptyDir: {sizeLimit: {{ $v.lora.source.s3.sizeLimit }}}
    {{- end }}
    {{- with $p.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $nodeSelector := mustMergeOverwrite (deepCopy ($v.placement.nodeSelector | default dict)) (deepCopy ($p.nodeSelector | default dict)) }}
  {{- with $nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $p.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (include "pdgate.engineAffinity" (list $ $pool) | fromYaml) }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $p.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* The engines' ServiceAccount name; "" when the pods use the namespace's default */}}
{{- define "pdgate.engineServiceAccount" -}}
{{- $sa := .Values.engines.serviceAccount }}
{{- if $sa.name }}{{ $sa.name }}
{{- else if $sa.create }}{{ include "pdgate.componentName" (list . "engines") }}
{{- end }}
{{- end }}

{{/* The model cache volume's source (HF_HOME lives in it) */}}
{{- define "pdgate.modelCacheVolume" -}}
{{- $c := .Values.model.cache }}
{{- if eq $c.type "hostPath" }}
hostPath: {path: {{ $c.hostPath }}, type: DirectoryOrCreate}
{{- else if eq $c.type "pvc" }}
persistentVolumeClaim: {claimName: {{ $c.claimName }}}
{{- else }}
emptyDir: {sizeLimit: {{ $c.sizeLimit }}}
{{- end }}
{{- end }}

{{/* The fabric's environment for pool (list $ "prefill"), shared by vLLM and the preflight check */}}
{{- define "pdgate.engineFabricEnv" -}}
{{- $ := index . 0 }}
{{- $v := $.Values }}
{{- $p := index $v (index . 1) }}
{{- $env := concat ($v.nixl.env | default list) }}
{{- if $v.efa.enabled }}
{{- $env = concat $env $v.efa.env }}
{{- if not $v.efa.hugepages2Mi }}
{{- /* no hugetlb allowance in the pod: libfabric must not map huge pages (SIGBUS otherwise) */}}
{{- $named := list }}
{{- range concat $env ($v.engines.extraEnv | default list) ($p.extraEnv | default list) }}
{{- $named = append $named .name }}
{{- end }}
{{- if not (has "FI_EFA_USE_HUGE_PAGE" $named) }}
{{- $env = append $env (dict "name" "FI_EFA_USE_HUGE_PAGE" "value" "0") }}
{{- end }}
{{- end }}
{{- end }}
{{- $env = concat $env ($v.engines.extraEnv | default list) ($p.extraEnv | default list) }}
{{- if $env }}
{{- toYaml $env }}
{{- end }}
{{- end }}

{{/* Adds EFA devices and huge pages to resources dict (list $ "prefill" $r) */}}
{{- define "pdgate.fabricResources" -}}
{{- $ := index . 0 }}
{{- $v := $.Values }}
{{- $p := index $v (index . 1) }}
{{- $r := index . 2 }}
{{- if and $v.efa.enabled $p.efaDevices }}
{{- $_ := set $r "vpc.amazonaws.com/efa" $p.efaDevices }}
{{- end }}
{{- if and $v.efa.enabled $v.efa.hugepages2Mi }}
{{- $_ := set $r "hugepages-2Mi" $v.efa.hugepages2Mi }}
{{- end }}
{{- end }}

{{- define "pdgate.engineSecurityContext" -}}
allowPrivilegeEscalation: false  # no setuid gains; added capabilities still apply
{{- if .Values.efa.enabled }}
capabilities: {add: [IPC_LOCK]}  # RDMA registers (pins) memory
{{- end }}
{{- end }}

{{/* Mounts vLLM and the preflight check share: huge pages, the preflight script */}}
{{- define "pdgate.engineFabricMounts" -}}
{{- if and .Values.efa.enabled .Values.efa.hugepages2Mi }}
- {name: hugepages, mountPath: /dev/hugepages}
{{- end }}
{{- if .Values.preflight.enabled }}
- {name: preflight, mountPath: /opt/pdgate/preflight, readOnly: true}
{{- end }}
{{- end }}

{{- define "pdgate.preflightScript" -}}/opt/pdgate/preflight/preflight.py{{- end }}

{{/* The NIXL backend the preflight checks (the pools' first), "" when there is no check */}}
{{- define "pdgate.preflightBackend" -}}
{{- first (include "pdgate.nixlBackends" . | fromJsonArray) }}
{{- end }}

{{/* The init container's backend: LIBFABRIC with EFA, UCX only with initContainer always */}}
{{- define "pdgate.preflightInit" -}}
{{- $pf := .Values.preflight }}
{{- if and $pf.enabled (ne $pf.initContainer "never") }}
{{- if .Values.efa.enabled }}LIBFABRIC
{{- else if eq $pf.initContainer "always" }}{{ include "pdgate.preflightBackend" . }}
{{- end }}
{{- end }}
{{- end }}

{{/* The pool's affinity (list $ "prefill"): <pool>.affinity, with placement.zone required on every
node selector term (terms are ORed: the zone must be in each of them) */}}
{{- define "pdgate.engineAffinity" -}}
{{- $ := index . 0 }}
{{- $p := index $.Values (index . 1) }}
{{- $a := deepCopy ($p.affinity | default dict) }}
{{- with $.Values.placement.zone }}
{{- $zone := dict "key" "topology.kubernetes.io/zone" "operator" "In" "values" (list .) }}
{{- $na := $a.nodeAffinity | default dict }}
{{- $req := index $na "requiredDuringSchedulingIgnoredDuringExecution" | default dict }}
{{- $terms := list }}
{{- range $req.nodeSelectorTerms | default list }}
{{- $t := deepCopy . }}
{{- $_ := set $t "matchExpressions" (append ($t.matchExpressions | default list) $zone) }}
{{- $terms = append $terms $t }}
{{- end }}
{{- if not $terms }}
{{- $terms = list (dict "matchExpressions" (list $zone)) }}
{{- end }}
{{- $_ := set $req "nodeSelectorTerms" $terms }}
{{- $_ := set $na "requiredDuringSchedulingIgnoredDuringExecution" $req }}
{{- $_ := set $a "nodeAffinity" $na }}
{{- end }}
{{- if $a }}
{{- toYaml $a }}
{{- end }}
{{- end }}
