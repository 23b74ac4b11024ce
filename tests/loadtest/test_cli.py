"""``kvserve loadtest`` without a server, and its --help."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from loadtest.cli import build_parser, main


def _unused_address() -> str:
    """A loopback port that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_help_states_every_default() -> None:
    """Every option that takes a value says its default; --mode and --users show theirs."""
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.nargs != 0:
            assert action.help is not None and "(default: " in action.help, action.dest
    text = " ".join(parser.format_help().split())
    assert "--mode {open,closed}" in text
    assert "open: arrivals at --rate (default: closed)" in text
    assert "--users USERS closed loop: concurrent users (default: 1)" in text


def test_target_is_an_alias_of_address() -> None:
    """--address (as `kvserve generate`) and the older --target set the same value."""
    parser = build_parser()
    assert parser.parse_args(["--address", "h:1"]).target == "h:1"
    assert parser.parse_args(["--target", "h:2"]).target == "h:2"


def test_slo_flags_are_named_as_the_servers_with_the_old_names_as_aliases() -> None:
    """--ttft-slo-ms / --itl-slo-ms (the server's names) and the older --slo-ttft-ms /
    --slo-tpot-ms set the same values."""
    parser = build_parser()
    for names in (("--ttft-slo-ms", "--itl-slo-ms"), ("--slo-ttft-ms", "--slo-tpot-ms")):
        args = parser.parse_args([names[0], "500", names[1], "40"])
        assert (args.ttft_slo_ms, args.itl_slo_ms) == (500.0, 40.0)
    args = parser.parse_args([])
    assert (args.ttft_slo_ms, args.itl_slo_ms) == (None, None)


def test_no_server_fails_fast_with_a_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing at the address: exit 1 within seconds, say how to start one, write nothing."""
    address = _unused_address()
    out = tmp_path / "report.json"
    start = time.monotonic()
    code = main(["--address", address, "--no-progress", "--out", str(out)])
    elapsed = time.monotonic() - start
    assert code == 1
    assert elapsed < 10.0
    assert capsys.readouterr().err == (
        f"kvserve loadtest: no kvserve at {address}: start one with `make serve`, "
        "or pass --address\n"
    )
    assert not out.exists()


def test_reuse_cache_is_off_unless_asked() -> None:
    """--reuse-cache is a flag, off by default."""
    parser = build_parser()
    assert parser.parse_args([]).reuse_cache is False
    assert parser.parse_args(["--reuse-cache"]).reuse_cache is True
