"""The Python client and `kvserve generate` as a new user meets them: defaults, no server."""

from __future__ import annotations

import socket
import time

import pytest

from server import cli
from server.client import DEFAULT_TEMPERATURE, build_generate_request


def test_client_defaults_to_greedy_like_the_cli() -> None:
    """No temperature given: the client sends 0 (greedy), the `generate` CLI's default too."""
    request = build_generate_request("hello")
    assert request.sampling.HasField("temperature")
    assert request.sampling.temperature == 0.0 == DEFAULT_TEMPERATURE
    args = cli.build_parser().parse_args(["generate", "hello"])
    assert args.temperature == DEFAULT_TEMPERATURE


def test_client_samples_when_asked() -> None:
    """temperature=0.5 is sent as is; None leaves it unset (the server's default, 1.0)."""
    assert build_generate_request("x", temperature=0.5).sampling.temperature == 0.5
    assert not build_generate_request("x", temperature=None).sampling.HasField("temperature")


def test_generate_without_a_server_fails_fast_with_a_hint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Nothing at the address: exit 1 within seconds with the address and how to start one."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    start = time.monotonic()
    code = cli.main(["generate", "--address", address, "hello"])
    elapsed = time.monotonic() - start
    assert code == 1
    assert elapsed < 10.0
    assert capsys.readouterr().err == (
        f"kvserve generate: no kvserve at {address}: start one with `make serve`, "
        "or pass --address\n"
    )
