"""Bundled policy plugins: schedulers and samplers, loaded by name like any third-party plugin."""
