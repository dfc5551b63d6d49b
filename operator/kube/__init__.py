"""The operator's Kubernetes plumbing: API calls, conditions, ownership checks and retries."""
