"""Prefill/decode disaggregation: the KV a prefill pod holds for a decode pod, the TCP transfer between
them, and the `kv_transfer_params` both speak (docs/disaggregation.md)."""
