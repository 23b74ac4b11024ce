"""ServerConfig: every knob of ``kvserve serve``, and the ONE place that reads the environment.

Sources, later wins: defaults < config file (``--config``, TOML or JSON) < ``KVSERVE_*``
environment variables < command-line flags. Each field of ``ServerConfig`` is one flag
(``--max-num-seqs``), one variable (``KVSERVE_MAX_NUM_SEQS``) and one file key
(``max_num_seqs`` or ``max-num-seqs``); the table below is the single source for all three.

The scheduler and KV-cache fields are not written here: they are generated from
``SchedulerConfig`` and ``KVCacheConfig`` (type, default; choices from the components'
registries; ``server.config_fields``), and those configs validate them. A new component
field is a new flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cache_manager.config import KVCacheConfig
from kv_store import STORE_KINDS
from model_runner.config import (
    ACTIVATION_BITS,
    ATTENTION_BACKEND_CHOICES,
    KV_DTYPE_CHOICES,
    MODEL_DTYPES,
    WEIGHT_MODES,
    RunnerOptions,
)
from model_runner.environment import PREFIX as ENV_PREFIX
from model_runner.environment import SWITCHES, kvserve_variables
from model_runner.sim import PROFILES as SIM_PROFILES
from scheduler.config import SchedulerConfig
from server.auth import Security, TlsFiles, read_api_keys
from server.config_fields import component_names, option, with_component_fields
from server.http_guard import EdgeLimits, HttpLimits
from server.openai.reasoning import REASONING_PARSERS
from server.validation import DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:50051"

RUNNERS = ("torch", "fake")
ASYNC_SCHEDULING_MODES = ("auto", "on", "off")
# The defaults of the flags the components below take as they come: read from their code.
_RUNNER = RunnerOptions()
_HTTP = HttpLimits()
_EDGE = EdgeLimits()


def _f(default: Any, help_text: str, **kw: Any) -> Any:
    return field(default=default, metadata=option(help_text, **kw))


@dataclass(frozen=True, slots=True)
@with_component_fields
class ServerConfig:
    """Everything ``kvserve serve`` needs; validated at construction. The scheduler and
    KV-cache settings are generated fields (see the module docstring): read them as
    attributes (``cfg.max_num_seqs``) or as the component configs (``scheduler_config``)."""

    if TYPE_CHECKING:  # the generated fields

        def __getattr__(self, name: str) -> Any: ...

    # -- server
    host: str = _f("127.0.0.1", "address to listen on")
    port: int = _f(50051, "gRPC port (0 picks a free port)")
    port_file: str | None = _f(None, "write the bound gRPC port to this file once serving")
    metrics_host: str = _f("127.0.0.1", "address of the Prometheus /metrics endpoint")
    metrics: bool = _f(True, "serve Prometheus /metrics on its own port")
    metrics_port: int = _f(9400, "Prometheus port (0 picks a free port)")
    metrics_port_file: str | None = _f(
        None, "write the bound metrics port to this file once serving"
    )
    grace_period_s: float = _f(30.0, "on SIGTERM/SIGINT, let in-flight requests finish this long")
    exit_with_parent: bool = _f(
        False, "stop as on SIGTERM when the process that started serve exits (its pid is "
        "watched every 0.5 s): a server started by a wrapper never outlives it",
    )  # fmt: skip
    log_level: str = _f("info", "logging level", choices=("debug", "info", "warning", "error"))
    # -- HTTP front, TLS, API keys, backpressure (server.openai, server.asgi, server.auth)
    http: bool = _f(True, "serve the OpenAI-compatible HTTP API", group="http and security")
    http_port: int = _f(
        8000, "OpenAI-compatible HTTP port (0 picks a free port)", group="http and security"
    )
    http_port_file: str | None = _f(
        None, "write the bound HTTP port to this file once serving", group="http and security"
    )
    tls_cert: str | None = _f(
        None, "PEM certificate chain: serve gRPC, HTTP and metrics over TLS",
        group="http and security",
    )  # fmt: skip
    tls_key: str | None = _f(None, "PEM private key of --tls-cert", group="http and security")
    tls_client_ca: str | None = _f(
        None, "PEM CA bundle: require client certificates signed by it (mutual TLS)",
        group="http and security",
    )  # fmt: skip
    api_key: tuple[str, ...] = _f(
        (), "API key clients send as 'Authorization: Bearer KEY' (repeatable; env: comma list)",
        group="http and security", repeat=True,
    )  # fmt: skip
    api_key_file: str | None = _f(
        None, "file of API keys, one per line (# comments)", group="http and security"
    )
    metrics_require_key: bool = _f(
        True, "with API keys, /metrics needs an admin key (--admin-api-key)",
        group="http and security",
    )  # fmt: skip
    stalled_stream_timeout_s: float = _f(
        30.0, "abort a request whose client read nothing for this long (its stream is parked)",
        group="http and security",
    )  # fmt: skip
    max_unread_outputs: int = _f(
        64, "outputs a stream may hold unread before its request is parked",
        group="http and security",
    )  # fmt: skip
    max_request_bytes: int = _f(
        DEFAULT_MAX_REQUEST_BYTES, "largest request: an HTTP body (over it: 413, refused "
        "before it is read) or a gRPC message (RESOURCE_EXHAUSTED); gRPC's own default, 4 MiB",
        group="http and security",
    )  # fmt: skip
    reasoning_parser: str = _f(
        "auto", "split a reasoning model's <think> thought from its answer (chat's "
        "reasoning_content, a Responses reasoning item, a Messages thinking block): think, "
        "none, or auto = when the chat template mentions <think>",
        choices=REASONING_PARSERS, group="http and security",
    )  # fmt: skip
    # -- hostile clients and tenants (server.http_guard, server.auth)
    http_max_connections: int = _f(
        0, "open connections on the OpenAI port; at the cap the one idle longest is closed "
        "(0 = half of `ulimit -n` less 128)", group="connections and tenants",
    )  # fmt: skip
    metrics_max_connections: int = _f(
        0, "open connections on the metrics port (0 = 1/16 of `ulimit -n` less 128, 8..64)",
        group="connections and tenants",
    )  # fmt: skip
    grpc_max_connections: int = _f(
        0, "open gRPC connections; over it new ones are closed (0 = 1/4 of `ulimit -n` less 128)",
        group="connections and tenants",
    )  # fmt: skip
    http_header_timeout_s: float = _f(
        _HTTP.header_timeout_s, "close an HTTP connection whose request headers took longer "
        "(gRPC: the HTTP/2 handshake)", group="connections and tenants",
    )  # fmt: skip
    http_body_timeout_s: float = _f(
        _HTTP.body_timeout_s, "close an HTTP connection whose request body took longer",
        group="connections and tenants",
    )  # fmt: skip
    http_idle_timeout_s: float = _f(
        _HTTP.idle_timeout_s, "close a keep-alive HTTP connection idle this long between requests",
        group="connections and tenants",
    )  # fmt: skip
    grpc_idle_timeout_s: float = _f(
        _EDGE.grpc_idle_timeout_s, "close a gRPC connection with no call open this long",
        group="connections and tenants",
    )  # fmt: skip
    admin_api_key: tuple[str, ...] = _f(
        (), "API key that may read /metrics and GetKVCacheStats (the global, every tenant's "
        "figures); other keys are refused them (repeatable; also a valid API key)",
        group="connections and tenants", repeat=True,
    )  # fmt: skip
    share_prefix_cache_across_keys: bool = _f(
        False, "with API keys, share the prefix cache between keys (default: each key's "
        "prompts are salted by the key, so no key can probe another's cache)",
        group="connections and tenants",
    )  # fmt: skip
    # -- model and runner
    runner: str = _f(
        "torch",
        "torch: the real model; fake: scripted tokens (tests)",
        choices=RUNNERS,
        group="model",
    )
    model: str | None = _f(
        None, "GGUF file or Hugging Face directory (default: embedded SmolLM2)", group="model"
    )
    dtype: str | None = _f(
        None,
        f"{' | '.join(MODEL_DTYPES)} (default: the device's best)",
        choices=MODEL_DTYPES,
        group="model",
    )
    device: str | None = _f(
        None, "cpu | cuda | cuda:N (default: cuda when available)", group="model"
    )
    weights: str = _f(
        "auto",
        "auto: a GGUF's own quantization on CPU (kvserve's kernels), else float; float32: "
        "dequantize; native: keep the GGUF's formats that kvserve's kernels hold (the others "
        "dequantize); int8: quantize every matrix per channel",
        choices=WEIGHT_MODES,
        group="model",
    )
    activation_bits: int = _f(
        _RUNNER.activation_bits,
        "quantized weights: the kernels' activation precision; 16: int8 plus a residual byte "
        "(~15 bits, the dequantized model's answers), 8: int8 alone (ggml's; faster prefill)",
        choices=ACTIVATION_BITS,
        group="model",
    )
    attention_backend: str = _f(
        _RUNNER.attention_backend,
        "auto: on CUDA, the fastest backend that can run there and matches torch on a probe "
        "step; elsewhere torch (the reference)",
        choices=ATTENTION_BACKEND_CHOICES,
        group="model",
    )
    threads: int | None = _f(None, "torch CPU threads (default: torch's choice)", group="model")
    # -- LoRA adapters (model_runner.lora; --max-loras is the scheduler's, generated)
    lora: tuple[str, ...] = _f(
        (), "serve a LoRA adapter: NAME=PATH, a PEFT directory or a GGUF LoRA file "
        "(repeatable; env: comma list); requests name it as their model", group="lora",
        repeat=True,
    )  # fmt: skip
    max_lora_rank: int = _f(
        _RUNNER.max_lora_rank, "largest adapter rank accepted (bounds memory and step cost)",
        group="lora",
    )  # fmt: skip
    max_cpu_loras: int | None = _f(
        None, "adapters kept laid out in memory while unused, LRU beyond it; they are read "
        "back from disk when used (default: --max-loras or the --lora count, the larger)",
        group="lora",
    )  # fmt: skip
    max_model_len: int | None = _f(None, "context limit (default: the model's)", group="model")
    fake_step_sleep_s: float = _f(0.0, "fake runner: seconds each step sleeps", group="model")
    fake_token_sleep_s: float = _f(
        0.0, "fake runner: and seconds per scheduled token (a prefill's cost)", group="model"
    )
    fake_crash_at_step: int | None = _f(
        None, "fake runner: raise at this engine step and every one after (a dead device)",
        group="model",
    )  # fmt: skip
    max_step_failures: int = _f(
        3, "failed model steps in a row survived, each failing its requests; one more and "
        "the engine dies and serve exits 1", group="model",
    )  # fmt: skip
    # -- scheduler (and, generated, every SchedulerConfig field but max_model_len)
    max_n: int = _f(16, "largest n (parallel samples) a request may ask for", group="scheduler")
    async_scheduling: str = _f(
        "auto",
        "plan each step while the device runs the one before (vLLM's --async-scheduling, "
        "SGLang's overlap schedule); auto: on a GPU; on: also on CPU, with the model's steps on "
        "a thread of their own; off: one step at a time",
        choices=ASYNC_SCHEDULING_MODES,
        group="scheduler",
    )
    cost_model_prior: str = _f(
        "calibrate",
        "slo: where the step-cost model starts: calibrate (a few seconds of scripted steps at "
        "start-up) or a simulated device's roofline",
        choices=("calibrate", *SIM_PROFILES),
        group="scheduler",
    )
    # -- KV cache (and, generated, block_size, enable_prefix_caching, eviction_policy)
    kv_memory: str | None = _f(
        None, "KV pool budget, e.g. 512MiB, 2GB or bytes (default: the runner's)", group="kv cache"
    )
    num_blocks: int | None = _f(
        None, "KV pool size in blocks (overrides --kv-memory)", group="kv cache"
    )
    sliding_window: int | None = _f(
        None,
        "attention window in tokens (default: the model's own, if any)",
        group="kv cache",
    )
    kv_dtype: str = _f(
        "auto",
        "KV cache precision; auto = float16 on CPU for a float32 model, else the model dtype",
        choices=KV_DTYPE_CHOICES,
        group="kv cache",
    )
    kv_disk_dir: str | None = _f(
        None,
        "tier 2: spill prefix-cache blocks to a store in this directory and restore them on a "
        "hit (shared by the servers of a host, kept across restarts; default: off)",
        group="kv cache",
    )
    kv_disk_bytes: str = _f(
        "4GiB", "tier 2: bound of the store's entries (LRU by last use beyond it)", group="kv cache"
    )
    kv_disk_store: str = _f("lmdb", "tier 2 storage engine", choices=STORE_KINDS, group="kv cache")
    sliding_layer_blocks: str = _f(
        "auto",
        "a model of sliding-window and global layers (Gemma 3): auto keeps the sliding layers' "
        "KV in blocks of their own, freed once out of the window (with the torch attention "
        "backend, without the disk tier, sinks or --sliding-window; else off); off: one block "
        "table for every layer",
        choices=("auto", "off"),
        group="kv cache",
    )

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not (0 <= self.metrics_port <= 65535):
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if not (0 <= self.http_port <= 65535):
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: pass both, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(
                "tls_client_ca needs tls_cert and tls_key (client certificates need TLS)"
            )
        if self.stalled_stream_timeout_s <= 0:
            raise ValueError(
                f"stalled_stream_timeout_s must be > 0, got {self.stalled_stream_timeout_s}"
            )
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_unread_outputs < 2:
            raise ValueError(f"max_unread_outputs must be >= 2, got {self.max_unread_outputs}")
        if self.max_step_failures < 0:
            raise ValueError(f"max_step_failures must be >= 0, got {self.max_step_failures}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s}")
        for name in (
            "threads",
            "max_model_len",
            "num_blocks",
            "fake_crash_at_step",
            "sliding_window",
            "max_cpu_loras",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.edge_limits()  # validates the timeouts and caps
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.fake_step_sleep_s < 0 or self.fake_token_sleep_s < 0:
            raise ValueError(
                f"fake_step_sleep_s and fake_token_sleep_s must be >= 0, got "
                f"{self.fake_step_sleep_s} and {self.fake_token_sleep_s}"
            )
        if self.kv_memory is not None:
            parse_bytes(self.kv_memory)
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        self.lora_modules()
        if parse_bytes(self.kv_disk_bytes) < 1:
            raise ValueError(f"kv_disk_bytes must be >= 1 byte, got {self.kv_disk_bytes!r}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {value!r}")
        # The components validate their own fields (the derived ones get stand-ins here).
        self.scheduler_config(max_model_len=self.max_model_len or 1)
        self.cache_config(num_blocks=2, sliding_window=self.sliding_window or 1, block_bytes=0)

    def security(self) -> Security:
        """TLS files and API keys (reads ``api_key_file``)."""
        tls = None
        if self.tls_cert is not None and self.tls_key is not None:
            tls = TlsFiles(self.tls_cert, self.tls_key, self.tls_client_ca)
        admin_keys = read_api_keys(self.admin_api_key, None)
        return Security(
            api_keys=read_api_keys(self.api_key, self.api_key_file) | admin_keys,
            tls=tls,
            metrics_require_key=self.metrics_require_key,
            admin_keys=admin_keys,
            share_prefix_cache=self.share_prefix_cache_across_keys,
        )

    def edge_limits(self) -> EdgeLimits:
        """Timeouts and connection caps of the three ports (raises ``ValueError``)."""
        timeouts = {
            "header_timeout_s": self.http_header_timeout_s,
            "body_timeout_s": self.http_body_timeout_s,
            "idle_timeout_s": self.http_idle_timeout_s,
        }
        if self.grpc_max_connections < 0:
            raise ValueError(f"grpc_max_connections must be >= 0, got {self.grpc_max_connections}")
        if not self.grpc_idle_timeout_s > 0:
            raise ValueError(f"grpc_idle_timeout_s must be > 0, got {self.grpc_idle_timeout_s}")
        return EdgeLimits(
            http=HttpLimits(max_connections=self.http_max_connections, **timeouts),
            metrics=HttpLimits(max_connections=self.metrics_max_connections, **timeouts),
            grpc_max_connections=self.grpc_max_connections,
            grpc_idle_timeout_s=self.grpc_idle_timeout_s,
            grpc_handshake_timeout_s=self.http_header_timeout_s,
        )

    def lora_modules(self) -> list[tuple[str, str]]:
        """``--lora`` as (name, path) pairs; ``ValueError`` for one without ``=`` or a name
        given twice."""
        pairs: list[tuple[str, str]] = []
        for item in self.lora:
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"--lora {item!r}: use NAME=PATH")
            pairs.append((name.strip(), path.strip()))
        names = [n for n, _ in pairs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"--lora names {', '.join(twice)} more than once")
        return pairs

    @property
    def cpu_lora_budget(self) -> int:
        """Adapters kept resident while unused (``--max-cpu-loras``, or its default)."""
        if self.max_cpu_loras is not None:
            return int(self.max_cpu_loras)
        return max(int(self.max_loras), len(self.lora), 1)

    @property
    def overlap(self) -> bool | None:
        """``--async-scheduling`` decoded: True (on: also on CPU, on a step thread), False
        (off), None (auto: where the runner can run ahead, ``EngineLoop(overlap=)``)."""
        return {"on": True, "off": False}.get(self.async_scheduling)

    @property
    def kv_memory_bytes(self) -> int | None:
        return None if self.kv_memory is None else parse_bytes(self.kv_memory)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's config: the generated fields and the server's context limit."""
        values = {name: getattr(self, name) for name in component_names(SchedulerConfig)}
        return SchedulerConfig(max_model_len=max_model_len, **values)

    def cache_config(
        self, num_blocks: int, sliding_window: int | None, block_bytes: int
    ) -> KVCacheConfig:
        """The cache manager's config: the generated fields and what the model decides."""
        values = {name: getattr(self, name) for name in component_names(KVCacheConfig)}
        return KVCacheConfig(
            num_blocks=num_blocks,
            sliding_window=sliding_window,
            block_bytes=block_bytes,
            kv_tier=self.kv_disk_dir is not None,
            **values,
        )


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip


def parse_bytes(text: str | int) -> int:
    """``"512MiB"`` -> 536870912; ``"2GB"`` -> 2000000000; ``"1000"`` -> 1000."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"not a memory size: {text!r} (use e.g. 512MiB, 2GB or bytes)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 1:
        raise ValueError(f"memory size must be >= 1 byte, got {text!r}")
    return value


def _base_type(f: dataclasses.Field[Any]) -> type:
    hint = typing.get_type_hints(ServerConfig)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]  # type: ignore[no-any-return]
    return hint  # type: ignore[no-any-return]


def _convert(name: str, raw: Any, typ: type, source: str) -> Any:
    """A value from a file, the environment or a flag, as the field's type."""
    if raw is None:
        return None
    if isinstance(raw, str) and raw.strip().lower() in ("", "none", "null") and typ is not str:
        return None
    try:
        if typ is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"expected true/false, got {raw!r}")
        if typ is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError(f"expected an integer, got {raw!r}")
            return int(raw)
        if typ is float:
            return float(raw)
        if typing.get_origin(typ) is tuple:  # a repeatable flag: a list, or "a,b" in the env
            items = raw.split(",") if isinstance(raw, str) else list(raw)
            return tuple(str(x).strip() for x in items if str(x).strip())
        return str(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {name}: {exc}") from None


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def read_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``KVSERVE_*`` variables (prefix stripped, lower case; ``model_runner.environment``
    reads them)."""
    return kvserve_variables(environ)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Keys -> values from a TOML (``.toml``) or JSON file; a ``[serve]`` table is used if
    present, so one file can hold other sections."""
    path = Path(path)
    text = path.read_text()
    data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a table of settings, got {type(data).__name__}")
    if isinstance(data.get("serve"), dict):
        data = data["serve"]
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig field (default None = "not given on the command line")."""
    parser.add_argument(
        "--config", metavar="PATH", default=None,
        help=f"TOML or JSON settings file (env: {env_var('config')})",
    )  # fmt: skip
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(ServerConfig):
        group_name = f.metadata.get("group", "server")
        group = groups.get(group_name)
        if group is None:
            group = groups[group_name] = parser.add_argument_group(group_name)
        flag = "--" + f.name.replace("_", "-")
        typ = _base_type(f)
        if "default" in f.metadata["help"]:  # the help says what the default means
            help_text = f"{f.metadata['help']} (env: {env_var(f.name)})"
        else:
            default = "off" if f.default is None else f.default
            help_text = f"{f.metadata['help']} (default: {default}; env: {env_var(f.name)})"
        if typ is bool:
            group.add_argument(
                flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                help=help_text,
            )  # fmt: skip
        elif f.metadata.get("repeat"):
            group.add_argument(
                flag, dest=f.name, default=None, action="append", metavar=f.name.upper(),
                help=help_text,
            )  # fmt: skip
        else:
            choices = f.metadata.get("choices")
            group.add_argument(
                flag, dest=f.name, default=None, type=typ, choices=choices,
                metavar=None if choices else f.name.upper(), help=help_text,
            )  # fmt: skip


def build_config(
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Merge defaults < config file < environment < flags into a validated ServerConfig."""
    flags = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    env = read_environment(environ)
    known = {f.name: f for f in dataclasses.fields(ServerConfig)}
    values: dict[str, Any] = {}

    config_path = flags.get("config") or env.get("config")
    if config_path:
        for key, raw in read_config_file(config_path).items():
            if key not in known:
                raise ValueError(
                    f"{config_path}: unknown setting {key!r}; known: {', '.join(sorted(known))}"
                )
            values[key] = _convert(key, raw, _base_type(known[key]), str(config_path))
    for key, raw in env.items():
        if key in ("config", "address") or key in SWITCHES:
            continue  # read where they apply (the kernels', the model's: environment.SWITCHES)
        if key not in known:
            logger.warning("ignoring unknown environment variable %s", env_var(key))
            continue
        values[key] = _convert(key, raw, _base_type(known[key]), env_var(key))
    for key, value in flags.items():
        if key in known and value is not None:
            values[key] = tuple(value) if isinstance(value, list) else value
    return ServerConfig(**values)


def client_address(flag: str | None, environ: Mapping[str, str] | None = None) -> str:
    """Where ``kvserve generate`` connects: the flag, else ``KVSERVE_ADDRESS``, else default."""
    if flag:
        return flag
    return read_environment(environ).get("address") or DEFAULT_ADDRESS
