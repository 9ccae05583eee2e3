"""reward service: the bridge (rollouts topic -> scorer -> scored topic) and the Celery reward workers around the sandbox (see docs/ARCHITECTURE.md)."""
