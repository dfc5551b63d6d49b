"""The engine's KV cache: the block pool and its prefix index, the cache manager between scheduler and pool,
cache scopes, the offload tiers (host memory, disk) and the KV events recorded and published."""
