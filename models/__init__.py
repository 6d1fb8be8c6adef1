"""Model definitions, layers, attention, compiled CPU kernels and model loaders.

The kernel never imports this package: a model is reached through the loader that claims it
(entry-point group `tandem.model_loaders`), and the runner it needs is what that loader
declares. Models may import the kernel's worker-side interfaces (`tandem.core.worker`).
"""
