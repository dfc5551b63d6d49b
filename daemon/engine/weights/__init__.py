"""The engine's weights and adapters: the weight update (operations, staging copy, swap, torch.distributed
transports) and LoRA adapters."""
