"""`python -m flywheel.cli`: the `flywheel` command where its script is not on PATH."""

from flywheel.cli import app

app()
