"""Config assembly: ServerConfig -> runner, KV cache manager, scheduler, engine loop.

The torch runner and the model loader are imported only when ``runner == "torch"``, so
``kvserve serve --runner fake`` starts without torch.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cache_manager import KVCacheConfig, KVCacheManager, block_bytes
from cache_manager.hybrid import HybridKVCacheManager, window_blocks_for
from cache_manager.sizing import num_blocks_for_budget
from metrics.records import MetricsSink, NullSink
from model_runner.base import Runner
from model_runner.config import ModelConfig, RunnerOptions
from model_runner.constraints import ConstraintCompiler, ConstraintTracker
from model_runner.fake import FakeRunner, make_fake_info
from model_runner.sim import roofline_cost_model
from scheduler import Scheduler
from server.calibration import calibrate
from server.config import ServerConfig, parse_bytes
from server.engine import EngineLoop
from server.fake_tokenizer import ByteTokenizer
from server.frontend import ServedModel, ServerTokenizer
from server.kv_tier import KVTier, open_kv_tier
from server.text import make_text_stream_factory

if TYPE_CHECKING:
    from model_runner.base import AdapterSource

logger = logging.getLogger(__name__)

FAKE_DEFAULT_NUM_BLOCKS = 4096
FAKE_DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(slots=True)
class BuiltEngine:
    """Everything ``serve`` runs, not started yet."""

    engine: EngineLoop
    runner: Runner
    scheduler: Scheduler
    tokenizer: ServerTokenizer
    model: ServedModel
    source: str  # where the weights came from ("fake" for the fake runner)
    adapters: AdapterSource | None = None  # the runner's LoRA adapters (Runner.adapters)


def constraint_tracker(tokenizer: object, vocab_size: int) -> ConstraintTracker | None:
    """Structured outputs over ``tokenizer`` (None, logged, when its tokens have no bytes
    view, e.g. a tokenizer that is not byte-level)."""
    try:
        return ConstraintTracker(ConstraintCompiler(tokenizer, vocab_size))  # type: ignore[arg-type]
    except ValueError as exc:
        logger.warning("structured outputs are off: %s", exc)
        return None


def _fake_runner(cfg: ServerConfig) -> tuple[Runner, ServerTokenizer, int, str]:
    tokenizer = ByteTokenizer()
    info = make_fake_info(
        vocab_size=tokenizer.vocab_size,
        max_model_len=cfg.max_model_len or FAKE_DEFAULT_MAX_MODEL_LEN,
        eos_token_ids=tokenizer.eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
    )
    info = dataclasses.replace(info, sliding_window=cfg.sliding_window)
    runner = FakeRunner(
        info,
        sleep_s=cfg.fake_step_sleep_s,
        sleep_per_token_s=cfg.fake_token_sleep_s,
        crash_at_step=cfg.fake_crash_at_step,
        constraints=constraint_tracker(tokenizer, info.vocab_size),
        step_thread=cfg.overlap is True,  # the fake device
    )
    if cfg.num_blocks is not None:
        num_blocks = cfg.num_blocks
    elif cfg.kv_memory_bytes is not None:
        num_blocks = num_blocks_for_budget(info.shape, cfg.block_size, cfg.kv_memory_bytes)
    else:
        num_blocks = FAKE_DEFAULT_NUM_BLOCKS
    return runner, tokenizer, num_blocks, "fake"


def runner_options(
    cfg: ServerConfig, name: str | None = None, model: ModelConfig | None = None
) -> RunnerOptions:
    """The torch runner's options, from the server's flags (built once, at start-up), for
    ``model`` when it is known (it decides ``sliding_layer_blocks``)."""
    return RunnerOptions(
        num_blocks=cfg.num_blocks,
        block_size=cfg.block_size,
        kv_budget_bytes=cfg.kv_memory_bytes,
        kv_dtype=cfg.kv_dtype,
        dtype=cfg.dtype,
        device=cfg.device,
        max_model_len=cfg.max_model_len,
        sliding_window=cfg.sliding_window,
        attention_sinks=cfg.attention_sinks,
        attention_backend=cfg.attention_backend,
        activation_bits=cfg.activation_bits,
        max_decode_rows=cfg.scheduler_config(cfg.max_model_len or 1).max_decode_rows,
        name=name,
        max_lora_rank=cfg.max_lora_rank,
        max_cpu_loras=cfg.cpu_lora_budget,
        sliding_layer_blocks=sliding_layer_blocks(cfg, model) if model is not None else 0,
    )


def sliding_layer_blocks(cfg: ServerConfig, model: ModelConfig) -> int:
    """The sliding layers' own pool for ``model`` under ``cfg`` (``cache_manager.hybrid``):
    blocks for ``max_num_seqs`` requests each holding its window, or 0 when its layers all
    attend alike or something it does not run with is on (logged)."""
    windows = {w for w in model.layer_windows if w is not None}
    if cfg.sliding_layer_blocks == "off" or len(windows) != 1 or None not in model.layer_windows:
        return 0
    from model_runner.device import select_device

    on_cuda = select_device(cfg.device).type == "cuda"
    off = [
        what
        for what, on in (
            ("the disk KV tier", cfg.kv_disk_dir is not None),
            ("attention sinks", cfg.attention_sinks > 0),
            ("--sliding-window", cfg.sliding_window is not None),
            ("the adaptive KV strategy", cfg.kv_strategy == "adaptive"),
            (
                f"the {cfg.attention_backend} attention backend",
                cfg.attention_backend not in ("auto", "torch")
                or (cfg.attention_backend == "auto" and on_cuda),
            ),
        )
        if on
    ]
    if off:
        logger.info("sliding layers' own blocks off: %s", ", ".join(off))
        return 0
    max_len = min(model.max_position_embeddings, cfg.max_model_len or model.max_position_embeddings)
    (window,) = windows
    chunk = cfg.scheduler_config(max_len).max_chunk_tokens
    return window_blocks_for(cfg.max_num_seqs, max_len, window, cfg.block_size, chunk)


def _torch_runner(cfg: ServerConfig) -> tuple[Runner, ServerTokenizer, int, str]:
    from model_runner.device import configure_threads, resolve_dtype, select_device
    from model_runner.loader import load_model, return_freed_memory
    from model_runner.runner import TorchRunner

    configure_threads(cfg.threads)
    dtype = resolve_dtype(cfg.dtype, select_device(cfg.device))
    loaded = load_model(cfg.model, dtype, weights=cfg.weights, device=cfg.device)
    runner = TorchRunner(
        loaded.config,
        loaded.state_dict,
        runner_options(cfg, loaded.name, loaded.config),
        constraints=constraint_tracker(loaded.tokenizer, loaded.config.vocab_size),
    )
    if runner.device.type == "cpu" and cfg.overlap is True:
        runner.use_step_thread()  # steps on their own thread: the engine plans meanwhile
    del loaded.state_dict  # the runner holds its own copy of the weights
    return_freed_memory()  # the fused projections' parts, freed into malloc's arenas
    return runner, loaded.tokenizer, runner.num_blocks, str(loaded.source_path)


def _cache_manager(
    cfg: ServerConfig, config: KVCacheConfig, extra: dict[str, str], max_model_len: int
) -> KVCacheManager:
    """One table a request, or the global and the sliding layers' tables when the runner
    keeps the sliding layers' KV apart (``ModelInfo.extra``'s ``sliding_layer_*``)."""
    num_window = int(extra.get("sliding_layer_blocks", "0"))
    if not num_window:
        return KVCacheManager(config)
    num_layers, num_sliding = int(extra["num_layers"]), int(extra["sliding_layers"])
    per_layer = config.block_bytes // num_layers
    window = dataclasses.replace(
        config,
        num_blocks=num_window,
        sliding_window=int(extra["sliding_layer_window"]),
        block_bytes=per_layer * num_sliding,
    )
    config = dataclasses.replace(config, block_bytes=per_layer * (num_layers - num_sliding))
    chunk = cfg.scheduler_config(max_model_len).max_chunk_tokens
    return HybridKVCacheManager(config, window, chunk)


def build_engine(cfg: ServerConfig, sink: MetricsSink | None = None) -> BuiltEngine:
    """Load the model (or the fake runner), size the KV cache and wire up the engine."""
    if cfg.runner == "fake":
        if cfg.lora:
            raise ValueError("--lora needs the torch runner: the fake runner has no weights")
        runner, tokenizer, num_blocks, source = _fake_runner(cfg)
    else:
        runner, tokenizer, num_blocks, source = _torch_runner(cfg)
    adapters = runner.adapters
    for name, path in cfg.lora_modules() if adapters is not None else ():
        info = adapters.load(name, path)
        logger.info(
            "LoRA adapter %s: %s, rank %d, %s", name, path, info.rank,
            "+".join(info.target_modules),
        )  # fmt: skip
    info = runner.info
    max_model_len = min(info.max_model_len, cfg.max_model_len or info.max_model_len)
    per_block = block_bytes(info.shape, cfg.block_size)
    check_sinks_fit(cfg.attention_sinks, info.sliding_window, max_model_len)
    cache_config = cfg.cache_config(num_blocks, info.sliding_window, per_block)

    def make_kv(config: KVCacheConfig) -> KVCacheManager:
        return _cache_manager(cfg, config, info.extra, max_model_len)

    kv = make_kv(cache_config)
    cost_model = None
    if cfg.policy == "slo":
        if cfg.cost_model_prior == "calibrate":
            cost_model = calibrate(runner, cache_config, max_model_len, make_kv=make_kv)
        else:
            cost_model = roofline_cost_model(cfg.cost_model_prior)
    scheduler = Scheduler(cfg.scheduler_config(max_model_len), kv, cost_model)
    kv_tier = _kv_tier(cfg, kv, runner, source)
    engine = EngineLoop(
        scheduler,
        runner,
        make_text_stream_factory(tokenizer),
        sink=sink,
        cost_model=cost_model,
        max_unread_outputs=cfg.max_unread_outputs,
        stalled_stream_timeout_s=cfg.stalled_stream_timeout_s,
        kv_tier=kv_tier,
        max_step_failures=cfg.max_step_failures,
        overlap=cfg.overlap,
    )
    model = ServedModel(
        name=info.name,
        max_model_len=max_model_len,
        vocab_size=info.vocab_size,
        block_size=cfg.block_size,
        num_blocks=num_blocks,
        kv_memory_bytes=num_blocks * per_block,
        dtype=info.dtype,
        device=info.device,
        eos_token_ids=tuple(info.eos_token_ids),
        kv_dtype=info.kv_dtype,
        max_n=max_n_for(cfg),
        weights=info.weights,
        weight_bytes=info.weight_bytes,
        streams_past_context=kv.streams_past_context,
    )
    return BuiltEngine(engine, runner, scheduler, tokenizer, model, source, adapters)


def _kv_tier(
    cfg: ServerConfig, kv: KVCacheManager, runner: Runner, source: str
) -> KVTier[Any] | None:
    """Tier 2 when ``--kv-disk-dir`` is set (``server.kv_tier``)."""
    if cfg.kv_disk_dir is None:
        return None
    return open_kv_tier(
        kv,
        runner,
        disk_dir=cfg.kv_disk_dir,
        capacity_bytes=parse_bytes(cfg.kv_disk_bytes),
        store_kind=cfg.kv_disk_store,
        source=source,
        block_size=cfg.block_size,
    )


def check_sinks_fit(attention_sinks: int, sliding_window: int | None, max_model_len: int) -> None:
    """With attention sinks, positions within the cache run up to sinks + window: they must
    stay inside the context the model was trained on."""
    if attention_sinks and sliding_window is None:
        raise ValueError(
            f"--attention-sinks {attention_sinks} needs a window: set --sliding-window "
            "(this model has none of its own)"
        )
    if attention_sinks and sliding_window is not None:
        num_cached = attention_sinks + sliding_window
        if num_cached > max_model_len:
            raise ValueError(
                f"--attention-sinks {attention_sinks} + --sliding-window {sliding_window} = "
                f"{num_cached} tokens exceed the context of {max_model_len}: the cache's "
                "positions must stay within it"
            )


def max_n_for(cfg: ServerConfig) -> int:
    """n > 1 needs the scheduler's fork, which reserve memory mode does not do."""
    if cfg.memory_mode == "reserve":
        return 1
    max_num_seqs: int = cfg.max_num_seqs
    return min(cfg.max_n, max_num_seqs)


def attach_metrics(
    built: BuiltEngine, cfg: ServerConfig, **labels: str
) -> tuple[MetricsSink, Any | None]:
    """The engine's metrics, set as its sink: with ``cfg.metrics`` a ``PrometheusSink`` on a
    registry of its own (returned to serve), whose ``kvserve_model_info`` carries the model's
    facts and ``labels``; otherwise a ``NullSink`` and no registry. ``kvserve serve`` and each
    cluster replica assemble their metrics here."""
    if not cfg.metrics:
        built.engine.sink = NullSink()
        return built.engine.sink, None
    from prometheus_client import CollectorRegistry

    from metrics.prometheus import AdapterCollector, PrometheusSink
    from model_runner.lora.info import AdapterCounts

    model = built.model
    registry = CollectorRegistry()
    sink = PrometheusSink(
        registry,
        model_info={
            "model": model.name,
            "dtype": model.dtype,
            "device": model.device,
            "weights": model.weights,
            "weight_bytes": str(model.weight_bytes),
            "kv_dtype": model.kv_dtype,
            "block_size": str(model.block_size),
            "num_blocks": str(model.num_blocks),
            **labels,
        },
        stats=built.engine.latest_stats,  # the pool's sizes are known now: exported at once
        slo_targets_s=(cfg.ttft_slo_ms / 1e3, cfg.itl_slo_ms / 1e3),
    )
    adapters = built.adapters
    # Without adapters (no --lora, the fake runner) the series read 0, as the other counters
    # do before their first event.
    registry.register(
        AdapterCollector(adapters.counts if adapters else lambda: AdapterCounts(0, 0, 0))
    )
    built.engine.sink = sink
    return sink, registry
