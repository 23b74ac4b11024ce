"""``--attention-backend``: parsed like every generated flag, validated against the choices."""

from __future__ import annotations

import argparse

import pytest

from server.config import ServerConfig, add_serve_arguments, build_config


def test_flag_parses_and_defaults_to_auto() -> None:
    """--attention-backend takes auto/torch/triton/flashinfer (default auto), also from
    KVSERVE_ATTENTION_BACKEND; other names are refused."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert build_config(parser.parse_args([]), environ={}).attention_backend == "auto"
    args = parser.parse_args(["--attention-backend", "triton"])
    assert build_config(args, environ={}).attention_backend == "triton"
    env = {"KVSERVE_ATTENTION_BACKEND": "torch"}
    assert build_config(parser.parse_args([]), env).attention_backend == "torch"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ServerConfig(attention_backend="xformers")
