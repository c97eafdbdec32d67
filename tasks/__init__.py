"""The stages: each module holds the one Prefect task that IS the stage (tasks/kernel.py: how one starts and
ends); `flywheel stage NAME` runs its .fn directly. The package is named for Prefect tasks; the agent's tasks
(the problems, flywheel.envs.Task) are another thing."""
