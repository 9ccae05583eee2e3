{{- define "conveyor.labels" -}}
app.kubernetes.io/name: conveyor
app.kubernetes.io/component: {{ . }}
{{- end }}

{{- define "conveyor.s3Secret" -}}
{{ .Values.s3.existingSecret | default "conveyor-s3" }}
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

{{/* The pod template of a role: (dict "root" $ "name" <role> "role" <values of the role>). */}}
{{- define "conveyor.podTemplate" -}}
{{- $root := .root }}
{{- $name := .name }}
{{- $role := .role }}
{{- $gpus := int ($role.gpus | default 0) }}
metadata:
  labels:
    {{- include "conveyor.labels" $name | nindent 4 }}
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
    {{- include "conveyor.roleArgs" $name | nindent 4 }}
    envFrom:
    - secretRef:
        name: {{ include "conveyor.s3Secret" $root }}
    {{- if eq $name "producer" }}
    # The HTTP API's bearer tokens (CONVEYOR_API_TOKENS): the producer refuses to serve beyond
    # loopback without them. Create the Secret yourself (docs/OPERATIONS.md); it is never rendered.
    - secretRef:
        name: {{ $root.Values.api.tokensSecret }}
    {{- end }}
    ports:
    - name: metrics
      containerPort: {{ $root.Values.metricsPort }}
    {{- if eq $name "producer" }}
    - name: http
      containerPort: {{ $root.Values.run.producer.http_port | default 8600 }}
    {{- end }}
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
      name: conveyor-run
  - name: models
    persistentVolumeClaim:
      claimName: {{ $root.Values.models.claimName }}
      readOnly: true
  {{- if gt $gpus 0 }}
  tolerations:
  - key: nvidia.com/gpu
    operator: Exists
    effect: NoSchedule
  {{- end }}
{{- end }}
