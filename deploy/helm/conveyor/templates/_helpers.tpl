{{/* The prefix of every resource name: fullnameOverride, else the release's name. Helm keeps release
names unique in a namespace, so two releases never render the same name. At most 40 characters:
"<prefix>-rollout-worker" and the learner StatefulSet's pods stay within Kubernetes' limits. */}}
{{- define "conveyor.fullname" -}}
{{- $name := .Values.fullnameOverride | default .Release.Name -}}
{{- if gt (len $name) 40 -}}
{{- fail (printf "the release name (or fullnameOverride) %q is longer than 40 characters: the names of its resources would be too long for Kubernetes" $name) -}}
{{- end -}}
{{- $name -}}
{{- end }}

{{/* A resource's name: (dict "root" $ "component" <name>). */}}
{{- define "conveyor.name" -}}
{{- printf "%s-%s" (include "conveyor.fullname" .root) .component -}}
{{- end }}

{{/* The labels of every pod (and the selector) of this release. */}}
{{- define "conveyor.releaseLabels" -}}
app.kubernetes.io/name: conveyor
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The labels of one component: (dict "root" $ "component" <name>). Also the selectors. */}}
{{- define "conveyor.labels" -}}
{{ include "conveyor.releaseLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The run's id: run.run_id, or the release's name. */}}
{{- define "conveyor.runId" -}}
{{- .Values.run.run_id | default .Release.Name -}}
{{- end }}

{{/* The run config of the ConfigMap: `run` with its run_id and metrics.port filled in, after the
checks of the values that cannot work in a cluster. */}}
{{- define "conveyor.runConfig" -}}
{{- $run := deepCopy .Values.run -}}
{{- $port := required "metricsPort is required: every role serves /metrics there and the probes use it" .Values.metricsPort -}}
{{- $metrics := $run.metrics | default dict -}}
{{- if and $metrics.port (ne (int $metrics.port) (int $port)) -}}
{{- fail (printf "run.metrics.port (%v) differs from metricsPort (%v): set metricsPort only" $metrics.port $port) -}}
{{- end -}}
{{- $_ := set $metrics "port" (int $port) -}}
{{- $_ := set $run "metrics" $metrics -}}
{{- $_ := set $run "run_id" (include "conveyor.runId" .) -}}
{{- $producer := $run.producer | default dict -}}
{{- if has ($producer.http_host | default "127.0.0.1") (list "127.0.0.1" "localhost" "::1") -}}
{{- fail "run.producer.http_host listens on loopback only: the producer's Service and probes could not reach it (use 0.0.0.0)" -}}
{{- end -}}
{{- toYaml $run -}}
{{- end }}

{{/* The default S3 Secret's name: s3.existingSecret, or <release>-s3 rendered from s3.accessKeyId and
s3.secretAccessKey. With neither (or a placeholder key), rendering fails: the chart has no default
credentials. */}}
{{- define "conveyor.defaultS3Secret" -}}
{{- $s3 := .Values.s3 -}}
{{- $keys := or $s3.accessKeyId $s3.secretAccessKey -}}
{{- if or (eq ($s3.accessKeyId | toString) "change-me") (eq ($s3.secretAccessKey | toString) "change-me") -}}
{{- fail "s3: \"change-me\" is a placeholder, not a key: set s3.existingSecret to a Secret you created (see values.yaml)" -}}
{{- end -}}
{{- if and $s3.existingSecret $keys -}}
{{- fail "s3: set either s3.existingSecret or s3.accessKeyId/s3.secretAccessKey, not both" -}}
{{- else if $s3.existingSecret -}}
{{- $s3.existingSecret -}}
{{- else if and $s3.accessKeyId $s3.secretAccessKey -}}
{{- include "conveyor.name" (dict "root" . "component" "s3") -}}
{{- else if $keys -}}
{{- fail "s3: give both s3.accessKeyId and s3.secretAccessKey (or s3.existingSecret)" -}}
{{- else -}}
{{- fail (printf "s3: no credentials, and the chart has no default keys. Create a Secret (kubectl -n %s create secret generic conveyor-s3 --from-literal=CONVEYOR_OBJECT_STORE__ACCESS_KEY_ID=... --from-literal=CONVEYOR_OBJECT_STORE__SECRET_ACCESS_KEY=...) and set s3.existingSecret=conveyor-s3, or name one Secret per role in s3.secrets" .Release.Namespace) -}}
{{- end -}}
{{- end }}

{{/* Whether a role with an empty s3.secrets entry needs the default Secret: "true" or "". */}}
{{- define "conveyor.usesDefaultS3Secret" -}}
{{- range $role, $secret := .Values.s3.secrets -}}
{{- if not $secret }}true{{ end -}}
{{- end -}}
{{- end }}

{{/* The S3 Secret of a role: (dict "root" $ "name" <role>); empty when the role gets no keys. */}}
{{- define "conveyor.s3Secret" -}}
{{- $root := .root -}}
{{- $secrets := $root.Values.s3.secrets | default dict -}}
{{- range $role, $_ := $secrets -}}
{{- if not (hasKey $root.Values.roles $role) -}}
{{- fail (printf "s3.secrets.%s: no such role (one of %s)" $role (keys $root.Values.roles | sortAlpha | join ", ")) -}}
{{- end -}}
{{- end -}}
{{- if hasKey $secrets .name -}}
{{- $own := index $secrets .name -}}
{{- if $own }}{{ $own }}{{ else }}{{ include "conveyor.defaultS3Secret" $root }}{{ end -}}
{{- end -}}
{{- end }}

{{/* Arguments of `conveyor serve <role>` after the role's name. */}}
{{- define "conveyor.roleArgs" -}}
{{- if eq . "rollout-worker" }}
- --model
- /models/policy
{{- else if eq . "reward-bridge" }}
- --tokenizer
- /models/policy
{{- else if eq . "learner" }}
- --model
- /models/policy
- --run-dir
- /var/lib/conveyor/run
{{- end }}
- --config
- /etc/conveyor/run.yaml
{{- end }}

{{/* The probes of a role: (dict "root" $ "name" <role> "role" <values of the role>).
The producer answers GET /healthz on its HTTP port (from its event loop: a wedged loop fails it).
Every other role binds metricsPort as it starts, before loading models or joining consumer groups:
readiness asks /metrics, liveness only opens a TCP connection, which the kernel accepts even while
the process holds the GIL for a long step (a checkpoint), so a busy learner is never killed. */}}
{{- define "conveyor.probes" -}}
{{- $startup := int (.role.startupSeconds | default 120) }}
{{- if eq .name "producer" }}
startupProbe:
  httpGet:
    path: /healthz
    port: http
  periodSeconds: 10
  failureThreshold: {{ max 1 (div (add $startup 9) 10) }}
readinessProbe:
  httpGet:
    path: /healthz
    port: http
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
livenessProbe:
  httpGet:
    path: /healthz
    port: http
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 6
{{- else }}
startupProbe:
  tcpSocket:
    port: metrics
  periodSeconds: 10
  failureThreshold: {{ max 1 (div (add $startup 9) 10) }}
readinessProbe:
  httpGet:
    path: /metrics
    port: metrics
  periodSeconds: 15
  timeoutSeconds: 10
  failureThreshold: 4
livenessProbe:
  tcpSocket:
    port: metrics
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}
{{- end }}

{{/* The pod template of a role: (dict "root" $ "name" <role> "role" <values of the role>). */}}
{{- define "conveyor.podTemplate" -}}
{{- $root := .root }}
{{- $name := .name }}
{{- $role := .role }}
{{- $gpus := int ($role.gpus | default 0) }}
{{- $s3Secret := include "conveyor.s3Secret" (dict "root" $root "name" $name) }}
metadata:
  labels:
    {{- include "conveyor.labels" (dict "root" $root "component" $name) | nindent 4 }}
spec:
  containers:
  - name: {{ $name }}
    image: {{ printf "%s:%s" $root.Values.image.repository $root.Values.image.tag }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    {{- if eq $name "learner" }}
    # One rank per GPU (FSDP2): rank 0 consumes, publishes and checkpoints; SIGTERM makes it
    # checkpoint with every rank and exit.
    command:
    - torchrun
    - --nproc-per-node={{ max 1 $gpus }}
    - -m
    - launch.cli.main
    {{- end }}
    args:
    - serve
    - {{ $name }}
    {{- include "conveyor.roleArgs" $name | trim | nindent 4 }}
    {{- if or $s3Secret (eq $name "producer") }}
    envFrom:
    {{- if $s3Secret }}
    # This role's S3 keys (s3.secrets).
    - secretRef:
        name: {{ $s3Secret }}
    {{- end }}
    {{- if eq $name "producer" }}
    # The HTTP API's bearer tokens (CONVEYOR_API_TOKENS): the producer refuses to serve beyond
    # loopback without them. Create the Secret yourself (docs/OPERATIONS.md); it is never rendered.
    - secretRef:
        name: {{ $root.Values.api.tokensSecret }}
    {{- end }}
    {{- end }}
    ports:
    - name: metrics
      containerPort: {{ $root.Values.metricsPort }}
    {{- if eq $name "producer" }}
    - name: http
      containerPort: {{ $root.Values.run.producer.http_port | default 8600 }}
    {{- end }}
    {{- include "conveyor.probes" . | trim | nindent 4 }}
    volumeMounts:
    - name: run
      mountPath: /etc/conveyor
      readOnly: true
    - name: models
      mountPath: /models
      readOnly: true
    {{- if eq $name "learner" }}
    - name: scratch
      mountPath: /var/lib/conveyor
    {{- end }}
    resources:
      requests:
        {{- toYaml $role.resources.requests | nindent 8 }}
        {{- if gt $gpus 0 }}
        nvidia.com/gpu: {{ $gpus | quote }}
        {{- end }}
      limits:
        {{- toYaml $role.resources.limits | nindent 8 }}
        {{- if gt $gpus 0 }}
        nvidia.com/gpu: {{ $gpus | quote }}
        {{- end }}
    securityContext:
      runAsNonRoot: true
      runAsUser: 10001
      allowPrivilegeEscalation: false
      capabilities:
        drop:
        - ALL
      {{- if eq $name "reward-worker" }}
      # The sandbox creates user, mount and pid namespaces and loads its own seccomp filter
      # (docs/OPERATIONS.md): the runtime's default profiles forbid both.
      seccompProfile:
        type: Unconfined
      appArmorProfile:
        type: Unconfined
      readOnlyRootFilesystem: false
      {{- else }}
      seccompProfile:
        type: RuntimeDefault
      {{- end }}
  terminationGracePeriodSeconds: {{ $root.Values.terminationGracePeriodSeconds }}
  volumes:
  - name: run
    configMap:
      name: {{ include "conveyor.name" (dict "root" $root "component" "run") }}
  - name: models
    persistentVolumeClaim:
      claimName: {{ include "conveyor.modelsClaim" $root }}
      readOnly: true
  {{- if gt $gpus 0 }}
  tolerations:
  - key: nvidia.com/gpu
    operator: Exists
    effect: NoSchedule
  {{- end }}
{{- end }}

{{/* The models volume claim: models.claimName, or <release>-models. */}}
{{- define "conveyor.modelsClaim" -}}
{{- .Values.models.claimName | default (include "conveyor.name" (dict "root" . "component" "models")) -}}
{{- end }}
