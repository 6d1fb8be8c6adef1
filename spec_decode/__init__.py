"""Speculative decoding plugins: drafters and rejection sampling."""
