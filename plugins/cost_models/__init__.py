"""Cost models of the simulated device (`step_cost` hook): how long one engine step takes.

`shapes` holds the data (model shapes from HF configs, device specs); `roofline` the analytic
model over them and its plugin (`roofline-cost`).
"""
