"""WeightUpdate: a fleet's weights (or one LoRA adapter) to new files on every pod or none, its status and
CLI, fencing of pods off the fleet's weights and their catch-up."""
