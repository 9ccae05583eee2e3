#!/usr/bin/env bash
# Renders the Helm chart's defaults into deploy/k8s/conveyor.yaml, the plain manifests for
# `kubectl apply -f deploy/k8s/` (the Namespace included). tests/unit/test_helm_chart.py fails
# when the two drift apart: edit the chart, then run this. The chart has no default S3 keys: the
# render names the Secret conveyor-s3, which the operator creates (deploy/helm/conveyor/values.yaml,
# `s3`), as they create conveyor-api (`api.tokensSecret`).
set -euo pipefail
cd "$(dirname "$0")/.."
HELM="$(command -v helm || echo .tools/bin/helm)"
{
  echo "# Rendered from deploy/helm/conveyor by deploy/render-k8s.sh: edit the chart, not this file."
  "$HELM" template conveyor deploy/helm/conveyor --namespace conveyor --set createNamespace=true \
    --set s3.existingSecret=conveyor-s3
} > deploy/k8s/conveyor.yaml
