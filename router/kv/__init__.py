"""What the pods cache, as the router knows it: the prefix index, each pod's KV event stream and what the pod
says of it, the weight versions and LoRA adapters its block keys are hashed with."""
