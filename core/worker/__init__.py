"""The worker side of the kernel: model runners and what they hand to worker hooks."""
