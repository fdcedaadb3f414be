"""Value-based agents (DQN, C51) for numeric environments: networks, targets, replay, agents.

The pure core the value learner service and the numeric actors are built on: the
steps table (``schemas.steps``) is the only input, tensors are the only output
(safetensors-compatible state dicts), and nothing here does I/O.
"""
