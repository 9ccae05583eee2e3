"""Built-in task suites (written for this project; nothing is downloaded)."""
