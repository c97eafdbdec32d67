"""Datasets between stages: schemas, where each table and model lives, content hashes, DVC."""
