"""InferenceDeployment: the fleet's desired objects (workload, Service, router, network policy,
InferencePool), their reconciliation, and the fleet's pods as targets of a run."""
