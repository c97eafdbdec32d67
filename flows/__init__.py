"""Prefect flows: retrain (the main job) chains the stages in tasks/."""
