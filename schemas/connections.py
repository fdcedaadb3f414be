"""Where a run's parts connect: the Kafka event log (``BusConfig``) and the object store (``StoreConfig``).

Sections of ``schemas.config.RunConfig`` (and importable from there), kept apart
because they say where things are rather than what the run is: a restart may move
them (``pipeline.runtime`` never compares them), and tools that only read the log or
the store take them alone.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from schemas.fields import ConfigSection
from schemas.names import validate_name


class BusConfig(ConfigSection):
    """Where the Kafka event log is and how to reach it."""

    bootstrap_servers: str = Field(
        "", max_length=2048, description="host:port[,host:port]; empty = the embedded broker from `rlpipe up`"
    )
    namespace: str = Field("rlpipe", description="topic prefix: <namespace>.trajectories, .adapters, .control, .dlq, "
                           "and the API's .requests and .results")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="Kafka security protocol"
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        None, description="SASL mechanism when the protocol is SASL_*"
    )
    sasl_username: str | None = Field(None, max_length=512, description="SASL user name")
    sasl_password: SecretStr | None = Field(None, description="SASL password (never printed)")
    sasl_password_file: str | None = Field(None, max_length=4096, description="file holding the SASL password")
    ssl_cafile: str | None = Field(None, max_length=4096, description="PEM file of the CA that signed the brokers")
    connect_timeout_s: float = Field(10.0, gt=0, le=600, description="give up reaching the broker after this long")
    topic_partitions: int = Field(1, ge=1, le=1024, description="partitions when rlpipe creates a topic")
    replication_factor: int = Field(1, ge=1, le=16, description="replicas when rlpipe creates a topic")

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return validate_name(value, "namespace")

    @model_validator(mode="after")
    def _sasl_complete(self) -> BusConfig:
        if self.security_protocol.startswith("SASL") and self.sasl_mechanism is None:
            raise ValueError(f"security_protocol {self.security_protocol} needs sasl_mechanism (e.g. SCRAM-SHA-512)")
        if self.sasl_mechanism and not self.sasl_username:
            raise ValueError("sasl_mechanism is set but sasl_username is empty; set bus.sasl_username")
        # The Kafka client ignores SASL settings under a non-SASL protocol, and TLS ones under a plaintext one.  A
        # password alone is no such setting: a pod may hold the Secret whatever its bus (it is then unused).
        sasl_set = [name for name in ("sasl_mechanism", "sasl_username") if getattr(self, name) is not None]
        if sasl_set and not self.security_protocol.startswith("SASL"):
            raise ValueError(f"bus.{sasl_set[0]} is set but bus.security_protocol is {self.security_protocol}, which "
                             "uses no SASL; set security_protocol to SASL_PLAINTEXT or SASL_SSL, or unset it")
        if self.ssl_cafile is not None and not self.security_protocol.endswith("SSL"):
            raise ValueError(f"bus.ssl_cafile is set but bus.security_protocol is {self.security_protocol}, which "
                             "uses no TLS; set security_protocol to SSL or SASL_SSL, or unset it")
        return self


class StoreConfig(ConfigSection):
    """Where the object store is: a local folder, gs:// or memory:// (filesystems with a create-only write)."""

    root: str = Field("", max_length=4096, description="file:///..., memory://..., gs://bucket/prefix; empty = embedded")
    gcs_endpoint: str | None = Field(None, max_length=1024, description="GCS API endpoint (emulator); None = Google")
    gcs_project: str | None = Field(None, max_length=256, description="GCS project for gcsfs")
