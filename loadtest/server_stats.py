"""The server's own view of a run: /metrics deltas (or GetKVCacheStats when no metrics URL).

Counters are read before and after the run and reported as deltas, so a server that already
served traffic reports only this run. KV usage is a gauge: it is sampled periodically during
the run (``interval_s``) and its peak reported.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Metric names exported by kvserve's metrics/prometheus.py (a tuple: the first present wins).
PREFIX_QUERIES = ("kvserve_prefix_cache_queries_tokens_total",)
PREFIX_HITS = ("kvserve_prefix_cache_hits_tokens_total",)
PREEMPTIONS = ("kvserve_preemptions_total",)
KV_USAGE = ("kvserve_kv_cache_usage_ratio",)

Samples = dict[str, float]  # "name{label="v",...}" -> value


def scrape(url: str, timeout_s: float = 5.0) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by name plus sorted labels."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode("utf-8")
    return parse(text)


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def _sum_family(samples: Samples, name: str) -> float | None:
    """Sum over every label set of ``name``; None when the metric is absent."""
    values = [v for k, v in samples.items() if k == name or k.startswith(name + "{")]
    return sum(values) if values else None


def _first(samples: Samples, names: tuple[str, ...]) -> tuple[str | None, float | None]:
    for name in names:
        value = _sum_family(samples, name)
        if value is not None:
            return name, value
    return None, None


@dataclass(slots=True)
class ServerView:
    """Before/after counters and the usage samples of one run."""

    source: str  # "metrics" or "grpc"
    before: Samples
    after: Samples = field(default_factory=dict)
    usage_samples: list[float] = field(default_factory=list)

    def sample_usage(self, samples: Samples) -> None:
        _, usage = _first(samples, KV_USAGE)
        if usage is not None:
            self.usage_samples.append(usage)

    def report(self) -> dict[str, Any]:
        """The ``server`` section of the JSON report."""
        deltas = {
            k: self.after[k] - self.before.get(k, 0.0)
            for k in sorted(self.after)
            if _is_counter_sample(k)
        }
        _, queries = _first(deltas, PREFIX_QUERIES)
        _, hits = _first(deltas, PREFIX_HITS)
        _, preemptions = _first(deltas, PREEMPTIONS)
        peak = max(self.usage_samples) if self.usage_samples else None
        return {
            "source": self.source,
            "prefix_queries_tokens": queries,
            "prefix_hits_tokens": hits,
            "prefix_hit_rate": (hits / queries) if queries and hits is not None else None,
            "preemptions": preemptions,
            "kv_usage_peak": peak,
            "num_usage_samples": len(self.usage_samples),
            "counter_deltas": deltas if self.source == "metrics" else {},
        }


def _is_counter_sample(key: str) -> bool:
    name = key.split("{", 1)[0]
    return name.endswith("_total") or name.endswith("_count") or name.endswith("_sum")


def kv_stats_samples(stats: Any) -> Samples:
    """A GetKVCacheStats reply as samples under the metric names the report looks up."""
    return {
        PREFIX_QUERIES[0]: float(stats.prefix_queries_tokens_total),
        PREFIX_HITS[0]: float(stats.prefix_hits_tokens_total),
        PREEMPTIONS[0]: float(stats.preemptions_total),
        KV_USAGE[0]: float(stats.usage),
    }
