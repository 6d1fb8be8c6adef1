"""Prefill/decode disaggregation: the `kv-disagg` connector and its block transport."""
