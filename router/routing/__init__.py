"""Where a request goes: its prompt's token ids (exactly as the daemon tokenizes them), the weight version it
may use, and the policy that picks the pod."""
