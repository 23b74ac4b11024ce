"""The Ray Serve request router that runs ``cluster.routing``'s routers.

Ray Serve builds one per deployment handle, in the process that routes (the gRPC proxy):
``RequestRouterConfig(request_router_class="cluster.ray_router:KVServeRequestRouter",
request_router_kwargs={...})``. For each pending Generate call it decodes the request (the
proxy hands over a pickled ``GenerateRequest``), tokenizes the prompt exactly as a replica
would (``server.frontend.prompt_token_ids``), hashes its blocks (``routing.routing_keys``)
and asks the router. Other methods (GetModelInfo, ...) go to the least loaded replica.

Load is counted here, per replica: requests sent and not yet completed. Each replica's
report (``KVServeReplica.record_routing_stats``) adds the block keys it admitted, so the
index also learns what other proxies sent, and marks a draining replica, which gets no new
requests.

The cost router (``--router cost``) also needs prices and the shared tier's contents. Each
replica reports its step-cost model's coefficients and what a tier-2 restore cost it; the
router prices prefills with their mean. A request that completed had its blocks freed, and
so spilled: with a shared tier (``--kv-disk-dir``), its keys become shared-tier hits.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from collections import Counter, OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.openai_ingress import GENERATE_METHOD, tokenizer_for
from cluster.pd import PREFILL_METHOD
from cluster.routing import (
    CostModelPrice,
    CostRouter,
    PrefixRouter,
    ReplicaLoad,
    make_router,
    routing_keys,
)
from scheduler.cost_model import FEATURES, StepCostModel, StepShape
from scheduler.request import LoraRef, Request
from server.lora import cache_salt_with

# Keys of requests chosen but not yet routed / completed, at most this many (a request Ray
# gave up on between the two leaves its entry behind).
_MAX_TRACKED = 65_536


def prices_from_reports(
    reports: list[dict[str, Any]], chunk_tokens: int
) -> tuple[CostModelPrice | None, float | None]:
    """The mean of the replicas' reported step-cost models (None unless it prices more tokens
    higher), and the mean reported restore seconds per block (None when none restored yet)."""
    models = [
        r["cost_model_s"]
        for r in reports
        if isinstance(r.get("cost_model_s"), list | tuple)
        and len(r["cost_model_s"]) == len(FEATURES)
        and all(isinstance(c, int | float) and math.isfinite(c) for c in r["cost_model_s"])
    ]
    price = None
    if models:
        mean = [sum(column) / len(models) for column in zip(*models, strict=True)]
        model = StepCostModel(mean)
        short = model.predict(StepShape.of([(chunk_tokens // 2, 0)], []))
        if model.predict(StepShape.of([(chunk_tokens, 0)], [])) > short > 0:
            price = CostModelPrice(model, chunk_tokens)
    restores = [
        float(r["restore_s_per_block"])
        for r in reports
        if isinstance(r.get("restore_s_per_block"), int | float) and r["restore_s_per_block"] > 0
    ]
    return price, (sum(restores) / len(restores) if restores else None)


logger = logging.getLogger(__name__)


class KVServeRequestRouter(RequestRouter):
    """``--router {round-robin,power-of-two,prefix}`` inside Ray Serve."""

    def initialize_state(
        self,
        router: str = "prefix",
        engine: dict[str, Any] | None = None,
        block_size: int = 16,
        capacity_blocks: int = 4096,
        imbalance_abs: int = 8,
        imbalance_rel: float = 1.5,
        metrics_host: str = "127.0.0.1",
        metrics_port: int | None = None,
        seed: int | None = None,
        shared_tier_blocks: int | None = None,
        chunk_tokens: int = 512,
        **_: Any,
    ) -> None:
        self.router_name = router
        self.router = make_router(
            router,
            capacity_blocks=capacity_blocks,
            imbalance_abs=imbalance_abs,
            imbalance_rel=imbalance_rel,
            seed=seed,
            block_size=block_size,
            shared_capacity_blocks=shared_tier_blocks,
            restore_s_per_block=1e-3,  # until a replica reports its own
        )
        self.chunk_tokens = chunk_tokens
        self._keys_of: OrderedDict[str, list[int]] = OrderedDict()  # internal id -> keys
        self.block_size = block_size
        self._engine = dict(engine or {})
        self._tokenizer: Any = None
        self._in_flight: Counter[str] = Counter()
        self._sent: dict[str, str] = {}  # internal request id -> replica id
        self._learned: dict[str, Any] = {}  # replica id -> the last report learned
        self._adapter_keys: dict[str, str] = {}  # LoRA adapter -> its key (replica reports)
        self.metrics: Any = None
        if metrics_port is not None:
            self._start_metrics(metrics_host, metrics_port)

    def _start_metrics(self, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry

        from cluster.metrics import RouterMetrics, start_router_metrics_server

        registry = CollectorRegistry()
        self.metrics = RouterMetrics(registry, self.router_name)
        try:
            self._metrics_server = start_router_metrics_server(
                host, port, registry, self._replica_metrics_urls
            )
        except OSError as exc:  # a second proxy on this node: the first one serves them
            logger.warning("router metrics not served on %s:%d: %s", host, port, exc)
        else:
            logger.info(
                "router metrics and targets on http://%s:%d", host, self._metrics_server.port
            )

    def _replica_metrics_urls(self) -> list[str]:
        """The metrics addresses of the replicas this router routes to, and of the replicas
        they call (a decode replica's prefill replicas)."""
        urls: set[str] = set()
        for replica in list(self._replicas.values()):
            stats = replica.routing_stats
            urls.add(str(stats.get("metrics_url", "")))
            urls.update(str(u) for u in stats.get("peer_metrics_urls") or ())
        return sorted(u for u in urls if u)

    # ------------------------------------------------------------------ prompt -> keys
    def _prompt_keys(self, pending: PendingRequest | None) -> tuple[list[int], int]:
        """The request's block keys and prompt length; empty for calls that generate nothing.

        ``Generate`` (the gRPC proxy) carries a ``GenerateRequest``, tokenized here;
        ``generate_request`` (the OpenAI ingress) and ``prefill_request`` (a decode replica's
        handoff) an engine request, tokenized already."""
        if pending is None or not pending.args:
            return [], 0
        if pending.metadata.call_method in (GENERATE_METHOD, PREFILL_METHOD):
            engine_request = pending.args[0]
            if not isinstance(engine_request, Request):
                return [], 0
            ids = engine_request.prompt_token_ids
            return routing_keys(ids, self.block_size, engine_request.cache_salt), len(ids)
        if pending.metadata.call_method != "Generate":
            return [], 0
        from server.frontend import prompt_token_ids
        from server.rpc import generation_pb2 as pb

        arg = pending.args[0]
        try:
            request = pickle.loads(arg).user_request_proto if isinstance(arg, bytes) else arg
            if not isinstance(request, pb.GenerateRequest):
                return [], 0
            if self._tokenizer is None:
                self._tokenizer = tokenizer_for(self._engine)
            ids = prompt_token_ids(self._tokenizer, request)
        except Exception:  # an invalid request: the replica answers it with a clear status
            logger.debug("no routing keys for request", exc_info=True)
            return [], 0
        salt = self._adapter_salt(request.cache_salt or None, request)
        return routing_keys(ids, self.block_size, salt), len(ids)

    def _adapter_salt(self, salt: str | None, request: Any) -> str | None:
        """``salt`` with the request's LoRA adapter in it, as the replicas salt its blocks
        (the key of its weights comes from their reports); ``salt`` for the base model."""
        name = getattr(request, "adapter", "")
        if not name:
            return salt
        scale = request.adapter_scale if request.HasField("adapter_scale") else 1.0
        key = self._adapter_keys.get(name)
        if key is None or not scale:
            return salt  # not served (the replica answers NOT_FOUND), or scale 0: the base
        return cache_salt_with(salt, LoraRef(name, key, scale))

    # ------------------------------------------------------------------ RequestRouter
    def _learn_reports(self, replicas: list[RunningReplica]) -> None:
        for r in replicas:
            self._adapter_keys.update(r.routing_stats.get("adapters") or {})
        router = self.router
        if not isinstance(router, PrefixRouter | CostRouter):
            return
        index = router.index
        index.retain(r.replica_id.unique_id for r in replicas)
        fresh = []
        for r in replicas:
            rid = r.replica_id.unique_id
            reported = r.routing_stats.get("keys")
            if reported and self._learned.get(rid) is not reported:  # each report once
                index.add(rid, reported)
                self._learned[rid] = reported
                fresh.append(r.routing_stats)
        if fresh and isinstance(router, CostRouter):
            price, restore_s = prices_from_reports(
                [r.routing_stats for r in replicas], self.chunk_tokens
            )
            if price is not None:
                router.price = price
            if restore_s is not None:
                router.restore_s_per_block = restore_s
            sizes = [r.routing_stats.get("tier2_capacity_blocks") for r in replicas]
            known = [n for n in sizes if isinstance(n, int) and n > 0]
            if router.shared is not None and known:
                router.shared.capacity_blocks = max(known)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        live = [
            ReplicaLoad(rid, self._in_flight[rid]) for rid, r in by_id.items()
            if not r.routing_stats.get("draining", False)
        ]  # fmt: skip
        if not live:
            return []
        self._learn_reports(candidate_replicas)
        keys, num_prompt_tokens = self._prompt_keys(pending_request)
        if pending_request is None or not num_prompt_tokens:
            least = min(live, key=lambda r: (r.num_ongoing, r.replica_id))
            return [[by_id[least.replica_id]]]
        decision = self.router.choose(
            live, keys, num_prompt_tokens=num_prompt_tokens, now_s=time.monotonic()
        )
        if keys:
            self._keys_of[pending_request.metadata.internal_request_id] = keys
            while len(self._keys_of) > _MAX_TRACKED:
                self._keys_of.popitem(last=False)
        if self.metrics is not None:
            self.metrics.record(decision, self.block_size, num_prompt_tokens)
        return [[by_id[decision.replica_id]]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        rid = replica_id.unique_id
        self._in_flight[rid] += 1
        self._sent[pending_request.metadata.internal_request_id] = rid

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._sent.pop(internal_request_id, replica_id.unique_id)
        if self._in_flight[rid] > 0:
            self._in_flight[rid] -= 1
        keys = self._keys_of.pop(internal_request_id, None)
        if keys:
            self.router.on_finished(rid, keys)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id.unique_id, None)
        if isinstance(self.router, CostRouter):
            self.router.forget(replica_id.unique_id)
        elif isinstance(self.router, PrefixRouter):
            self.router.index.drop(replica_id.unique_id)
