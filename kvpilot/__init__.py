"""kvpilot: LLM inference fleets on Kubernetes with control over their KV prefix caches."""

__version__ = "0.1.0"
