"""The weights' HTTP side: vLLM's RL control plane and SGLang's update route, the LoRA adapter routes, and the
weight update metrics."""
