"""Builders for server tests: a real grpc.aio server on 127.0.0.1:0 over a FakeRunner."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from cache_manager import KVCacheConfig, KVCacheManager, block_bytes
from metrics.records import RequestRecord, StepRecord
from model_runner.base import ModelInfo, Runner
from model_runner.fake import FakeRunner
from scheduler import Scheduler, SchedulerConfig
from scheduler.output import ModelOutput, SchedulerOutput
from server.auth import Security, client_id, scoped_id
from server.client import KVServeClient
from server.engine import EngineLoop
from server.fake_tokenizer import ByteTokenizer
from server.frontend import ServedModel
from server.lifecycle import KVServeServer
from server.text import make_text_stream_factory

BLOCK_SIZE = 4
NUM_BLOCKS = 256
MAX_MODEL_LEN = 128


class RecordingSink:
    """A MetricsSink that keeps every record (thread-safe appends)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: list[StepRecord] = []
        self.requests: list[RequestRecord] = []
        self.rejected: list[str] = []
        self.rpcs: list[tuple[str, str]] = []
        self.connection_events: list[tuple[str, str]] = []
        self.transfers: list[tuple[str, int, int, float]] = []

    def on_step(self, record: StepRecord) -> None:
        with self.lock:
            self.steps.append(record)

    def on_request_done(self, record: RequestRecord) -> None:
        with self.lock:
            self.requests.append(record)

    def on_rejected(self, reason: str) -> None:
        with self.lock:
            self.rejected.append(reason)

    def on_rpc(self, method: str, code: str) -> None:
        with self.lock:
            self.rpcs.append((method, code))

    def on_connection_event(self, server: str, event: str) -> None:
        with self.lock:
            self.connection_events.append((server, event))

    def on_kv_transfer(self, outcome: str, num_blocks: int, num_bytes: int, seconds: float) -> None:
        with self.lock:
            self.transfers.append((outcome, num_blocks, num_bytes, seconds))

    def request(self, request_id: str) -> RequestRecord:
        with self.lock:
            # The engine scopes ids by caller ("peer:127.0.0.1/cx"): match the client's part.
            found = [r for r in self.requests if client_id(r.request_id) == request_id]
        assert len(found) == 1, f"{request_id}: {len(found)} records"
        return found[0]


def fake_info(max_model_len: int = MAX_MODEL_LEN) -> ModelInfo:
    from cache_manager.sizing import ModelShape

    tok = ByteTokenizer()
    return ModelInfo(
        name="fake",
        vocab_size=tok.vocab_size,
        max_model_len=max_model_len,
        shape=ModelShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype_bytes=4, name="fake"),
        eos_token_ids=tok.eos_token_ids,
        bos_token_id=tok.bos_token_id,
    )


def make_fake_runner(max_model_len: int = MAX_MODEL_LEN, **kwargs: Any) -> FakeRunner:
    """A FakeRunner over the byte tokenizer's vocabulary (258 ids, EOS 257)."""
    kwargs.setdefault("verify_kv_block_size", BLOCK_SIZE)
    return FakeRunner(fake_info(max_model_len), **kwargs)


def make_gated_runner(max_model_len: int = MAX_MODEL_LEN, **kwargs: Any) -> GatedRunner:
    """``make_fake_runner``'s runner with a gate on its steps (``GatedRunner``)."""
    kwargs.setdefault("verify_kv_block_size", BLOCK_SIZE)
    return GatedRunner(fake_info(max_model_len), **kwargs)


class GatedRunner(FakeRunner):
    """A FakeRunner whose steps wait at a gate while it is closed: a test holds the engine
    inside a step for as long as it looks, instead of hoping a sleep lasts long enough.

    ``close()`` then ``await wait_until(runner.is_held)``: the engine thread is inside
    ``execute`` and stays there until ``open()``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gate = threading.Event()
        self._gate.set()
        self._held = threading.Event()

    def close(self) -> None:
        self._gate.clear()

    def open(self) -> None:
        self._gate.set()

    def is_held(self) -> bool:
        return self._held.is_set()

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        if not self._gate.is_set():
            self._held.set()
            self._gate.wait()
            self._held.clear()
        return super().execute(plan)


@dataclass
class Harness:
    server: KVServeServer
    engine: EngineLoop
    scheduler: Scheduler
    runner: Any
    sink: RecordingSink
    client: KVServeClient
    address: str
    tokenizer: Any = field(default_factory=ByteTokenizer)
    http_url: str = ""  # http://127.0.0.1:PORT when started with http=True

    @property
    def channel(self) -> grpc.aio.Channel:
        return self.client.channel


def build_server(
    runner: Runner,
    tokenizer: Any,
    *,
    num_blocks: int | None = None,
    block_size: int = BLOCK_SIZE,
    enable_prefix_caching: bool = True,
    max_n: int = 8,
    security: Security | None = None,
    engine_options: dict[str, Any] | None = None,
    server_options: dict[str, Any] | None = None,
    **scheduler_config: Any,
) -> tuple[KVServeServer, EngineLoop, Scheduler, RecordingSink]:
    info = runner.info
    # A real runner owns a KV pool of a fixed size: the cache manager must match it.
    num_blocks = num_blocks or getattr(runner, "num_blocks", None) or NUM_BLOCKS
    scheduler_config.setdefault("max_model_len", info.max_model_len)
    scheduler_config.setdefault("max_num_seqs", 64)
    scheduler_config.setdefault("max_num_batched_tokens", 1024)
    per_block = block_bytes(info.shape, block_size)
    kv = KVCacheManager(
        KVCacheConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            block_bytes=per_block,
        )
    )
    scheduler = Scheduler(SchedulerConfig(**scheduler_config), kv)
    sink = RecordingSink()
    engine = EngineLoop(
        scheduler, runner, make_text_stream_factory(tokenizer), sink=sink, **(engine_options or {})
    )
    model = ServedModel(
        name=info.name,
        max_model_len=scheduler_config["max_model_len"],
        vocab_size=info.vocab_size,
        block_size=block_size,
        num_blocks=num_blocks,
        kv_memory_bytes=num_blocks * per_block,
        dtype=info.dtype,
        device=info.device,
        eos_token_ids=tuple(info.eos_token_ids),
        max_n=max_n,
    )
    options = {"adapters": runner.adapters, **(server_options or {})}
    server = KVServeServer(engine, tokenizer, model, sink=sink, security=security, **options)
    return server, engine, scheduler, sink


@asynccontextmanager
async def serve(
    runner: Runner | None = None,
    tokenizer: Any = None,
    *,
    http: bool = False,
    channel: Callable[[str], grpc.aio.Channel] | None = None,
    **kwargs: Any,
) -> AsyncIterator[Harness]:
    """A started server on 127.0.0.1:0 (and its HTTP front on another free port with
    ``http=True``) and a connected client (over ``channel(address)`` when given); stopped on
    exit."""
    runner = runner if runner is not None else make_fake_runner()
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    server, engine, scheduler, sink = build_server(runner, tokenizer, **kwargs)
    port = await server.start("127.0.0.1", 0, http_port=0 if http else None)
    address = f"127.0.0.1:{port}"
    client = KVServeClient(address, channel=None if channel is None else channel(address))
    scheme = "https" if server.security.tls is not None else "http"
    http_url = f"{scheme}://127.0.0.1:{server.http_port}" if http else ""
    try:
        if channel is None:
            await client.wait_ready()
        yield Harness(server, engine, scheduler, runner, sink, client, address, tokenizer, http_url)
    finally:
        await client.close()
        if channel is not None:
            await client.channel.close()
        await server.shutdown(grace_s=0.5)


@contextmanager
def serve_in_thread(**kwargs: Any) -> Iterator[Harness]:
    """``serve(**kwargs)`` on an event loop of its own thread, for synchronous clients (a
    hypothesis test, schemathesis)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server", daemon=True)
    thread.start()
    served = serve(**kwargs)
    try:
        yield asyncio.run_coroutine_threadsafe(served.__aenter__(), loop).result(60)
    finally:
        try:
            asyncio.run_coroutine_threadsafe(served.__aexit__(None, None, None), loop).result(60)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


def assert_idle_and_sound(h: Harness, timeout_s: float = 60.0) -> None:
    """Wait until no request runs, waits or holds a block, then check the cache manager's
    invariants (safe from another thread: an idle engine does not touch them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = h.engine.latest_stats
        if stats.num_running == stats.num_waiting == stats.kv.num_blocks_used == 0:
            break
        assert time.monotonic() < deadline, f"not idle after {timeout_s}s: {stats}"
        time.sleep(0.005)
    h.scheduler.kv.check_invariants()


# Who a plaintext, keyless client on this machine is: its requests' engine ids start with it.
LOCAL_OWNER = "peer:127.0.0.1"


def engine_id(request_id: str, owner: str | None = LOCAL_OWNER) -> str:
    """The engine's (and so the FakeRunner's) id of a client's request; ``owner=None``: the
    id as it is (a test that drives the engine without a front end)."""
    return request_id if owner is None else scoped_id(owner, request_id)


def expected_tokens(
    runner: FakeRunner, request_id: str, num_tokens: int, owner: str | None = LOCAL_OWNER
) -> list[int]:
    """The FakeRunner's documented token rule for the client request ``request_id``
    (unscripted), as the engine names it (scoped by ``owner``)."""
    return [runner.default_token(engine_id(request_id, owner), i) for i in range(num_tokens)]


async def wait_until(
    predicate: Callable[[], Awaitable[bool]] | Callable[[], bool],
    timeout_s: float = 60.0,
    interval_s: float = 0.01,
) -> float:
    """Poll until ``predicate()`` is true; returns the seconds it took, raises on timeout.

    Wait on the condition a test checks, never sleep and then assert: ``timeout_s`` is only
    the safety net against a hang, long enough for a machine whose cores are all busy."""
    start = time.monotonic()
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(interval_s)


async def collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in stream]


async def closed_after(reader: asyncio.StreamReader, limit_s: float) -> float:
    """Seconds until the server closed the connection (EOF); everything before it is read."""
    start = time.monotonic()
    async with asyncio.timeout(limit_s):
        while await reader.read(65536):
            pass
    return time.monotonic() - start


async def hostile_connections(
    port: int, served_request: bytes, cut_body: bytes, limit_s: float
) -> tuple[bytes, list[float]]:
    """Four connections to an HTTP port on 127.0.0.1: one that sends nothing, one that sends
    its headers a byte every 0.1 s, one whose body stops (``cut_body``: headers promising
    more than follows), and one idle after ``served_request`` was answered. The answer's head
    and the seconds until the server closed each (at most ``limit_s``)."""
    silent, slow_header, slow_body, idle = [
        await asyncio.open_connection("127.0.0.1", port) for _ in range(4)
    ]
    idle[1].write(served_request)
    head = await idle[0].readuntil(b"\r\n\r\n")
    slow_body[1].write(cut_body)

    async def drip() -> None:
        for byte in b"GET /health HTTP/1.1\r\nhost: x\r\n":
            slow_header[1].write(bytes([byte]))
            await asyncio.sleep(0.1)

    dripping = asyncio.create_task(drip())
    closed = await asyncio.gather(
        *(closed_after(r, limit_s) for r, _ in (silent, slow_header, slow_body, idle))
    )
    dripping.cancel()
    return head, list(closed)
