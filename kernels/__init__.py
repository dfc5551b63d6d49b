"""Kernels: triton on GPU, torch reference on CPU, behind one dispatch point (`select_ops`)."""

from kvpilot.kernels.metadata import AttentionMetadata
from kvpilot.kernels.ops import Ops, select_ops

__all__ = ["AttentionMetadata", "Ops", "select_ops"]
