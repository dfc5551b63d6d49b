"""A real Kubernetes control plane and a local node agent for tests and demos."""
