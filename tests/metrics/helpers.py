"""Shared helpers for the metrics tests: reading a registry, the docs table, free ports."""

from __future__ import annotations

import random
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "metrics.md"
GRAFANA = REPO / "grafana"
DASHBOARDS = GRAFANA / "dashboards"


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """One metric family as exposed (or documented): name, type and label names."""

    name: str  # counters with their _total suffix
    type: str  # counter, gauge, histogram
    labels: frozenset[str]


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value; fails the test (not None) when the sample does not exist."""
    got = registry.get_sample_value(name, labels)
    assert got is not None, f"no sample {name}{labels} in the registry"
    return got


def exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode("utf-8")


def families(text: str) -> dict[str, FamilySpec]:
    """Family name -> spec from a text exposition (histogram labels exclude ``le``)."""
    out: dict[str, FamilySpec] = {}
    for fam in text_string_to_metric_families(text):
        # The text parser drops a counter's _total from the family name; put it back.
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels: set[str] = set()
        for sample in fam.samples:
            labels.update(k for k in sample.labels if k != "le")
        out[name] = FamilySpec(name, fam.type, frozenset(labels))
    return out


def sample_names(text: str) -> set[str]:
    """Every sample name of an exposition (``_bucket``/``_sum``/``_count``/``_total`` included)."""
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


_DOC_ROW = re.compile(r"^\|\s*`(kvserve_[a-z0-9_]+)`\s*\|\s*([a-z]+)\s*\|([^|]*)\|")


def documented_families(path: Path = DOCS) -> dict[str, FamilySpec]:
    """The metric tables of docs/metrics.md: ``| `name` | type | `label`, ... | meaning |``."""
    out: dict[str, FamilySpec] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _DOC_ROW.match(line)
        if m is None:
            continue
        name, typ, labels = m.group(1), m.group(2), m.group(3)
        assert name not in out, f"{name} documented twice in {path}"
        out[name] = FamilySpec(name, typ, frozenset(re.findall(r"`([a-z_]+)`", labels)))
    return out


RANGE_LOW = 20_000  # above Ray's worker ports (min_worker_port 10002 .. max 19999)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (what port 0 and outgoing connections
    get); Linux's default 32768 where /proc does not say."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for programs without port 0).

    Picked at random in 20000 up to the kernel's ephemeral range, not by binding port 0: a
    port the kernel handed out is the next one it hands to any process binding port 0 or
    connecting out, and with the suite on several workers another test took one between this
    call and the program's bind (Ray's proxy: "Failed to bind"). Below 20000 are Ray's worker
    ports (10002-19999), which Ray binds as its workers start. In the range only another
    ``free_port`` can pick it, 1 in thousands."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(RANGE_LOW, low) if low > RANGE_LOW + 1000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: another
            return int(s.getsockname()[1])
    raise RuntimeError(f"no free TCP port on 127.0.0.1 in {RANGE_LOW} up to the ephemeral range")


def require_binary(name: str) -> str:
    """The path of a system binary; fails (never skips) with how to install it."""
    path = shutil.which(name)
    assert path is not None, (
        f"`{name}` not found on PATH. The metrics tests need Debian's prometheus package "
        "(prometheus + promtool): run `make test-deps` or "
        "`apt-get install -y prometheus`."
    )
    return path
