"""cluster.ray_router.KVServeRequestRouter's own logic, on stand-ins for Ray's replicas: what it
decodes from the proxy's pickled request, load from its own in-flight counts, reports learned,
draining replicas skipped. (The end-to-end behaviour is in test_ray_serve.py.)"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve._private.common import RequestMetadata, gRPCRequest
from ray.serve.request_router import PendingRequest

from cluster.ray_router import KVServeRequestRouter
from cluster.routing import (
    CostModelPrice,
    CostScore,
    GuardedRouter,
    prices_from_reports,
    routing_keys,
)
from server.fake_tokenizer import ByteTokenizer
from server.rpc import generation_pb2 as pb


@dataclass(frozen=True)
class _Id:
    unique_id: str


@dataclass
class StubReplica:
    """What the router reads of Ray's RunningReplica."""

    replica_id: _Id
    routing_stats: dict[str, Any] = field(default_factory=dict)


def replica(name: str, **stats: Any) -> StubReplica:
    return StubReplica(_Id(name), dict(stats))


def make_router(**kwargs: Any) -> KVServeRequestRouter:
    router = KVServeRequestRouter.__new__(KVServeRequestRouter)  # Ray's __init__ needs a cluster
    router.initialize_state(engine={"runner": "fake"}, block_size=4, **kwargs)
    return router


def generate(text: str, n: int = 0, method: str = "Generate") -> PendingRequest:
    arg = pickle.dumps(gRPCRequest(user_request_proto=pb.GenerateRequest(text=text)))
    return PendingRequest(args=[arg], kwargs={}, metadata=RequestMetadata(f"r{n}", f"i{n}", method))


async def chosen(
    router: KVServeRequestRouter, replicas: list[StubReplica], pr: PendingRequest
) -> str:
    (rank,) = await router.choose_replicas(replicas, pr)  # type: ignore[arg-type]
    (one,) = rank
    return str(one.replica_id.unique_id)


async def test_prefix_routing_follows_the_prompt_and_counts_load() -> None:
    """The same system prompt follows its replica; a new prompt goes to the idler one, by the
    router's own in-flight count."""
    router = make_router(router="prefix")
    a, b = replica("a"), replica("b")
    system = "You are a helpful pirate. " * 2
    assert await chosen(router, [a, b], generate(system + "hi", 1)) == "a"
    router.on_request_routed(generate("", 1), a.replica_id, None)  # type: ignore[arg-type]
    assert await chosen(router, [a, b], generate(system + "ahoy", 2)) == "a"  # held prefix
    assert await chosen(router, [a, b], generate("something else entirely", 3)) == "b"
    router.on_request_completed(a.replica_id, "i1")  # type: ignore[arg-type]
    assert router._in_flight["a"] == 0


async def test_draining_replicas_get_no_new_requests() -> None:
    """A replica whose report says draining is skipped, even holding the prefix; with every
    replica draining there is no choice (Ray retries)."""
    router = make_router(router="prefix")
    prompt = "shared prefix shared prefix"
    keys = routing_keys(ByteTokenizer().encode(prompt), 4, None)
    a, b = replica("a", keys=keys, draining=True), replica("b")
    assert await chosen(router, [a, b], generate(prompt, 1)) == "b"
    assert await router.choose_replicas([a], generate(prompt, 2)) == []  # type: ignore[list-item]


async def test_reported_keys_are_learned_once() -> None:
    """A replica's report of admitted prompts' keys sends the next such prompt there."""
    router = make_router(router="prefix")
    prompt = "what another proxy sent to b, long enough for blocks"
    keys = routing_keys(ByteTokenizer().encode(prompt), 4, None)
    a, b = replica("a"), replica("b", keys=keys)
    assert await chosen(router, [a, b], generate(prompt, 1)) == "b"
    assert isinstance(router.router, GuardedRouter)
    assert router.router.score.index.num_prefix_blocks("b", keys) == len(keys)


async def test_reports_size_each_replicas_index_to_its_pool() -> None:
    """A report's ``kv_blocks`` bounds what the router believes that replica holds."""
    router = make_router(router="prefix")
    a, b = replica("a", kv_blocks=3), replica("b")
    prompt = "a prompt of many four-byte blocks, more than three"
    assert await chosen(router, [a, b], generate(prompt, 1)) == "a"
    assert isinstance(router.router, GuardedRouter)
    index = router.router.score.index
    assert index.num_keys("a") == 3
    assert index.num_prefix_blocks("a", routing_keys(ByteTokenizer().encode(prompt), 4, None)) == 0
    a.routing_stats["kv_blocks"] = 1
    await chosen(router, [a, b], generate("another prompt entirely", 2))
    assert index.num_keys("a") == 1


async def test_a_request_asked_about_again_keeps_its_replica_and_is_one_decision() -> None:
    """Ray asks again about a request it could not place (a probe timed out on a busy host):
    it keeps the replica chosen first, while that one is live, for STICKY_ASKS asks, without
    another decision (round robin's turn stays, the metrics count one); once routed, the next
    request takes the next turn; past STICKY_ASKS, or with its replica gone, a fresh choice."""
    from cluster.ray_router import STICKY_ASKS

    router = make_router(router="round-robin")
    decisions: list[str] = []
    router.metrics = type("M", (), {"record": lambda _s, d, *_: decisions.append(d.replica_id)})()
    a, b = replica("a"), replica("b")
    first = generate("same prompt", 1)
    assert [await chosen(router, [a, b], first) for _ in range(3)] == ["a"] * 3
    router.on_request_routed(first, a.replica_id, None)  # type: ignore[arg-type]
    assert await chosen(router, [a, b], generate("same prompt", 2)) == "b"  # the next turn
    assert decisions == ["a", "b"]
    stuck = generate("same prompt", 3)
    asks = [await chosen(router, [a, b], stuck) for _ in range(STICKY_ASKS + 1)]
    assert asks == ["a"] * STICKY_ASKS + ["b"]  # then chosen afresh
    gone = generate("same prompt", 4)
    assert await chosen(router, [a, b], gone) == "a"
    assert await chosen(router, [b], gone) == "b"  # its replica left: chosen afresh
    assert decisions == ["a", "b", "a", "b", "a", "b"]


async def test_other_methods_and_bad_requests_go_to_the_least_loaded() -> None:
    """GetModelInfo and an undecodable prompt are not routed by prefix: least loaded wins."""
    router = make_router(router="prefix")
    a, b = replica("a"), replica("b")
    router.on_request_routed(generate("", 9), a.replica_id, None)  # type: ignore[arg-type]
    info = generate("x", 1, method="GetModelInfo")
    assert await chosen(router, [a, b], info) == "b"
    router.on_request_routed(info, b.replica_id, None)  # type: ignore[arg-type]
    router.on_request_completed(b.replica_id, "i1")  # type: ignore[arg-type]
    broken = PendingRequest(args=[b"not a pickle"], kwargs={}, metadata=RequestMetadata("r", "i"))
    broken.metadata.call_method = "Generate"
    assert await chosen(router, [a, b], broken) == "b"


async def test_a_chosen_request_counts_as_load_until_it_is_routed_or_its_hold_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray reports a request routed only once the replica's accept comes back, and the replica
    may run it before: requests chosen meanwhile see it as load (a burst alternates, not all
    to one replica). Its routing moves it to the in-flight count once (not twice); a choice
    never routed stops counting after HOLD_S; a refused try's end takes nothing off the
    replica's count."""
    import cluster.ray_router as ray_router

    clock = [1000.0]
    monkeypatch.setattr(ray_router.time, "monotonic", lambda: clock[0])
    router = make_router(router="prefix")
    a, b = replica("a"), replica("b")
    prompts = [generate(f"{n} of a burst", n) for n in range(6)]  # no shared prefix
    assert [await chosen(router, [a, b], pr) for pr in prompts] == ["a", "b"] * 3
    router.on_request_routed(prompts[0], a.replica_id, None)  # type: ignore[arg-type]
    router.on_request_routed(prompts[1], b.replica_id, None)  # type: ignore[arg-type]
    assert dict(router._in_flight) == {"a": 1, "b": 1} and dict(router._held) == {"a": 2, "b": 2}
    router.on_request_completed(a.replica_id, "i4")  # type: ignore[arg-type]  # refused: not sent
    assert router._in_flight["a"] == 1 and router._held["a"] == 2
    assert await chosen(router, [a, b], generate("one more", 6)) == "a"  # 3 and 3: ties to a
    clock[0] += ray_router.HOLD_S + 1  # the five never routed no longer count: 1 and 1
    late = await chosen(router, [a, b], generate("and another", 7))
    assert dict(router._held) == {late: 1} and dict(router._in_flight) == {"a": 1, "b": 1}


async def test_cost_routing_learns_prices_and_the_shared_tier() -> None:
    """The cost router takes the mean of the replicas' reported step-cost models as its price
    and their restore time per block; a completed request's keys become shared-tier hits, so
    the same prompt then goes to the idle replica, which restores it (the prefix router would
    keep it where it ran)."""
    router = make_router(router="cost", shared_tier_blocks=1024, chunk_tokens=64)
    model = [0.01, 1e-3, 0.0, 0.0, 0.0, 0.0]  # 10 ms + 1 ms a token per step
    a = replica("a", keys=[7], cost_model_s=model, restore_s_per_block=1e-4)
    b = replica("b", keys=[8], cost_model_s=[2 * c for c in model], restore_s_per_block=3e-4)
    prompt = "a prompt that is routed twice, long enough for blocks " * 2
    assert await chosen(router, [a, b], generate(prompt, 1)) == "a"
    assert isinstance(router.router, GuardedRouter)
    cost = router.router.score
    assert isinstance(cost, CostScore) and isinstance(cost.price, CostModelPrice)
    assert cost.price.model.coefficients_s == pytest.approx([0.015, 1.5e-3, 0, 0, 0, 0])
    assert cost.restore_s_per_block == pytest.approx(2e-4)
    router.on_request_routed(generate("", 1), a.replica_id, None)  # type: ignore[arg-type]
    router.on_request_completed(a.replica_id, "i1")  # type: ignore[arg-type]
    keys = routing_keys(ByteTokenizer().encode(prompt), 4, None)
    assert cost.shared is not None and cost.shared.chain_length(keys) == len(keys)
    # "a" still has the first one's backlog; "b" restores the whole prefix for less.
    assert await chosen(router, [a, b], generate(prompt, 2)) == "b"


def test_a_model_that_does_not_price_more_tokens_higher_is_not_used() -> None:
    """A reported model whose longer prefill is not dearer (fitted to noise) is ignored, and
    so are malformed reports; restore prices come only from replicas that restored."""
    flat = [0.01, 0.0, 0.0, 0.0, 0.0, 0.0]
    price, restore = prices_from_reports(
        [{"cost_model_s": flat}, {"restore_s_per_block": 0}, {}], chunk_tokens=64
    )
    assert price is None and restore is None
    price, _ = prices_from_reports([{"cost_model_s": ["x"] * 6}], chunk_tokens=64)
    assert price is None


def test_targets_advertise_a_reachable_address() -> None:
    """A wildcard bind is listed as this node's IP; a concrete host as itself."""
    from ray.util import get_node_ip_address

    from cluster.metrics import advertised_host

    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("0.0.0.0") == get_node_ip_address() != "0.0.0.0"


class _GrpcContext:
    """What the router reads of Ray's gRPC context: the caller's metadata and address."""

    def __init__(self, key: str) -> None:
        self.key = key

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.key}")]

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"


def call(method: str, message: Any, key: str, n: int) -> PendingRequest:
    """The gRPC proxy's call ``method`` with ``message``, from the holder of ``key``."""
    arg = pickle.dumps(gRPCRequest(user_request_proto=message))
    metadata = RequestMetadata(f"r{n}", f"i{n}", method)
    metadata.grpc_context = _GrpcContext(key)  # type: ignore[assignment]
    return PendingRequest(args=[arg], kwargs={}, metadata=metadata)


async def test_abort_and_a_duplicate_id_go_where_the_request_runs() -> None:
    """Alice's "x" runs on a (round robin's first pick, a busy replica): her Aborts of "x"
    and her second "x" go to a, whatever the router would pick; Bob's "x" is routed as any
    request; the duplicate ending leaves the first "x" found; once "x" completed, Alice's
    Abort goes to the least loaded replica."""
    router = make_router(router="round-robin", auth=True)
    a, b = replica("a"), replica("b")
    router.on_request_routed(generate("", 0), a.replica_id, None)  # type: ignore[arg-type]
    first = call("Generate", pb.GenerateRequest(text="x", request_id="x"), "alice", 1)
    assert await chosen(router, [a, b], first) == "a"  # round robin: a, then b
    router.on_request_routed(first, a.replica_id, None)  # type: ignore[arg-type]
    for n in range(2, 5):
        abort = call("Abort", pb.AbortRequest(request_id="x"), "alice", n)
        assert await chosen(router, [a, b], abort) == "a"
    again = call("Generate", pb.GenerateRequest(text="x", request_id="x"), "alice", 5)
    assert await chosen(router, [a, b], again) == "a"
    router.on_request_routed(again, a.replica_id, None)  # type: ignore[arg-type]
    router.on_request_completed(a.replica_id, "i5")  # type: ignore[arg-type]  # refused
    bobs = call("Generate", pb.GenerateRequest(text="x", request_id="x"), "bob", 6)
    assert await chosen(router, [a, b], bobs) == "b"
    router.on_request_routed(bobs, b.replica_id, None)  # type: ignore[arg-type]
    router.on_request_completed(b.replica_id, "i6")  # type: ignore[arg-type]
    abort = call("Abort", pb.AbortRequest(request_id="x"), "alice", 7)
    assert await chosen(router, [a, b], abort) == "a"  # the duplicate's end kept the first
    router.on_request_completed(a.replica_id, "i1")  # type: ignore[arg-type]
    router.on_request_completed(a.replica_id, "i0")  # type: ignore[arg-type]
    abort = call("Abort", pb.AbortRequest(request_id="x"), "alice", 8)
    assert await chosen(router, [a, b], abort) == "a"  # least loaded now: ties to "a"
    router.on_request_routed(generate("", 9), a.replica_id, None)  # type: ignore[arg-type]
    abort = call("Abort", pb.AbortRequest(request_id="x"), "alice", 10)
    assert await chosen(router, [a, b], abort) == "b"


async def test_an_adapters_prompt_follows_its_own_keys() -> None:
    """A Generate call naming an adapter is keyed with the adapter's salt, the key of its
    weights learned from the replicas' reports: it goes where that adapter's prefix is, not
    where the base model's same prompt is (and vice versa)."""
    from scheduler.request import LoraRef
    from server.lora import cache_salt_with

    router = make_router(router="prefix")
    prompt = "shared prefix shared prefix shared"
    ids = ByteTokenizer().encode(prompt)
    adapter_salt = cache_salt_with(None, LoraRef("sql", "sql@abc"))
    base_keys, sql_keys = routing_keys(ids, 4, None), routing_keys(ids, 4, adapter_salt)
    assert not set(base_keys) & set(sql_keys)
    a = replica("a", keys=base_keys, adapters={"sql": "sql@abc"})
    b = replica("b", keys=sql_keys, adapters={"sql": "sql@abc"})

    def adapter_call(adapter: str, n: int) -> PendingRequest:
        request = pb.GenerateRequest(text=prompt, adapter=adapter)
        arg = pickle.dumps(gRPCRequest(user_request_proto=request))
        return PendingRequest(
            args=[arg], kwargs={}, metadata=RequestMetadata(f"r{n}", f"i{n}", "Generate")
        )

    assert await chosen(router, [a, b], adapter_call("sql", 1)) == "b"
    assert await chosen(router, [a, b], adapter_call("", 2)) == "a"


@pytest.mark.parametrize("share_prefix_cache", [False, True])
async def test_the_router_keys_a_prompt_as_its_replica_caches_it(share_prefix_cache: bool) -> None:
    """API keys on, a client's cache_salt and an adapter: the keys the router gives Alice's
    gRPC Generate call are the keys a replica reports for the request its front admits (owner,
    the salt's digest, the adapter: server.identity), so the call follows them to b. Bob's same
    request is another tenant's prefix (it goes to a), unless tenants share the prefix cache."""
    from cluster.replica import _ArrivalKeys
    from model_runner.lora.info import AdapterInfo
    from server.auth import Security
    from server.frontend import Frontend, ServedModel
    from server.lora import Adapters

    security = Security(api_keys=frozenset({"alice", "bob"}), share_prefix_cache=share_prefix_cache)
    sql = AdapterInfo("sql", "/adapters/sql", "peft", 8, 16.0, ("q_proj",), "abc", 0)
    tokenizer = ByteTokenizer()
    model = ServedModel("m", 256, tokenizer.vocab_size, 4, 64, 0, "float32", "cpu", (257,))
    no_engine: Any = None  # engine_request builds the request; nothing reaches an engine
    front = Frontend(no_engine, tokenizer, model, security=security, adapters=Adapters(infos=[sql]))
    message = pb.GenerateRequest(
        text="a shared system prompt, then the question", request_id="q",
        cache_salt="session 7", adapter="sql",
    )  # fmt: skip
    admitted = await front.engine_request(message, security.owner("Bearer alice", "10.0.0.9"))
    arrivals = _ArrivalKeys(capacity=64, block_size=4)
    arrivals.add(admitted)
    reported = arrivals.snapshot()
    assert admitted.cache_salt is not None and len(reported) == len(admitted.prompt_token_ids) // 4

    router = make_router(router="prefix", auth=True, share_prefix_cache=share_prefix_cache)
    a, b = replica("a"), replica("b", keys=reported, adapters={"sql": sql.key})
    assert await chosen(router, [a, b], call("Generate", message, "alice", 1)) == "b"
    assert router._keys_of["i1"] == reported
    bobs = await chosen(router, [a, b], call("Generate", message, "bob", 2))
    assert bobs == ("b" if share_prefix_cache else "a")
