"""The `kvpilot` command line: the dispatcher, the flags generated from settings dataclasses, and `kvpilot
bench` with its load generator."""
