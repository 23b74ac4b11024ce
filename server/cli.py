"""``kvserve``: serve, generate, simulate, loadtest.

    kvserve serve [--runner torch|fake] [--port 50051] [--metrics-port 9400] [...]
    kvserve generate [--chat] "What is the capital of France?"
    kvserve simulate ...      (loadtest.simulate: the scheduler on a simulated GPU)
    kvserve loadtest ...      (loadtest.cli: drive a running server)
    kvserve cluster serve ... (cluster.cli: N replicas on Ray Serve, prefix-aware routing)

``serve`` settings come from flags, ``KVSERVE_*`` variables and ``--config`` (see
``server.config``). It exits 0 after a graceful stop (SIGTERM / SIGINT, or with
``--exit-with-parent`` its parent's exit: health NOT_SERVING, new calls refused, in-flight
requests drain for ``--grace-period-s``), 1 when the engine dies (more than
``--max-step-failures`` failed steps in a row, or a failure outside a step) or cannot start,
2 for a bad setting and 130 for a second Ctrl-C (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvserve")

# After the engine died, serve exits within this many seconds whatever still runs.
DEATH_EXIT_S = 10.0

# Subcommands that hand their arguments to another package's main().
_DISPATCH = {
    "simulate": ("loadtest.simulate", "simulate a scheduler on a modelled GPU (no model)"),
    "loadtest": ("loadtest.cli", "drive a running server with a workload and report"),
    "cluster": ("cluster.cli", "serve N replicas on Ray Serve (needs kvserve[ray])"),
}


def _human_bytes(num: int) -> str:
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{num} B"


# ---------------------------------------------------------------------------------- serve
async def _serve(cfg: Any) -> int:
    from server.build import attach_metrics, build_engine
    from server.lifecycle import KVServeServer

    t0 = time.monotonic()
    loop = asyncio.get_running_loop()
    try:
        # Load in a short-lived thread of its own: when it exits, its OpenMP worker pool goes
        # with it. A second live pool would put more OpenMP threads than cores in play, and
        # libgomp then throttles its spin-waiting for every pool: the engine thread's steps
        # measured 1.7x slower on 2 cores (36 vs 21 ms per decode step of SmolLM2).
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-load") as pool:
            built = await loop.run_in_executor(pool, build_engine, cfg)
    except Exception as exc:  # a missing/corrupt checkpoint, a bad size: say what and stop
        logger.debug("start-up failed", exc_info=True)
        print(f"kvserve serve: cannot start: {exc}", file=sys.stderr)
        return 1
    model = built.model
    # The model, the KV block pool and the block tables are tens of thousands of long-lived
    # objects: move them out of the collector's view so a GC pass never walks them mid-step.
    gc.collect()
    gc.freeze()
    try:
        security = cfg.security()
    except OSError as exc:
        print(f"kvserve serve: cannot read the API key file: {exc}", file=sys.stderr)
        return 1
    sink, registry = attach_metrics(built, cfg)
    _say(f"model: {model.name} ({built.source})")
    _say(f"dtype: {model.dtype}  device: {model.device}  runner: {cfg.runner}")
    _say(f"weights: {model.weights}, {_human_bytes(model.weight_bytes)} resident{_backend(built)}")
    _say(
        f"kv cache: {model.num_blocks} blocks x {model.block_size} tokens = "
        f"{model.num_blocks * model.block_size} token slots, {_human_bytes(model.kv_memory_bytes)}"
        f" in {model.kv_dtype}"
        f"; context {model.max_model_len} tokens; prefix caching "
        f"{'on' if cfg.enable_prefix_caching else 'off'}"
    )
    _say(
        f"scheduler: {cfg.policy}, max_num_seqs={cfg.max_num_seqs}, "
        f"max_num_batched_tokens={cfg.max_num_batched_tokens}, queue={cfg.queue_order}, "
        f"memory={cfg.memory_mode}  (loaded in {time.monotonic() - t0:.1f}s)"
    )
    _say(
        f"async scheduling: {'on' if built.engine.overlap else 'off'} (--async-scheduling "
        f"{cfg.async_scheduling})"
    )
    if cfg.policy == "slo":
        _say(
            f"slo: ITL target {cfg.itl_slo_ms:g} ms, TTFT target {cfg.ttft_slo_ms:g} ms; "
            f"step-cost model from {cfg.cost_model_prior}"
        )

    from server.asgi import metrics_app, start_asgi_server
    from server.auth import warn_if_exposed

    server = KVServeServer(
        built.engine, built.tokenizer, model, sink=sink, security=security,
        max_request_bytes=cfg.max_request_bytes, reasoning_parser=cfg.reasoning_parser,
        limits=cfg.edge_limits(), adapters=built.adapters,
    )  # fmt: skip
    port = await server.start(cfg.host, cfg.port, http_port=cfg.http_port if cfg.http else None)
    scheme = "https" if security.tls is not None else "http"
    metrics_server = None
    if registry is not None:
        metrics_server = await start_asgi_server(
            metrics_app(registry, security), cfg.metrics_host, cfg.metrics_port, security,
            limits=server.limits.metrics, on_event=server.sink_connection_event("metrics"),
            name="metrics",
        )  # fmt: skip
        _say(f"metrics on {scheme}://{cfg.metrics_host}:{metrics_server.port}/metrics")
        warn_if_exposed(cfg.metrics_host, security, "metrics")
    warn_if_exposed(cfg.host, security, "kvserve")
    auth = f"{len(security.api_keys)} API keys" if security.api_keys else "no API key"
    _say(f"security: {'TLS' if security.tls else 'plaintext'}, {auth}")
    _say(f"listening on {cfg.host}:{port} (gRPC)")
    if cfg.http:
        _say(f"OpenAI-compatible API on {scheme}://{cfg.host}:{server.http_port}/v1")
    if cfg.port_file:
        write_port_file(cfg.port_file, port)
    if cfg.http_port_file and cfg.http:
        write_port_file(cfg.http_port_file, server.http_port)
    if cfg.metrics_port_file and metrics_server is not None:
        write_port_file(cfg.metrics_port_file, metrics_server.port)

    shutdown_tasks: list[asyncio.Task[None]] = []

    def on_signal(signame: str) -> None:
        if not shutdown_tasks:
            _say(f"{signame}: draining in-flight requests (grace {cfg.grace_period_s:g}s)")
            shutdown_tasks.append(loop.create_task(server.shutdown(cfg.grace_period_s)))
        else:
            _say(f"{signame} again: aborting {server.client.num_in_flight} in-flight requests")
            server.abort_all()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    watch = None
    if cfg.exit_with_parent:
        parent = os.getppid()
        watch = loop.create_task(watch_parent(parent, lambda: on_signal(f"parent {parent} exited")))
    try:
        code = await server.wait()
        if code != 0:
            _say(f"runner died: {built.engine.dead_error!r}; exiting with status {code}")
            exit_within(DEATH_EXIT_S, code)
            await server.close_after_death()
        else:
            _say("stopped")
    finally:
        if watch is not None:
            watch.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if metrics_server is not None:
            await metrics_server.stop()
    return code


def exit_within(seconds: float, code: int) -> None:
    """Bound the way out: ``os._exit(code)`` unless the process exited ``seconds`` from now
    (a thread that never returns, say a runner stuck in the device, would keep it alive)."""

    def force() -> None:
        print(f"kvserve serve: forcing exit {code} after {seconds:g}s", file=sys.stderr, flush=True)
        os._exit(code)

    timer = threading.Timer(seconds, force)
    timer.daemon = True  # runs on while the interpreter joins the threads that hang
    timer.start()


async def watch_parent(
    parent_pid: int, on_exit: Callable[[], None], interval_s: float = 0.5
) -> None:
    """Call ``on_exit`` once the process ``parent_pid`` is no longer this one's parent (it
    exited: the kernel gave this process to init or a subreaper). A watch rather than
    ``PR_SET_PDEATHSIG``, which fires when the *thread* that started us exits, and is Linux's
    only."""
    if parent_pid <= 1:
        logger.warning("--exit-with-parent: started by pid %d, nothing to watch", parent_pid)
        return
    while os.getppid() == parent_pid:
        await asyncio.sleep(interval_s)
    on_exit()


def write_port_file(path: str, port: int) -> None:
    """Write the bound ``port`` to ``path`` for scripts and tests (``kvserve cluster`` too)."""
    tmp = Path(path + ".tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)  # atomic: a reader never sees a partial file


def _backend(built: Any) -> str:
    backend = built.runner.info.linear_backend
    return f" (linear layers: {backend})" if backend else ""


def _say(message: str) -> None:
    print(message, flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from server.config import build_config

    try:
        cfg = build_config(args)
    except (ValueError, OSError) as exc:
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return asyncio.run(_serve(cfg))
    except KeyboardInterrupt:  # a second Ctrl-C while draining
        return 130
    except (OSError, ValueError, FileNotFoundError) as exc:
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------------------- generate
async def _generate(args: argparse.Namespace) -> int:
    import grpc

    from server.client import KVServeClient, NoServerError
    from server.config import client_address
    from server.rpc import generation_pb2 as pb

    address = client_address(args.address)
    prompt = " ".join(args.prompt) if args.prompt else sys.stdin.read()
    options: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "repetition_penalty": args.repetition_penalty,
        "stop": args.stop or None,
        "ignore_eos": args.ignore_eos or None,
    }
    if args.request_id:
        kwargs_id: dict[str, Any] = {"request_id": args.request_id}
    else:
        kwargs_id = {}
    if args.chat:
        messages = [("system", args.system)] if args.system else []
        messages.append(("user", prompt))
        kwargs: dict[str, Any] = {"chat": messages}
        text_prompt: str | None = None
    else:
        kwargs = {}
        text_prompt = prompt
    last = pb.GenerateResponse()
    tls_ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    async with KVServeClient(address, api_key=args.api_key, tls_ca=tls_ca) as client:
        try:
            await client.connect()
            async for response in client.generate(
                text_prompt, timeout_s=args.timeout, **kwargs, **kwargs_id, **options
            ):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                last = response
        except NoServerError as exc:
            print(f"kvserve generate: {exc}", file=sys.stderr)
            return 1
        except grpc.aio.AioRpcError as exc:
            print(f"\nkvserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.verbose:
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        u, t = last.usage, last.timings
        print(
            f"[{reason}] prompt {u.prompt_tokens} tokens ({u.cached_prompt_tokens} cached), "
            f"completion {u.completion_tokens} tokens; ttft {t.time_to_first_token_s:.3f}s, "
            f"total {t.e2e_time_s:.3f}s",
            file=sys.stderr,
        )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_generate(args))
    except KeyboardInterrupt:
        return 130


def _add_generate_arguments(p: argparse.ArgumentParser) -> None:
    from server.client import DEFAULT_TEMPERATURE

    p.add_argument("prompt", nargs="*", help="the prompt (default: read stdin)")
    p.add_argument(
        "--address", default=None, help="server address (default: $KVSERVE_ADDRESS or "
        "127.0.0.1:50051)"
    )  # fmt: skip
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=256, help="(default: %(default)s)")
    p.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        help="0 = greedy, > 0 samples (default: %(default)s, as the Python client; a raw gRPC "
        "request without one samples at 1.0)",
    )
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--request-id", default=None, help="request id (default: server-generated)")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY'")
    p.add_argument("--tls-ca", default=None, help="PEM CA: connect over TLS, trusting it")
    p.add_argument("-v", "--verbose", action="store_true", help="print usage and timings")


# ---------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    from server.config import add_serve_arguments

    parser = argparse.ArgumentParser(
        prog="kvserve", description="Continuous-batching LLM server over a paged KV cache."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = sub.add_parser(
        "serve", help="run the gRPC server",
        description="Run the kvserve gRPC server. Settings: flags > KVSERVE_* environment "
        "variables > --config file > defaults.",
    )  # fmt: skip
    add_serve_arguments(serve)
    gen = sub.add_parser("generate", help="stream a generation from a running server")
    _add_generate_arguments(gen)
    for name, (_, help_text) in _DISPATCH.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DISPATCH:
        module_name = _DISPATCH[argv[0]][0]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            print(f"kvserve {argv[0]}: {module_name} is not installed", file=sys.stderr)
            return 2
        return int(module.main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    return cmd_generate(args)


if __name__ == "__main__":
    sys.exit(main())
