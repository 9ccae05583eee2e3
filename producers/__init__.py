"""producers service: tasks from the built-in suites, files and HTTP onto the tasks topic, within the admission credits (see docs/ARCHITECTURE.md)."""
