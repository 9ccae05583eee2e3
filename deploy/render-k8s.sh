#!/usr/bin/env bash
# Renders the Helm chart's defaults into deploy/k8s/conveyor.yaml, the plain manifests for
# `kubectl apply -f deploy/k8s/` (the Namespace included). tests/unit/test_helm_chart.py fails
# when the two drift apart: edit the chart, then run this.
set -euo pipefail
cd "$(dirname "$0")/.."
HELM="$(command -v helm || echo .tools/bin/helm)"
{
  echo "# Rendered from deploy/helm/conveyor by deploy/render-k8s.sh: edit the chart, not this file."
  "$HELM" template conveyor deploy/helm/conveyor --namespace conveyor --set createNamespace=true
} > deploy/k8s/conveyor.yaml
