"""The RL math: the freshness rule (staleness.py), advantages (advantages.py), losses (losses.py),
process-reward steps (steps.py) and deterministic kernels (determinism.py).
"""
