"""One run of a pipeline at a time across machines: a Prefect global concurrency limit per pipeline.

The file lock of flows/runlock.py serialises the runs that share a project folder; workers on two machines (or two
checkouts on one) share only the Prefect server. On a real server (PREFECT_API_URL set; not Prefect's temporary
one, which is private to one process) the retrain flow also holds one slot of the limit `flywheel-retrain-<P>`
(limit 1, created on first use) for the whole run, so a second run of P anywhere fails at once naming the first,
or waits for it (`--wait`).

Prefect cannot say who holds a slot, so the holder says it itself: its flow run carries the tags
`flywheel.slot:<P>`, `flywheel.lease:<lease id>` and `flywheel.host:<host>` while it holds the slot. A slot is
held through a lease that the holder renews every LEASE_S / 3 seconds: a holder that dies without letting go (its
process killed) frees the slot within LEASE_S, when the server's repossessor revokes the lease. Sooner than that,
the next run (or `flywheel status`) releases the slot of a holder whose flow run is already final (CRASHED,
CANCELLED, FAILED, COMPLETED) by revoking its recorded lease. A slot taken with no holder recorded is a holder
between taking it and tagging itself (a second), or one killed in that second (its lease lapses within LEASE_S),
or a lease the server lost (in-memory lease storage, Prefect's default, does not survive a restart) while its count
stayed: a slot still taken that way after UNCLAIMED_S, longer than any lease can outlive its holder, is reset.
"""

from __future__ import annotations

import contextvars
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from uuid import UUID

from flows.runlock import PipelineBusy
from flywheel.tags import SLOT_HOST_TAG_PREFIX, SLOT_LEASE_TAG_PREFIX, SLOT_TAG_PREFIX

log = logging.getLogger(__name__)
LEASE_S = 120  # the server's minimum is 60; renewed every LEASE_S / 3, so two renewals may fail in a row
UNCLAIMED_S = LEASE_S + 30.0  # past a lapsed lease's revocation (the repossessor looks every 15 s)
_POLL_S = 2.0


def limit_name(pipeline: str) -> str:
    """The pipeline's global concurrency limit on the Prefect server."""
    return f"flywheel-retrain-{pipeline}"


def on_server() -> bool:
    """Whether the flows talk to a Prefect server of their own choosing (PREFECT_API_URL), not a temporary one."""
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())


@contextmanager
def pipeline_slot(pipeline: str, flow_run_id: str, wait: bool = False) -> Iterator[None]:
    """Hold the pipeline's slot on the Prefect server for the body; raise PipelineBusy naming the holder (or wait,
    `wait`). Without a server (the embedded default) the body runs as it is: the file lock is the only lock."""
    if not on_server():
        yield
        return
    from prefect import get_client

    with get_client(sync_client=True) as client:
        lease_id = _acquire(client, pipeline, flow_run_id, wait)
    stop = threading.Event()
    renewing = threading.Thread(target=contextvars.copy_context().run, args=(_renew, lease_id, pipeline, stop),
                                name=f"flywheel-slot-{pipeline}", daemon=True)
    renewing.start()
    try:
        yield
    finally:
        stop.set()
        renewing.join(timeout=5)
        try:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(lease_id)
                if flow_run_id:
                    _untag(client, UUID(flow_run_id))
        except Exception as err:  # the lease lapses by itself within LEASE_S
            log.warning("could not release the slot %s (lease %s): %s; it frees itself within %d s",
                        limit_name(pipeline), lease_id, err, LEASE_S)


def check(pipeline: str) -> list[str]:
    """For `flywheel status`: who holds the pipeline's slot on the server; a slot left by a finished or crashed
    flow run is released here (and said so). Nothing without a server, or before the first run made the limit."""
    if not on_server():
        return []
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    name = limit_name(pipeline)
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
            live, dead = _holders(client, pipeline)
            lines = _release(client, pipeline, dead)
        except ObjectNotFound:
            return []
        except Exception as err:  # the server unreachable: the next run checks again
            return [f"{pipeline}: slot {name} not checked: no answer from {client.api_url} ({type(err).__name__})"]
        if live and limit.active_slots:
            lines.append(f"{pipeline}: slot {name} held by {_describe(live[0])}")
        elif limit.active_slots and not dead:
            lines.append(f"{pipeline}: slot {name} taken, its holder not recorded (it frees itself within "
                         f"{LEASE_S} s if no run holds it)")
    return lines


def _acquire(client, pipeline: str, flow_run_id: str, wait: bool) -> UUID:
    """Take the slot (made if missing) under a lease; tag this flow run as its holder; return the lease id."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    name = limit_name(pipeline)
    try:
        client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:  # made by a run starting at the same time
            pass
    announced = False
    unclaimed_since = None
    while True:
        lease_id = _take(client, name, flow_run_id)
        if lease_id is not None:
            break
        live, dead = _holders(client, pipeline, besides=flow_run_id)
        if dead:  # a holder that ended without letting go: its lease is revoked, and the slot taken again
            for line in _release(client, pipeline, dead):
                log.warning("%s", line)
            continue
        if live:
            unclaimed_since = None
            if not wait:
                raise PipelineBusy(
                    f"pipeline '{pipeline}' is already running elsewhere: {_describe(live[0])} holds the slot "
                    f"{name} on {client.api_url}; let it finish, or run with --wait to start when it ends")
            if not announced:
                print(f"waiting for the running '{pipeline}' run to finish ({_describe(live[0])})", flush=True)
                announced = True
        elif unclaimed_since is None:
            unclaimed_since = time.monotonic()
        elif time.monotonic() - unclaimed_since > UNCLAIMED_S:
            # taken, and nobody says so: the server lost the lease (in-memory leases do not survive a restart)
            log.warning("slot %s was taken with no holder recorded for %.0f s: reset to free", name, UNCLAIMED_S)
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
            unclaimed_since = None
            continue
        elif not announced and time.monotonic() - unclaimed_since > 5:
            print(f"slot {name} is taken and no flow run says it holds it (one killed as it started?): waiting for "
                  f"it to free, at most {UNCLAIMED_S:.0f} s", flush=True)
            announced = True
        time.sleep(_POLL_S if live else 1.0)
    if flow_run_id:
        run_id = UUID(flow_run_id)
        for other in _holders(client, pipeline, besides=flow_run_id)[0]:
            _untag(client, other.id)  # tagged but not holding (its lease lapsed): the slot is this run's now
        run = client.read_flow_run(run_id)
        client.update_flow_run(run_id, tags=[*_without_slot_tags(run.tags), f"{SLOT_TAG_PREFIX}{pipeline}",
                                             f"{SLOT_LEASE_TAG_PREFIX}{lease_id}",
                                             f"{SLOT_HOST_TAG_PREFIX}{socket.gethostname()}"])
    return lease_id


def _take(client, name: str, flow_run_id: str) -> UUID | None:
    """One try at the slot: the lease id, or None when it is taken."""
    import httpx
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder

    holder = ConcurrencyLeaseHolder(type="flow_run", id=UUID(flow_run_id)) if flow_run_id else None
    try:
        response = client.increment_concurrency_slots_with_lease([name], 1, "concurrency", LEASE_S, holder)
    except httpx.HTTPStatusError as err:
        if err.response.status_code == 423:  # Locked: every slot taken
            return None
        raise
    return UUID(response.json()["lease_id"])


def _holders(client, pipeline: str, besides: str = "") -> tuple[list, list]:
    """(live, dead): the flow runs tagged as holding the pipeline's slot, not final / final, newest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(
        all_=[f"{SLOT_TAG_PREFIX}{pipeline}"])), sort=FlowRunSort.START_TIME_DESC, limit=20)
    runs = [r for r in runs if str(r.id) != besides]
    dead = [r for r in runs if r.state is not None and r.state.is_final()]
    return [r for r in runs if not (r.state is not None and r.state.is_final())], dead


def _release(client, pipeline: str, dead: list) -> list[str]:
    """Revoke the recorded leases of holders whose flow runs ended, and untag them; say what was done."""
    lines = []
    for run in dead:
        for tag in run.tags:
            if tag.startswith(SLOT_LEASE_TAG_PREFIX):
                client.release_concurrency_slots_with_lease(UUID(tag.removeprefix(SLOT_LEASE_TAG_PREFIX)))
        _untag(client, run.id)
        lines.append(f"{pipeline}: released slot {limit_name(pipeline)} of flow run {run.id} ('{run.name}', "
                     f"{run.state.type.value}): it ended without letting go")
    return lines


def _renew(lease_id: UUID, pipeline: str, stop: threading.Event) -> None:
    from prefect import get_client

    while not stop.wait(LEASE_S / 3):
        try:
            with get_client(sync_client=True) as client:
                client.renew_concurrency_lease(lease_id, LEASE_S)
        except Exception as err:  # the server restarting: the next renewal may reach it
            log.warning("could not renew the lease of slot %s (%s): if it lapses another run of '%s' can start",
                        limit_name(pipeline), err, pipeline)


def _untag(client, flow_run_id: UUID) -> None:
    run = client.read_flow_run(flow_run_id)
    client.update_flow_run(flow_run_id, tags=_without_slot_tags(run.tags))


def _without_slot_tags(tags: list[str]) -> list[str]:
    return [t for t in tags if not t.startswith((SLOT_TAG_PREFIX, SLOT_LEASE_TAG_PREFIX, SLOT_HOST_TAG_PREFIX))]


def _describe(run) -> str:
    host = next((t.removeprefix(SLOT_HOST_TAG_PREFIX) for t in run.tags if t.startswith(SLOT_HOST_TAG_PREFIX)),
                "?")
    since = run.start_time.strftime("%Y-%m-%d %H:%M:%S UTC") if run.start_time else "?"
    root = (run.parameters or {}).get("root", "?")
    return (f"Prefect flow run {run.id} ('{run.name}', {run.state.type.value if run.state else '?'} since {since}, "
            f"project {root} on {host})")
