"""What every section of pipelines.yaml is made of: a frozen model that forbids unknown keys, the config
error, and the endpoint settings the sections that call a server share."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flywheel.errors import UserFacingError


class ConfigError(UserFacingError, ValueError):
    """pipelines.yaml is missing, unreadable or invalid; the message names the file and the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# The limits of an endpoint's client, with their bounds; a section whose defaults differ restates the default only.
Concurrency = Annotated[int, Field(ge=1, le=512)]  # requests in flight at once
TimeoutS = Annotated[float, Field(gt=0)]  # per request; a hang past it is retried
MaxRetries = Annotated[int, Field(ge=0, le=20)]  # per request, on 429, 5xx, timeouts and dropped connections


class EndpointConfig(Section):
    """A server over the OpenAI protocol and how its client talks to it (flywheel/policies/openai.py): the
    sections that call one (teacher, environment.user, environment.replay.judge, evaluate.references, rl.opd)."""

    where: ClassVar[str]  # the section's key in pipelines.yaml, for the client's messages

    # e.g. http://localhost:8000/v1 (vLLM's server); unset: the client's default (OPENAI_BASE_URL or OpenAI's)
    base_url: str | None = None
    # The NAME of the environment variable holding the key; a key itself never goes in this file.
    api_key_env: str | None = Field(None, pattern=r"^[A-Z_][A-Z0-9_]*$")
    concurrency: Concurrency = 16
    timeout_s: TimeoutS = 120.0
    max_retries: MaxRetries = 6
    # this many failed attempts in a row (any request) mean the endpoint is down: the stage stops
    breaker_failures: int = Field(10, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _hide_pasted_keys(cls, data):
        # A value that is not an UPPER_CASE variable name may be a pasted key: the error must not print it.
        value = data.get("api_key_env") if isinstance(data, dict) else None
        if isinstance(value, str) and not (value.isascii() and value.isidentifier() and value == value.upper()):
            data = {**data, "api_key_env": "<hidden: must be the NAME of the environment variable holding the "
                                           "key, e.g. OPENAI_API_KEY, never the key itself>"}
        return data
