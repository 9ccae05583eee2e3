"""rollout_workers service: tasks topic -> engine (vLLM or the reference engine) -> rollouts topic, following the published weights (see docs/ARCHITECTURE.md)."""
