"""producers service (see docs/ARCHITECTURE.md). Not built yet: its issue is open."""
