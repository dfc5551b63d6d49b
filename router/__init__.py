"""The fleet router: OpenAI reverse proxy, prefix-aware routing from KV events, fleet-wide reset."""
