"""ServerConfig assembly: defaults < config file < KVSERVE_* environment < flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from model_runner.config import RunnerOptions
from model_runner.environment import SWITCHES
from model_runner.fake import FakeRunner
from server.build import build_engine, runner_options
from server.config import (
    ServerConfig,
    add_serve_arguments,
    build_config,
    client_address,
    parse_bytes,
)
from server.http_guard import ConnectionCaps, EdgeLimits


def _flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults() -> None:
    """With nothing set: 127.0.0.1:50051, metrics on 9400, the torch runner on the default model."""
    cfg = build_config(_flags(), environ={})
    assert (cfg.host, cfg.port, cfg.metrics_port) == ("127.0.0.1", 50051, 9400)
    assert (cfg.runner, cfg.model, cfg.enable_prefix_caching) == ("torch", None, True)


def test_the_flags_defaults_are_the_components_own() -> None:
    """With no flag given, the torch runner's options are ``RunnerOptions``' defaults, but for
    what the server decides (KV dtype "auto", the scheduler's decode row bound), and the edge
    limits are ``EdgeLimits``' own; flags reach the options."""
    cfg = ServerConfig()
    options = runner_options(cfg)
    assert (options.kv_dtype, options.max_decode_rows) == ("auto", cfg.max_num_seqs)
    assert dataclasses.replace(options, kv_dtype=None, max_decode_rows=None) == RunnerOptions()
    assert cfg.edge_limits() == EdgeLimits()
    flags = {"activation_bits": 8, "attention_backend": "torch", "block_size": 8}
    options = runner_options(ServerConfig(dtype="float16", **flags), name="m")
    assert (options.activation_bits, options.attention_backend) == (8, "torch")
    assert (options.block_size, options.dtype, options.name) == (8, "float16", "m")


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    """A flag beats the environment, which beats the config file, which beats the default."""
    toml = tmp_path / "kvserve.toml"
    toml.write_text(
        '[serve]\nport = 7000\nmax-num-seqs = 8\npolicy = "prefill-first"\nblock_size = 32\n'
    )
    env = {"KVSERVE_PORT": "7100", "KVSERVE_MAX_NUM_SEQS": "16", "KVSERVE_CONFIG": str(toml)}
    cfg = build_config(_flags("--port", "7200"), environ=env)
    assert cfg.port == 7200  # flag
    assert cfg.max_num_seqs == 16  # environment
    assert (cfg.policy, cfg.block_size) == ("prefill-first", 32)  # file
    assert cfg.max_num_batched_tokens == 2048  # default


def test_process_switches_are_known_and_a_typo_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """KVSERVE_ISA and the other process switches (model_runner.environment.SWITCHES) are read
    where they apply, so the settings pass them by without a word; a name that is neither a
    setting nor a switch is named in a warning."""
    env = {f"KVSERVE_{name.upper()}": "0" for name in SWITCHES} | {"KVSERVE_MAX_NUM_SEQ": "8"}
    with caplog.at_level("WARNING", logger="server.config"):
        cfg = build_config(_flags(), environ=env)
    assert cfg == build_config(_flags(), environ={})
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring unknown environment variable KVSERVE_MAX_NUM_SEQ"
    ]
    assert set(SWITCHES) == {"kernels", "isa", "kernel_tuning", "kernel_dir", "fusions"}


def test_json_file_booleans_and_optional_values(tmp_path: Path) -> None:
    """JSON files work; booleans parse from env text; "none" clears an optional value."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"enable_prefix_caching": False, "num_blocks": 99}))
    cfg = build_config(_flags("--config", str(path)), environ={"KVSERVE_NUM_BLOCKS": "none"})
    assert cfg.enable_prefix_caching is False and cfg.num_blocks is None
    cfg = build_config(_flags("--enable-prefix-caching"), environ={})
    assert cfg.enable_prefix_caching is True
    assert (
        build_config(
            _flags(), environ={"KVSERVE_ENABLE_PREFIX_CACHING": "off"}
        ).enable_prefix_caching
        is False
    )


def test_bad_values_name_the_setting(tmp_path: Path) -> None:
    """Unknown file keys, unparsable env values and out-of-range values raise with the name."""
    path = tmp_path / "c.toml"
    path.write_text("max_num_seqz = 3\n")
    with pytest.raises(ValueError, match="unknown setting 'max_num_seqz'"):
        build_config(_flags("--config", str(path)), environ={})
    with pytest.raises(ValueError, match="KVSERVE_PORT: port"):
        build_config(_flags(), environ={"KVSERVE_PORT": "many"})
    with pytest.raises(ValueError, match="port must be in"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="policy must be one of"):
        ServerConfig(policy="random")
    with pytest.raises(ValueError, match="not a memory size"):
        ServerConfig(kv_memory="lots")


def test_parse_bytes_units() -> None:
    """Memory sizes take decimal and binary units."""
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1.5k") == 1536
    assert parse_bytes("4096") == 4096


def test_client_address_flag_env_default() -> None:
    """generate connects to --address, else KVSERVE_ADDRESS, else 127.0.0.1:50051."""
    assert client_address("h:1", environ={"KVSERVE_ADDRESS": "e:2"}) == "h:1"
    assert client_address(None, environ={"KVSERVE_ADDRESS": "e:2"}) == "e:2"
    assert client_address(None, environ={}) == "127.0.0.1:50051"


def test_build_fake_engine_sizes_the_cache_from_the_budget() -> None:
    """The fake runner's KV pool: kv_memory / block bytes blocks, reported in ServedModel."""
    cfg = ServerConfig(runner="fake", block_size=8, kv_memory="64KiB", max_model_len=256)
    built = build_engine(cfg)
    # block bytes = 2 (K,V) * 2 layers * 2 kv heads * 8 head dim * 4 bytes * 8 tokens = 2048
    assert built.model.num_blocks == 32
    assert built.model.kv_memory_bytes == 32 * 2048
    assert built.model.max_model_len == 256
    assert built.engine.latest_stats.kv.num_blocks_total == 32
    assert built.model.max_n == 16
    assert build_engine(ServerConfig(runner="fake", memory_mode="reserve")).model.max_n == 1


def test_async_scheduling_is_decoded_once_into_the_engines_overlap() -> None:
    """--async-scheduling on gives the fake runner its device thread and the engine overlaps;
    off, and auto with a runner that cannot run ahead (the fake one without its thread), run
    one step at a time."""
    modes = ("on", "off", "auto")
    assert [ServerConfig(async_scheduling=m).overlap for m in modes] == [True, False, None]
    for mode, overlaps in zip(modes, (True, False, False), strict=True):
        built = build_engine(ServerConfig(runner="fake", async_scheduling=mode))
        runner = built.runner
        assert isinstance(runner, FakeRunner)
        try:
            assert built.engine.overlap is overlaps, mode
            assert runner.can_run_ahead is overlaps, mode
        finally:
            runner.shutdown()  # the fake device's thread


def test_scheduler_and_cache_settings_are_generated_from_the_component_configs() -> None:
    """Every SchedulerConfig / KVCacheConfig field the server does not derive is a setting
    with the component's default, and its choices are the component's registry."""
    from cache_manager.config import EVICTION_POLICIES, KVCacheConfig
    from scheduler.config import POLICIES, SchedulerConfig

    settings = {f.name: f for f in dataclasses.fields(ServerConfig)}
    derived = {"max_model_len", "num_blocks", "sliding_window", "block_bytes", "kv_tier"}
    for component in (SchedulerConfig, KVCacheConfig):
        for f in dataclasses.fields(component):
            if f.name not in derived:
                assert settings[f.name].default == f.default, f.name
    assert settings["policy"].metadata["choices"] == POLICIES
    assert settings["eviction_policy"].metadata["choices"] == EVICTION_POLICIES


def test_aging_and_starvation_reach_the_scheduler_from_flags() -> None:
    """--aging-steps and --max-decode-starvation-steps end up in the built SchedulerConfig."""
    flags = _flags("--runner", "fake", "--aging-steps", "7", "--max-decode-starvation-steps", "2")
    built = build_engine(build_config(flags, environ={}))
    assert built.scheduler.config.aging_steps == 7
    assert built.scheduler.config.max_decode_starvation_steps == 2
    with pytest.raises(ValueError, match="max_decode_starvation_steps must be >= 1, got 0"):
        ServerConfig(max_decode_starvation_steps=0)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs"):
        ServerConfig(max_num_seqs=16, max_num_batched_tokens=8)


def test_sink_window_and_strategy_flags_reach_the_cache_manager() -> None:
    """--sliding-window, --attention-sinks, --kv-strategy and --kv-strategy-threshold end up
    in the built KV cache manager; with sinks the served limits let max_tokens pass the
    context. Sinks without a window, or sinks + window past the context, are refused."""
    flags = _flags(
        "--runner", "fake", "--max-model-len", "256", "--sliding-window", "64",
        "--attention-sinks", "4", "--kv-strategy", "adaptive", "--kv-strategy-threshold", "32",
    )  # fmt: skip
    built = build_engine(build_config(flags, environ={}))
    kv = built.scheduler.kv
    assert (kv.sliding_window, kv.attention_sinks) == (64, 4)
    assert (kv.strategy.name, kv.strategy.threshold) == ("adaptive", 32)
    assert built.model.limits.streams_past_context
    assert built.engine.latest_stats.kv.kv_strategy == "adaptive"
    plain = build_engine(ServerConfig(runner="fake", max_model_len=256, sliding_window=64))
    assert not plain.model.limits.streams_past_context
    with pytest.raises(ValueError, match="needs a window: set --sliding-window"):
        build_engine(ServerConfig(runner="fake", attention_sinks=4))
    with pytest.raises(ValueError, match="= 260 tokens exceed the context of 256"):
        build_engine(
            ServerConfig(runner="fake", max_model_len=256, sliding_window=256, attention_sinks=4)
        )
    with pytest.raises(SystemExit):
        _flags("--kv-strategy", "sometimes")


def test_http_and_security_settings(tmp_path: Path) -> None:
    """HTTP on 8000 by default (--no-http turns it off); --api-key repeats (the environment
    takes a comma list) and adds to --api-key-file; TLS files go in pairs; the key never
    appears in the config's repr."""
    assert (build_config(_flags(), environ={}).http_port, ServerConfig().http) == (8000, True)
    assert build_config(_flags("--no-http"), environ={}).http is False
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nkey-c\n\nkey-d\n")
    cfg = build_config(
        _flags("--api-key", "key-a", "--api-key", "key-b", "--api-key-file", str(keys)),
        environ={},
    )
    security = cfg.security()
    assert security.api_keys == {"key-a", "key-b", "key-c", "key-d"}
    assert "key-a" not in repr(security)
    assert build_config({}, environ={"KVSERVE_API_KEY": "x, y"}).api_key == ("x", "y")
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        build_config(_flags("--tls-cert", "c.pem"), environ={})
    with pytest.raises(ValueError, match="tls_client_ca needs tls_cert"):
        build_config(_flags("--tls-client-ca", "ca.pem"), environ={})
    with pytest.raises(ValueError, match="stalled_stream_timeout_s must be > 0"):
        build_config(_flags("--stalled-stream-timeout-s", "0"), environ={})
    tls = build_config(_flags("--tls-cert", "c.pem", "--tls-key", "k.pem"), environ={}).security()
    assert tls.tls is not None and (tls.tls.cert, tls.tls.key) == ("c.pem", "k.pem")


def test_exposed_bind_without_tls_or_key_warns(caplog: pytest.LogCaptureFixture) -> None:
    """Binding a non-loopback address with neither TLS nor a key logs a warning; loopback,
    or a key, does not."""
    from server.auth import Security, warn_if_exposed

    with caplog.at_level("WARNING"):
        warn_if_exposed("127.0.0.1", Security(), "kvserve")
        warn_if_exposed("::1", Security(), "kvserve")
        warn_if_exposed("0.0.0.0", Security(api_keys=frozenset({"k"})), "kvserve")
        assert caplog.records == []
        warn_if_exposed("0.0.0.0", Security(), "kvserve")
    assert len(caplog.records) == 1
    assert "listens on 0.0.0.0 without TLS or an API key" in caplog.records[0].getMessage()


def test_kv_disk_flags_reach_the_tier() -> None:
    """--kv-disk-dir turns tier 2 on in the cache config; --kv-disk-bytes and --kv-disk-store
    are validated at construction."""
    cfg = build_config(
        _flags("--runner", "fake", "--kv-disk-dir", "/tmp/x", "--kv-disk-bytes", "2GiB"),
        environ={},
    )
    assert (cfg.kv_disk_dir, cfg.kv_disk_bytes, cfg.kv_disk_store) == ("/tmp/x", "2GiB", "lmdb")
    assert cfg.cache_config(num_blocks=4, sliding_window=None, block_bytes=0).kv_tier
    assert not ServerConfig().cache_config(num_blocks=4, sliding_window=None, block_bytes=0).kv_tier
    with pytest.raises(ValueError, match="kv_disk_store must be one of"):
        ServerConfig(kv_disk_store="sqlite")
    with pytest.raises(ValueError, match="must be >= 1 byte"):
        ServerConfig(kv_disk_bytes="0")


def test_tenancy_and_connection_flags_reach_security_and_the_edge_limits() -> None:
    """--admin-api-key is also an API key and the only admin; --share-prefix-cache-across-keys
    reaches Security; the timeouts and caps reach every port (gRPC's options included), 0
    caps come from the descriptor limit, and bad values name the setting."""
    cfg = build_config(
        _flags(
            "--api-key", "a", "--admin-api-key", "adm", "--share-prefix-cache-across-keys",
            "--http-max-connections", "7", "--http-header-timeout-s", "2.5",
            "--grpc-idle-timeout-s", "60", "--max-waiting-requests-per-tenant", "5",
        ),
        environ={},
    )  # fmt: skip
    security = cfg.security()
    assert security.api_keys == {"a", "adm"} and security.admin_keys == {"adm"}
    assert security.share_prefix_cache
    limits = cfg.edge_limits().resolved()
    assert limits.http.max_connections == 7 and limits.http.header_timeout_s == 2.5
    assert limits.metrics.header_timeout_s == 2.5
    assert limits.metrics.max_connections == ConnectionCaps.of_process().metrics
    assert dict(limits.grpc_options()) == {
        "grpc.max_allowed_incoming_connections": ConnectionCaps.of_process().grpc,
        "grpc.max_connection_idle_ms": 60_000,
        "grpc.server_handshake_timeout_ms": 2_500,
    }
    assert cfg.scheduler_config(max_model_len=64).max_waiting_requests_per_tenant == 5
    with pytest.raises(ValueError, match="header_timeout_s must be > 0"):
        ServerConfig(http_header_timeout_s=0)
    with pytest.raises(ValueError, match="grpc_max_connections must be >= 0"):
        ServerConfig(grpc_max_connections=-1)
