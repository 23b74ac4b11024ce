"""The LoRA row of the overview dashboard (``generate_dashboards``): requests, output tokens
and the queues by adapter."""

from __future__ import annotations

from panels import SEL, Panel, rate, timeseries


def lora_panels() -> list[Panel]:
    """LoRA adapters: traffic, throughput and the queues by adapter (base: the base model)."""
    by = "sum by (adapter) "
    running, waiting = (f"{by}(kvserve_lora_{q}_requests{{{SEL}}})" for q in ("running", "waiting"))
    return [
        timeseries(
            "Requests / s by adapter",
            "Finished requests per second by LoRA adapter (base: requests of the base model).",
            [(f"{by}({rate('kvserve_lora_requests_total')})", "{{adapter}}")],
            unit="reqps",
        ),
        timeseries(
            "Output tokens / s by adapter",
            "Output tokens of finished requests per second, by LoRA adapter.",
            [(f"{by}({rate('kvserve_lora_generation_tokens_total')})", "{{adapter}}")],
        ),
        timeseries(
            "Running / waiting by adapter",
            "Requests running and waiting per LoRA adapter: at most --max-loras adapters run "
            "at once; a request of one more waits.",
            [(running, "running {{adapter}}"), (waiting, "waiting {{adapter}}")],
        ),
        timeseries(
            "Adapters in memory, loads and evictions / s",
            "LoRA adapters laid out in memory now, and per second those laid out (first "
            "loads, reads back from disk) and evicted: evictions well above 0 mean "
            "--max-cpu-loras is too small for the traffic.",
            [
                (f"sum(kvserve_lora_adapters_resident{{{SEL}}})", "resident"),
                (f"sum({rate('kvserve_lora_adapter_loads_total')})", "loads / s"),
                (f"sum({rate('kvserve_lora_adapter_evictions_total')})", "evictions / s"),
            ],
        ),
    ]
