"""The names of the flows and of their deployments: one place, read by the flows, `flywheel status` and the sensor.

The retrain deployment of pipeline P is `retrain/P`, its trigger sensor `watch-traces/P`; deployed with
job-per-stage, `stage/P` runs one stage of P as its own job.
"""

from __future__ import annotations

RETRAIN_FLOW = "retrain"
SENSOR_FLOW = "watch-traces"
STAGE_FLOW = "stage"
FLOWS = (RETRAIN_FLOW, SENSOR_FLOW, STAGE_FLOW)
ENTRYPOINTS = {RETRAIN_FLOW: "flows/retrain.py:retrain", SENSOR_FLOW: "flows/sensor.py:watch_traces",
               STAGE_FLOW: "flows/stage.py:stage"}


def deployment_name(flow: str, pipeline: str) -> str:
    """The full name of a flow's deployment for one pipeline: `<flow>/<pipeline>`, e.g. `retrain/demo`."""
    return f"{flow}/{pipeline}"


def retrain_deployment(pipeline: str) -> str:
    """The full name of a pipeline's retrain deployment: `retrain/<pipeline>`."""
    return deployment_name(RETRAIN_FLOW, pipeline)


def stage_deployment(pipeline: str) -> str:
    """The full name of the deployment that runs one stage of a pipeline as its own job: `stage/<pipeline>`."""
    return deployment_name(STAGE_FLOW, pipeline)
