"""The Ray Serve request router that runs ``cluster.routing``'s routers.

Ray Serve builds one per deployment handle, in the process that routes (the gRPC proxy):
``RequestRouterConfig(request_router_class="cluster.ray_router:KVServeRequestRouter",
request_router_kwargs={...})``. For each pending Generate call it decodes the request (the
proxy hands over a pickled ``GenerateRequest``), tokenizes the prompt exactly as a replica
would (``server.frontend.prompt_token_ids``), hashes its blocks (``routing.routing_keys``)
and asks the router. Other methods (GetModelInfo, ...) go to the least loaded replica.

A request's id lives on one replica: the router remembers which replica holds each (owner,
request id) it sent (the owner as ``server.auth`` scopes ids: the API key's digest, or the
peer's host). An ``Abort`` goes to that replica, so it answers ``found`` as a single server
would, and a second request with an id in flight goes there too, where the engine refuses
the duplicate (ALREADY_EXISTS, HTTP 409). Each router knows what it sent: the gRPC proxy's
router the gRPC calls, each OpenAI ingress's router its HTTP calls.

Load is counted here, per replica: requests chosen or sent and not yet completed (a choice
counts before Ray reports it routed; one never sent stops counting after ``HOLD_S``). Each
replica's report (``KVServeReplica.record_routing_stats``) adds the block keys it admitted,
so the index also learns what other proxies sent; sizes its index to its KV pool (older keys
were evicted there); and marks a draining replica, which gets no new requests.

The cost router (``--router cost``) also needs prices and the shared tier's contents. Each
replica reports its step-cost model's coefficients and what a tier-2 restore cost it; the
router prices prefills with their mean. A request that completed had its blocks freed, and
so spilled: with a shared tier (``--kv-disk-dir``), its keys become shared-tier hits.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.openai_ingress import GENERATE_METHOD, tokenizer_for
from cluster.pd import PREFILL_METHOD
from cluster.routing import DEFAULT_GUARD, LoadGuard, ReplicaLoad, make_router, routing_keys
from scheduler.request import Request
from server.auth import CacheScope, grpc_peer_host, request_owner, scoped_id
from server.identity import request_identity
from server.lora import Adapters
from server.rpc import generation_pb2 as pb

# Keys of requests chosen but not yet routed / completed, at most this many (a request Ray
# gave up on between the two leaves its entry behind).
_MAX_TRACKED = 65_536
# Ray asks again about a request it could not place (the chosen replica's queue-length probe
# timed out: a busy host). The request keeps its replica for this many asks while that one is
# live, so one request is one decision (the router's counts, round robin's turn, the prefix
# credit); past them it is chosen afresh (a replica that stays full).
STICKY_ASKS = 8
# A request chosen for a replica counts as that replica's load from the choice on, not only
# once Ray reports it routed (after the replica's accept came back: meanwhile the replica may
# already run it, and a burst chosen in between would all see the same counts). A choice
# never routed (its caller gave up before Ray sent it) stops counting after this long.
HOLD_S = 10.0


logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoutedCall:
    """One call as the router reads it, decoded once (``of``)::

        kind      what it carries                        routed
        engine    an engine ``Request``: the OpenAI      by its keys (ids and salt made by
                  ingress's Generate, a decode           the ingress's front); a Generate's
                  replica's prefill handoff              id where that id runs
        generate  the gRPC proxy's ``GenerateRequest``   tokenized and salted here; its id
        abort     the gRPC proxy's ``AbortRequest``      where its request runs
        other     anything else (GetModelInfo, an        to the least loaded replica
                  undecodable message)

    ``request_id``: the id the call names (an engine Generate's, already owner-scoped; the
    client's for the gRPC calls), "" for none."""

    kind: str = "other"
    engine: Request | None = None
    generate: pb.GenerateRequest | None = None
    request_id: str = ""

    @classmethod
    def of(cls, pending: PendingRequest) -> RoutedCall:
        if not pending.args:
            return cls()
        arg = pending.args[0]
        method = pending.metadata.call_method
        if method in (GENERATE_METHOD, PREFILL_METHOD):
            if not isinstance(arg, Request):
                return cls()
            return cls("engine", arg, None, arg.request_id if method == GENERATE_METHOD else "")
        try:
            message = pickle.loads(arg).user_request_proto if isinstance(arg, bytes) else arg
        except Exception:  # not ours to judge: the replica answers it with a clear status
            logger.debug("undecodable request", exc_info=True)
            return cls()
        if isinstance(message, pb.GenerateRequest):
            return cls("generate", None, message, message.request_id)
        if isinstance(message, pb.AbortRequest):
            return cls("abort", request_id=message.request_id)
        return cls()


def _load(replica: ReplicaLoad) -> tuple[int, str]:
    """The least loaded replica first, ties by id."""
    return replica.num_ongoing, replica.replica_id


class KVServeRequestRouter(RequestRouter):
    """``--router {cost,prefix,power-of-two,round-robin}`` inside Ray Serve."""

    def initialize_state(
        self,
        router: str = "prefix",
        engine: dict[str, Any] | None = None,
        block_size: int = 16,
        capacity_blocks: int = 4096,
        imbalance_abs: int = DEFAULT_GUARD.imbalance_abs,
        imbalance_rel: float = DEFAULT_GUARD.imbalance_rel,
        metrics_host: str = "127.0.0.1",
        metrics_port: int | None = None,
        seed: int | None = None,
        shared_tier_blocks: int | None = None,
        chunk_tokens: int = 512,
        auth: bool = False,
        share_prefix_cache: bool = False,
        metrics_gate: dict[str, Any] | None = None,
        metrics_limits: dict[str, Any] | None = None,
        **_: Any,
    ) -> None:
        """``auth``: whether API keys are on (request ids are scoped by key, else by peer);
        ``share_prefix_cache``: keys on, tenants share the prefix cache (``server.auth``);
        ``metrics_gate``: ``OwnerGate`` fields for /metrics and /targets (keys on);
        ``metrics_limits``: ``HttpLimits`` fields of the metrics port."""
        self.router_name = router
        self.router = make_router(
            router,
            capacity_blocks=capacity_blocks,
            guard=LoadGuard(imbalance_abs, imbalance_rel),
            seed=seed,
            block_size=block_size,
            shared_capacity_blocks=shared_tier_blocks,
            restore_s_per_block=1e-3,  # until a replica reports its own
            chunk_tokens=chunk_tokens,
        )
        self._keys_of: OrderedDict[str, list[int]] = OrderedDict()  # internal id -> keys
        self.block_size = block_size
        self._engine = dict(engine or {})
        self._tokenizer: Any = None
        self._in_flight: Counter[str] = Counter()
        self._sent: dict[str, str] = {}  # internal request id -> replica id
        self._learned: dict[str, Any] = {}  # replica id -> the last report learned
        self._adapter_keys: dict[str, str] = {}  # LoRA adapter -> its key (replica reports)
        self._adapters = Adapters()  # resolves the names in _adapter_keys
        self._auth = auth
        self._scope = CacheScope(auth, share_prefix_cache)
        self._ids_of: OrderedDict[str, str] = OrderedDict()  # internal id -> scoped id
        self._holders: dict[str, tuple[str, str]] = {}  # scoped id -> (replica, internal id)
        # internal id -> (replica, asks, when first chosen): chosen and not yet routed
        self._chosen: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        self._held: Counter[str] = Counter()  # replica id -> its requests in _chosen
        self.metrics: Any = None
        if metrics_port is not None:
            self._start_metrics(metrics_host, metrics_port, metrics_gate, metrics_limits)

    def _start_metrics(
        self,
        host: str,
        port: int,
        gate: dict[str, Any] | None,
        limits: dict[str, Any] | None,
    ) -> None:
        from prometheus_client import CollectorRegistry

        from cluster.metrics import RouterMetrics, start_router_metrics_server
        from server.auth import OwnerGate
        from server.http_guard import HttpLimits

        registry = CollectorRegistry()
        self.metrics = RouterMetrics(registry, self.router_name)
        owner_gate = None
        if gate is not None:
            owner_gate = OwnerGate(
                frozenset(gate["api_owners"]),
                frozenset(gate["admin_owners"]),
                bool(gate["metrics_require_key"]),
            )
        try:
            self._metrics_server = start_router_metrics_server(
                host,
                port,
                registry,
                self._replica_metrics_urls,
                owner_gate,
                None if limits is None else HttpLimits(**limits),
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

    # ------------------------------------------------------------------ request -> keys
    def _owner(self, pending: PendingRequest) -> str:
        """Who a gRPC call's request belongs to, as its replica will judge (``server.auth``)."""
        context = pending.metadata.grpc_context
        metadata = dict(context.invocation_metadata()) if context is not None else {}
        peer = grpc_peer_host(str(context.peer())) if context is not None else ""
        return request_owner(metadata.get("authorization"), peer, self._auth)

    def _scoped_id(self, pending: PendingRequest, call: RoutedCall) -> str | None:
        """The engine id (owner-scoped) a call names; None without one."""
        if call.kind == "engine" or not call.request_id:
            return call.request_id or None
        return scoped_id(self._owner(pending), call.request_id)

    def _prompt_keys(self, pending: PendingRequest, call: RoutedCall) -> tuple[list[int], int]:
        """The request's block keys and prompt length; empty for calls that generate nothing.
        A gRPC ``GenerateRequest`` is tokenized and salted here, as its replica will
        (``server.identity``: the owner, the client's salt, the adapter)."""
        from server.frontend import prompt_token_ids

        if call.engine is not None:
            ids = call.engine.prompt_token_ids
            return routing_keys(ids, self.block_size, call.engine.cache_salt), len(ids)
        if call.generate is None:
            return [], 0
        try:
            if self._tokenizer is None:
                self._tokenizer = tokenizer_for(self._engine)
            ids = prompt_token_ids(self._tokenizer, call.generate)
            owner = self._owner(pending)
            _, salt = request_identity(call.generate, owner, self._scope, self._adapters)
        except Exception:  # an invalid request: the replica answers it with a clear status
            logger.debug("no routing keys for request", exc_info=True)
            return [], 0
        return routing_keys(ids, self.block_size, salt), len(ids)

    # ------------------------------------------------------------------ RequestRouter
    def _learn_reports(self, replicas: list[RunningReplica]) -> None:
        """Each replica's latest report, once: the keys it admitted, the prices, and the
        keys of its LoRA adapters."""
        known = dict(self._adapter_keys)
        for r in replicas:
            self._adapter_keys.update(r.routing_stats.get("adapters") or {})
        if self._adapter_keys != known:
            self._adapters = Adapters(keys=self._adapter_keys)
        router = self.router
        router.retain(r.replica_id.unique_id for r in replicas)
        fresh = False
        for r in replicas:
            rid = r.replica_id.unique_id
            kv_blocks = r.routing_stats.get("kv_blocks")
            if isinstance(kv_blocks, int) and kv_blocks > 0:
                router.resize(rid, kv_blocks)
            reported = r.routing_stats.get("keys")
            if reported and self._learned.get(rid) is not reported:
                router.learn(rid, reported)
                self._learned[rid] = reported
                fresh = True
        if fresh:
            router.reprice([r.routing_stats for r in replicas])

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        now = time.monotonic()
        self._expire_choices(now)
        live = [
            ReplicaLoad(rid, self._in_flight[rid] + self._held[rid]) for rid, r in by_id.items()
            if not r.routing_stats.get("draining", False)
        ]  # fmt: skip
        if not live:
            return []
        self._learn_reports(candidate_replicas)
        if pending_request is None:
            return [[by_id[min(live, key=_load).replica_id]]]
        call = RoutedCall.of(pending_request)
        scoped = self._scoped_id(pending_request, call)
        internal_id = pending_request.metadata.internal_request_id
        if scoped is not None:
            holder = self._holders.get(scoped)
            if call.kind != "abort":
                self._track(self._ids_of, internal_id, scoped)
            if holder is not None and holder[0] in by_id:
                # An Abort finds its request; a duplicate id is refused where it runs.
                return [[by_id[holder[0]]]]
        again = self._chosen.get(internal_id)
        if (
            again is not None
            and again[1] < STICKY_ASKS
            and any(r.replica_id == again[0] for r in live)
        ):
            self._chosen[internal_id] = (again[0], again[1] + 1, again[2])  # the same one
            return [[by_id[again[0]]]]
        keys, num_prompt_tokens = self._prompt_keys(pending_request, call)
        if not num_prompt_tokens:
            return [[by_id[min(live, key=_load).replica_id]]]
        decision = self.router.choose(live, keys, num_prompt_tokens=num_prompt_tokens, now_s=now)
        self._hold(internal_id, decision.replica_id, now)
        if keys:
            self._track(self._keys_of, pending_request.metadata.internal_request_id, keys)
        if self.metrics is not None:
            self.metrics.record(decision, self.block_size, num_prompt_tokens)
        return [[by_id[decision.replica_id]]]

    def _hold(self, internal_id: str, replica_id: str, now: float) -> None:
        """``internal_id`` was chosen for ``replica_id`` (afresh: a choice it had is dropped)."""
        self._unhold(internal_id)
        self._chosen[internal_id] = (replica_id, 1, now)
        self._held[replica_id] += 1
        while len(self._chosen) > _MAX_TRACKED:
            self._unhold(next(iter(self._chosen)))

    def _unhold(self, internal_id: str) -> None:
        choice = self._chosen.pop(internal_id, None)
        if choice is not None:
            self._held[choice[0]] -= 1
            if self._held[choice[0]] <= 0:
                del self._held[choice[0]]

    def _expire_choices(self, now: float) -> None:
        """Choices older than ``HOLD_S`` and never routed no longer count (oldest first)."""
        while self._chosen:
            internal_id, (_, _, chosen_s) = next(iter(self._chosen.items()))
            if now - chosen_s <= HOLD_S:
                return
            self._unhold(internal_id)

    @staticmethod
    def _track(table: OrderedDict[str, Any], internal_id: str, value: Any) -> None:
        """Remember ``value`` for a request until it completes (at most ``_MAX_TRACKED``: a
        request Ray gave up on between routing and completion leaves its entry behind)."""
        table[internal_id] = value
        while len(table) > _MAX_TRACKED:
            table.popitem(last=False)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        rid = replica_id.unique_id
        internal_id = pending_request.metadata.internal_request_id
        self._in_flight[rid] += 1
        self._sent[internal_id] = rid
        self._unhold(internal_id)
        scoped = self._ids_of.get(internal_id)
        if scoped is not None:
            self._holders.setdefault(scoped, (rid, internal_id))  # a duplicate keeps the first
            while len(self._holders) > _MAX_TRACKED:
                del self._holders[next(iter(self._holders))]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        sent = self._sent.pop(internal_request_id, None)
        rid = sent or replica_id.unique_id
        if sent is not None and self._in_flight[rid] > 0:  # not a refused try's end
            self._in_flight[rid] -= 1
        keys = self._keys_of.pop(internal_request_id, None)
        if keys:
            self.router.on_finished(rid, keys)
        scoped = self._ids_of.pop(internal_request_id, None)
        if scoped is not None and self._holders.get(scoped, ("", ""))[1] == internal_request_id:
            del self._holders[scoped]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id.unique_id, None)
        self.router.forget(replica_id.unique_id)
