"""Reinforcement learning for the student with asynchronous rollouts.

source (work per step) -> actor (processes) -> buffer (bounded, staleness-checked) -> learner (loss, step) ->
weights (published to the actors); loop.train_rl runs them; checkpoints make a killed run resumable.
"""
