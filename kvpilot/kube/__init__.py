"""Kubernetes helpers the parts share: credentials, a Service's ready endpoints, and which pods belong to a
fleet."""
