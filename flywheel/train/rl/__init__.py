"""Reinforcement learning for the student with asynchronous rollouts.

source (work per step) -> actor (processes) -> buffer (bounded, staleness-checked) -> learner (loss, step) ->
weights (published to the actors); generation.py holds the two ways steps are generated (actor processes, or in
the learner's process with `actors: 0`) and the kept versions; loop.train_rl runs them; checkpoints make a killed
run resumable.
"""
