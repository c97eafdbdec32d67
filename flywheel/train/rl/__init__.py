"""Reinforcement learning for the student: group advantages, the clipped policy loss and the training loop."""
