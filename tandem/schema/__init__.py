"""The bottom layer: the config schema, `SamplingParams`, request checks and output types.

Every other package may import it; it imports nothing of tandem above it (no kernel, model,
plugin or front-door module), so a config or a request can be built and checked without
loading an engine.
"""
