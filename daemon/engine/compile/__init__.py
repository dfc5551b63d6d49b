"""A compiled engine step (`-O` / `--compilation-config`, `--enforce-eager`): config.py reads the flags,
forward.py runs the model's forward under torch.compile, and on CUDA as CUDA graphs (docs/engine.md)."""
