"""Writes grafana/dashboards/*.json: the kvserve dashboards, as code.

Run ``python grafana/generate_dashboards.py`` after editing; tests/metrics checks that the
committed JSON equals what this script produces, that it is a valid Grafana dashboard, and
(with a real Prometheus scraping a live server) that every query returns data.

Every panel and query takes its data source from the ``datasource`` template variable and
filters on the ``instance`` and ``replica`` variables; nothing names a host, a job or a data
source uid. ``replica`` is the label ``kvserve cluster serve`` puts on each replica's series; a
single server has none, and "All" (``.*``) also matches series without the label.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# grafana/ is not a package: this script runs as a file, and its building blocks sit beside it.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_panels import lora_panels
from panels import (
    BOTH_MET,
    DS,
    ITL_MET,
    NOT_OK,
    SEL,
    TTFT_MET,
    Panel,
    dashboard,
    layout,
    mean,
    percentiles,
    quantile,
    rate,
    row,
    stat,
    target,
    timeseries,
)


def queue_panels() -> list[Panel]:
    return [
        timeseries(
            "Requests running / waiting / preempted / parked",
            "Running set and waiting queue sizes from the latest scheduler snapshot; parked: "
            "requests whose client stopped reading (not scheduled until it reads again).",
            [
                (f"sum(kvserve_requests_running{{{SEL}}})", "running"),
                (f"sum(kvserve_requests_waiting{{{SEL}}})", "waiting"),
                (f"sum(kvserve_requests_preempted{{{SEL}}})", "preempted (waiting)"),
                (f"sum(kvserve_requests_parked{{{SEL}}})", "parked (client not reading)"),
            ],
        ),
        timeseries(
            "Waiting queue tokens",
            "Prompt tokens still to compute across the waiting queue.",
            [(f"sum(kvserve_waiting_queue_tokens{{{SEL}}})", "waiting tokens")],
        ),
    ]


def edge_panels() -> list[Panel]:
    """Structured outputs (constrained requests, the compile cache, mask time per step) and
    the connections the HTTP ports closed or refused."""
    return [
        timeseries(
            "Constrained requests / s and compiles",
            "Finished requests that carried a constraint (JSON schema, regex, choice, grammar, "
            "tool call); constraints compiled (cache misses) and found in the compile cache.",
            [
                (f"sum({rate('kvserve_constrained_requests_total')})", "constrained requests"),
                (f"sum({rate('kvserve_constraint_compiles_total')})", "compiles"),
                (f"sum({rate('kvserve_constraint_cache_hits_total')})", "cache hits"),
            ],
        ),
        percentiles(
            "Constraint mask time per step",
            "Time computing the token masks of a step's constrained rows (steps that had any).",
            "kvserve_step_constraint_mask_seconds",
        ),
        timeseries(
            "Connections closed or refused / s",
            "By port and event: too slow (header_timeout, body_timeout), evicted_idle, "
            "refused at the cap (503), emfile (out of file descriptors).",
            [
                (
                    f"sum by (server, event) ({rate('kvserve_connection_events_total')})",
                    "{{server}} {{event}}",
                )
            ],
        ),
    ]


def overview() -> dict[str, Any]:
    panels = layout(
        [
            row("Traffic"),
            [
                stat(
                    "Requests running",
                    "Requests prefilling or decoding now.",
                    f"sum(kvserve_requests_running{{{SEL}}})",
                ),
                stat(
                    "Requests waiting",
                    "Requests in the waiting queue now.",
                    f"sum(kvserve_requests_waiting{{{SEL}}})",
                ),
                stat(
                    "Generation throughput",
                    "Output tokens per second.",
                    f"sum({rate('kvserve_generation_tokens_total')})",
                    unit="none",
                ),
                stat(
                    "KV cache usage",
                    "Used KV blocks / all blocks (highest instance).",
                    f"max(kvserve_kv_cache_usage_ratio{{{SEL}}})",
                    unit="percentunit",
                ),
            ],
            [
                timeseries(
                    "Finished requests / s by finish reason",
                    "stop, length, abort, error (scheduler counter).",
                    [
                        (
                            f"sum by (finish_reason) ({rate('kvserve_requests_finished_total')})",
                            "{{finish_reason}}",
                        )
                    ],
                    unit="reqps",
                ),
                timeseries(
                    "RPCs / s by method",
                    "Finished gRPC calls per second.",
                    [(f"sum by (method) ({rate('kvserve_rpcs_total')})", "{{method}}")],
                    unit="reqps",
                ),
            ],
            row("Errors"),
            [
                timeseries(
                    "RPC errors / s by code",
                    "Finished gRPC calls with a status other than OK.",
                    [
                        (
                            f"sum by (code) ({rate('kvserve_rpcs_total', NOT_OK)})",
                            "{{code}}",
                        )
                    ],
                    unit="reqps",
                ),
                timeseries(
                    "Error ratio",
                    "Share of RPCs that did not end OK.",
                    [
                        (
                            f"sum({rate('kvserve_rpcs_total', NOT_OK)}) / "
                            f"sum({rate('kvserve_rpcs_total')})",
                            "errors / all",
                        )
                    ],
                    unit="percentunit",
                ),
                timeseries(
                    "Aborts and rejections / s by reason",
                    "Aborts: client_cancel, deadline, abort_call, shutdown, error, overload. "
                    "Rejections: refused before the scheduler.",
                    [
                        (
                            f"sum by (reason) ({rate('kvserve_request_aborts_total')})",
                            "abort: {{reason}}",
                        ),
                        (
                            f"sum by (reason) ({rate('kvserve_requests_rejected_total')})",
                            "rejected: {{reason}}",
                        ),
                    ],
                    unit="reqps",
                ),
            ],
            row("Latency"),
            [
                percentiles(
                    "Time to first token",
                    "Arrival to first output token.",
                    "kvserve_request_time_to_first_token_seconds",
                ),
                percentiles(
                    "Inter-token latency",
                    "Gap between consecutive output tokens.",
                    "kvserve_request_inter_token_latency_seconds",
                ),
                percentiles(
                    "End-to-end latency",
                    "Arrival to finish, any finish reason.",
                    "kvserve_request_e2e_latency_seconds",
                ),
            ],
            [
                percentiles(
                    "Time per output token",
                    "Per request: decode time / (output tokens - 1).",
                    "kvserve_request_time_per_output_token_seconds",
                ),
                percentiles(
                    "Queue time",
                    "Arrival to first scheduled.",
                    "kvserve_request_queue_time_seconds",
                ),
                timeseries(
                    "Prefill vs decode time (p50)",
                    "Median time a request spends in prefill (first scheduled to first token) "
                    "and in decode (first token to finish).",
                    [
                        (quantile(0.5, "kvserve_request_prefill_time_seconds"), "prefill p50"),
                        (quantile(0.5, "kvserve_request_decode_time_seconds"), "decode p50"),
                    ],
                    unit="s",
                ),
            ],
            row("Throughput"),
            [
                timeseries(
                    "Tokens / s",
                    "Prompt tokens admitted and output tokens generated per second.",
                    [
                        (f"sum({rate('kvserve_prompt_tokens_total')})", "prompt"),
                        (f"sum({rate('kvserve_generation_tokens_total')})", "generation"),
                    ],
                ),
                timeseries(
                    "Request length",
                    "Mean and p90 prompt and output lengths of finished requests.",
                    [
                        (mean("kvserve_request_prompt_tokens"), "prompt mean"),
                        (quantile(0.9, "kvserve_request_prompt_tokens"), "prompt p90"),
                        (mean("kvserve_request_generation_tokens"), "generation mean"),
                        (quantile(0.9, "kvserve_request_generation_tokens"), "generation p90"),
                    ],
                ),
            ],
            row("Queue"),
            queue_panels(),
            row("LoRA adapters"),
            lora_panels(),
            row("Structured outputs and connections"),
            edge_panels(),
        ]
    )
    return dashboard(
        "kvserve-overview",
        "kvserve overview",
        "Traffic, errors, latency percentiles, throughput and queue of kvserve.",
        panels,
    )


def scheduler_kv() -> dict[str, Any]:
    right_axis = [
        {
            "matcher": {"id": "byName", "options": "decode requests"},
            "properties": [{"id": "custom.axisPlacement", "value": "right"}],
        }
    ]
    kvstat = "KVCacheStats field, latest snapshot."
    panels = layout(
        [
            row("Batches"),
            [
                timeseries(
                    "Batches / s by kind",
                    "Prefill and decode batches (a mixed step counts once for each), and "
                    "steps by the kind of batch they ran.",
                    [
                        (
                            f"sum by (kind) ({rate('kvserve_scheduler_batches_total')})",
                            "batches: {{kind}}",
                        ),
                        (
                            f"sum by (kind) ({rate('kvserve_step_duration_seconds_count')})",
                            "steps: {{kind}}",
                        ),
                    ],
                ),
                timeseries(
                    "Step time by kind",
                    "Wall time of runner.execute per step: p50, p99 and mean by batch kind.",
                    [
                        (quantile(0.5, "kvserve_step_duration_seconds", "kind"), "p50 {{kind}}"),
                        (quantile(0.99, "kvserve_step_duration_seconds", "kind"), "p99 {{kind}}"),
                        (mean("kvserve_step_duration_seconds", "kind"), "mean {{kind}}"),
                    ],
                    unit="s",
                ),
            ],
            [
                timeseries(
                    "Prefill tokens vs decode requests per step",
                    "Mean batch composition of a step: prompt tokens in the prefill batch "
                    "(left axis) and requests in the decode batch (right axis).",
                    [
                        (mean("kvserve_step_prefill_tokens"), "prefill tokens"),
                        (mean("kvserve_step_decode_requests"), "decode requests"),
                        (mean("kvserve_step_prefill_requests"), "prefill requests"),
                    ],
                    overrides=right_axis,
                ),
                timeseries(
                    "Scheduler CPU time per step",
                    "CPU time of schedule() + update(): p50, p99 and mean.",
                    [
                        (quantile(0.5, "kvserve_step_scheduler_cpu_seconds"), "p50"),
                        (quantile(0.99, "kvserve_step_scheduler_cpu_seconds"), "p99"),
                        (mean("kvserve_step_scheduler_cpu_seconds"), "mean"),
                    ],
                    unit="s",
                ),
            ],
            row("Speculative decoding"),
            [
                timeseries(
                    "Draft acceptance rate",
                    "Accepted / verified n-gram draft tokens over the window (--speculative "
                    "ngram), from the two counters. Each accepted draft is an output token "
                    "without a step of its own.",
                    [
                        (
                            f"sum({rate('kvserve_spec_accepted_tokens_total')}) / "
                            f"sum({rate('kvserve_spec_draft_tokens_total')})",
                            "acceptance rate",
                        ),
                    ],
                    unit="percentunit",
                ),
                timeseries(
                    "Draft tokens / s",
                    "Draft tokens verified and accepted, against all output tokens.",
                    [
                        (f"sum({rate('kvserve_spec_draft_tokens_total')})", "drafted"),
                        (f"sum({rate('kvserve_spec_accepted_tokens_total')})", "accepted"),
                        (f"sum({rate('kvserve_generation_tokens_total')})", "output tokens"),
                    ],
                ),
            ],
            row("Queue"),
            queue_panels(),
            row("KV cache"),
            [
                timeseries(
                    "KV blocks by state",
                    "used (referenced), cached_free (evictable prefix-cache), free, reserved.",
                    [(f"sum by (state) (kvserve_kv_cache_blocks{{{SEL}}})", "{{state}}")],
                    stack=True,
                ),
                timeseries(
                    "KV cache usage",
                    "Used blocks / all blocks.",
                    [(f"max(kvserve_kv_cache_usage_ratio{{{SEL}}})", "usage")],
                    unit="percentunit",
                ),
                timeseries(
                    "Prefix cache hit rate",
                    "Hit tokens / queried tokens over the window, from the two counters; "
                    "lifetime ratio for reference.",
                    [
                        (
                            f"sum({rate('kvserve_prefix_cache_hits_tokens_total')}) / "
                            f"sum({rate('kvserve_prefix_cache_queries_tokens_total')})",
                            "hit rate (window)",
                        ),
                        (
                            f"max(kvserve_prefix_cache_hit_ratio{{{SEL}}})",
                            "hit rate (lifetime)",
                        ),
                    ],
                    unit="percentunit",
                ),
            ],
            [
                timeseries(
                    "Prefix cache tokens / s",
                    "Prompt tokens looked up in the prefix cache and tokens found.",
                    [
                        (f"sum({rate('kvserve_prefix_cache_queries_tokens_total')})", "queried"),
                        (f"sum({rate('kvserve_prefix_cache_hits_tokens_total')})", "hit"),
                    ],
                ),
                timeseries(
                    "Evictions, copy-on-write and KV strategy / s",
                    "Cached blocks evicted to hand out, copy-on-write block copies, and the KV "
                    "strategy's token slots: dropped to recompute (disabled, "
                    "long-sequence-only) or windowed out of the longest requests (adaptive).",
                    [
                        (f"sum({rate('kvserve_kv_cache_evictions_total')})", "evictions"),
                        (f"sum({rate('kvserve_kv_cache_cow_copies_total')})", "cow copies"),
                        (
                            f"sum({rate('kvserve_kv_cache_strategy_dropped_tokens_total')})",
                            "strategy dropped tokens",
                        ),
                        (
                            f"sum({rate('kvserve_kv_cache_strategy_windowed_tokens_total')})",
                            "strategy windowed tokens",
                        ),
                    ],
                ),
                timeseries(
                    "Preemptions / s",
                    "Preemptions, and computed tokens they discarded (to recompute).",
                    [
                        (f"sum({rate('kvserve_preemptions_total')})", "preemptions"),
                        (f"sum({rate('kvserve_recomputed_tokens_total')})", "recomputed tokens"),
                    ],
                ),
            ],
            row("Latency targets (--policy slo; attainment under any policy)"),
            [
                timeseries(
                    "SLO attainment",
                    "Share of ended requests (client cancels and Abort calls aside) that met "
                    "their targets: both (goodput) by priority, and TTFT / ITL alone over all.",
                    [
                        (
                            f"sum by (priority) ({rate('kvserve_slo_attained_total', BOTH_MET)})"
                            f" / sum by (priority) ({rate('kvserve_slo_requests_total')})",
                            "both, priority {{priority}}",
                        ),
                        (
                            f"sum({rate('kvserve_slo_attained_total', TTFT_MET)})"
                            f" / sum({rate('kvserve_slo_requests_total')})",
                            "TTFT met",
                        ),
                        (
                            f"sum({rate('kvserve_slo_attained_total', ITL_MET)})"
                            f" / sum({rate('kvserve_slo_requests_total')})",
                            "ITL met",
                        ),
                    ],
                    unit="percentunit",
                ),
                timeseries(
                    "Predicted vs actual step time",
                    "The step-cost model's prediction of each iteration against the measured "
                    "iteration (means over the window), and the median |error| / measured.",
                    [
                        (mean("kvserve_step_predicted_seconds"), "predicted"),
                        (mean("kvserve_step_iteration_seconds"), "actual"),
                        (quantile(0.5, "kvserve_step_prediction_error_ratio"), "median error"),
                    ],
                    unit="s",
                    overrides=[
                        {
                            "matcher": {"id": "byName", "options": "median error"},
                            "properties": [
                                {"id": "unit", "value": "percentunit"},
                                {"id": "custom.axisPlacement", "value": "right"},
                            ],
                        }
                    ],
                ),
            ],
            row("KVCacheStats"),
            [
                stat(
                    "Sequences",
                    "total_sequences: " + kvstat,
                    f"sum(kvserve_kv_cache_sequences{{{SEL}}})",
                ),
                stat(
                    "Tokens held",
                    "total_tokens: " + kvstat,
                    f"sum(kvserve_kv_cache_tokens{{{SEL}}})",
                ),
                stat(
                    "Average sequence length",
                    "average_sequence_length (tokens): " + kvstat,
                    f"avg(kvserve_kv_cache_average_sequence_length_tokens{{{SEL}}})",
                ),
                stat(
                    "Cache efficiency",
                    "cache_efficiency (slots used / allocated): " + kvstat,
                    f"avg(kvserve_kv_cache_efficiency_ratio{{{SEL}}})",
                    unit="percentunit",
                ),
                stat(
                    "Cache hit rate (lifetime)",
                    "cache_hit_rate: " + kvstat,
                    f"max(kvserve_prefix_cache_hit_ratio{{{SEL}}})",
                    unit="percentunit",
                ),
                stat(
                    "Memory used",
                    "used_memory_bytes: " + kvstat,
                    f"sum(kvserve_kv_cache_used_memory_bytes{{{SEL}}})",
                    unit="bytes",
                ),
            ],
            [
                stat(
                    "Memory total",
                    "total_memory_bytes: " + kvstat,
                    f"sum(kvserve_kv_cache_memory_bytes{{{SEL}}})",
                    unit="bytes",
                ),
                stat(
                    "Blocks",
                    "num_blocks_total: " + kvstat,
                    f"sum(kvserve_kv_cache_capacity_blocks{{{SEL}}})",
                ),
                stat(
                    "Block size (tokens)",
                    "block_size: " + kvstat,
                    f"max(kvserve_kv_cache_block_size_tokens{{{SEL}}})",
                ),
                stat(
                    "Block size (bytes)",
                    "block_bytes: " + kvstat,
                    f"max(kvserve_kv_cache_block_size_bytes{{{SEL}}})",
                    unit="bytes",
                ),
                stat(
                    "Evictions (total)",
                    "evictions_total: " + kvstat,
                    f"sum(kvserve_kv_cache_evictions_total{{{SEL}}})",
                ),
                stat(
                    "Copy-on-write copies (total)",
                    "cow_copies_total: " + kvstat,
                    f"sum(kvserve_kv_cache_cow_copies_total{{{SEL}}})",
                ),
            ],
            row("KV tiers"),
            kv_tier_panels(),
            row("Prefill / decode transfer"),
            transfer_panels(),
            [model_table()],
        ]
    )
    return dashboard(
        "kvserve-scheduler-kv",
        "kvserve scheduler & KV cache",
        "Batch composition, step times, queue, KV blocks by state, prefix cache, evictions, "
        "preemptions and KVCacheStats.",
        panels,
    )


def kv_tier_panels() -> list[Panel]:
    """Tier 1 (the pool's prefix cache) and tier 2 (the disk store of --kv-disk-dir)."""
    return [
        timeseries(
            "Prefix hit tokens / s by tier",
            "Prompt tokens found in tier 1 (the pool) and restored from tier 2 (the disk "
            "store), next to the tokens looked up: hit rate by tier = hits / queried.",
            [
                (f"sum by (tier) ({rate('kvserve_kv_tier_hits_tokens_total')})", "tier {{tier}}"),
                (f"sum({rate('kvserve_prefix_cache_queries_tokens_total')})", "queried"),
            ],
        ),
        timeseries(
            "KV bytes held by tier",
            "Tier 1: used + cached-free blocks of the pool; tier 2: the store's entries (shared "
            "by the replicas of a host), against each tier's capacity.",
            [
                (f"max by (tier) (kvserve_kv_tier_bytes{{{SEL}}})", "tier {{tier}}"),
                (f"max by (tier) (kvserve_kv_tier_capacity_bytes{{{SEL}}})", "capacity {{tier}}"),
            ],
            unit="bytes",
        ),
        timeseries(
            "Tier 2 spills, restores and errors / s",
            "Bytes written to and restored from the store, and failures by kind (each a miss "
            "or a dropped spill; requests never fail).",
            [
                (f"sum({rate('kvserve_kv_tier2_spill_bytes_total')})", "spilled bytes"),
                (f"sum({rate('kvserve_kv_tier2_restore_bytes_total')})", "restored bytes"),
                (f"sum by (kind) ({rate('kvserve_kv_tier2_errors_total')})", "errors {{kind}}"),
            ],
        ),
    ]


def transfer_panels() -> list[Panel]:
    """The prefill / decode split (kvserve cluster serve --prefill-replicas): a decode
    replica's prompts handed to prefill replicas, published to the shared store and read
    back as tier-2 hits. Zero outside decode replicas."""
    seconds = "kvserve_kv_transfer_seconds"
    return [
        timeseries(
            "Transfers / s by outcome",
            "Prompts a decode replica handed to a prefill replica: ok (the KV is in the shared "
            "store), prefill_failed / timeout (recomputed on the decode replica; no request "
            "fails). Fallbacks = all but ok.",
            [(f"sum by (outcome) ({rate('kvserve_kv_transfers_total')})", "{{outcome}}")],
        ),
        timeseries(
            "Transferred blocks and bytes / s",
            "Blocks (and their bytes) prefill replicas published for decode replicas; the "
            "decode replicas read them back as tier-2 hits (KV tiers row).",
            [
                (f"sum({rate('kvserve_kv_transfer_blocks_total')})", "published blocks"),
                (f"sum({rate('kvserve_kv_transfer_bytes_total')})", "published bytes"),
            ],
        ),
        timeseries(
            "Transfer wait (mean)",
            "A decode replica's mean wait for a prefill replica (its queue, the prefill, the "
            "writes to the store), per transfer; 0 while there are none.",
            [
                (
                    f"sum({rate(seconds + '_sum')}) / clamp_min(sum({rate(seconds + '_count')}), "
                    "1e-9)",
                    "mean s per transfer",
                )
            ],
            unit="s",
        ),
    ]


def model_table() -> Panel:
    return {
        "type": "table",
        "title": "Model",
        "description": "kvserve_model_info: model, dtype, device and KV cache geometry.",
        "datasource": DS,
        "targets": [
            target(
                f"max by (instance, replica, model, dtype, device, block_size, num_blocks) "
                f"(kvserve_model_info{{{SEL}}})",
                "",
                "A",
                format="table",
                instant=True,
            )
        ],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True},
        "transformations": [
            {
                "id": "organize",
                "options": {"excludeByName": {"Time": True, "Value": True}},
            }
        ],
    }


DASHBOARDS = {
    "kvserve-overview.json": overview,
    "kvserve-scheduler-kv.json": scheduler_kv,
}


def render() -> dict[str, str]:
    """File name -> JSON text (what is committed under grafana/dashboards/)."""
    return {
        name: json.dumps(build(), indent=2, ensure_ascii=False) + "\n"
        for name, build in DASHBOARDS.items()
    }


def main() -> int:
    out_dir = Path(__file__).resolve().parent / "dashboards"
    out_dir.mkdir(exist_ok=True)
    for name, text in render().items():
        (out_dir / name).write_text(text, encoding="utf-8")
        print(f"wrote {out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
