"""Evaluation: the held-out runner, bootstrap statistics and the promotion gate."""
