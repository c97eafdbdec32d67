"""Serving closes the loop: the registered student as an MLflow model, an OpenAI-compatible server for the
version behind an alias, and what it answers recorded as traces that `collect` reads.

- chat.py: one chat request checked and answered (OpenAI chat.completions in and out), used by both below
- mlflow_model.py: the pyfunc chat model the register stage logs (`mlflow.pyfunc.load_model`, `mlflow models serve`)
- traffic.py: answered requests written as JSON Lines in the proxy-log shape collect reads; labels from feedback
- batching.py: concurrent requests to one model gathered into shared generate calls (max_batch, window)
- server.py: `flywheel serve-model`: /v1/chat/completions, /v1/models, /health, /v1/feedback; follows the alias
- loop.py: `flywheel loop`: retrain, serve the champion, drive the environment's agent against it, collect, again
"""
