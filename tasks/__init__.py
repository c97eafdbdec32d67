"""The stages: each module holds the one @task that IS the stage; `flywheel stage NAME` runs its .fn directly."""
