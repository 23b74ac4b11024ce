"""An engine's front, assembled in one place: its engine client, the ``Frontend`` both fronts
share, and the gRPC servicer.

    EngineClient (or a subclass: a replica's reporting client)
        -> Frontend(client, tokenizer, model, security, the runner's constraint compiler,
                    Adapters over the client's adapter source)
        -> GenerationServicer(frontend)

A single server (``server.lifecycle.KVServeServer``) and each cluster replica
(``cluster.replica.KVServeReplica``) build theirs with ``assemble_front``; the OpenAI front
(``server.openai.app``) sits on the same ``Frontend``. The cluster's OpenAI ingress has no
engine of its own (its client is remote) and builds its ``Frontend`` itself.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass

from metrics.records import MetricsSink
from server.auth import Security
from server.engine_client import EngineClient
from server.frontend import Frontend, ServedModel, ServerTokenizer
from server.grpc_service import GenerationServicer
from server.lora import Adapters


@dataclass(frozen=True, slots=True)
class Front:
    """What serves one engine's requests (see the module docstring)."""

    client: EngineClient
    frontend: Frontend
    servicer: GenerationServicer


def assemble_front(
    client: EngineClient,
    tokenizer: ServerTokenizer,
    model: ServedModel,
    security: Security,
    *,
    sink: MetricsSink | None = None,
    executor: Executor | None = None,
) -> Front:
    """The front over ``client``'s engine: structured outputs compiled by its runner's
    tracker, requests' adapters resolved in the client's adapter source (which pins them).
    ``executor``: where the front tokenizes (None: the event loop's default)."""
    tracker = client.engine.constraint_tracker
    frontend = Frontend(
        client, tokenizer, model, executor, security,
        tracker.compiler if tracker is not None else None,
        Adapters(client.adapters, base_name=model.name),
    )  # fmt: skip
    return Front(client, frontend, GenerationServicer(frontend, sink=sink, security=security))
