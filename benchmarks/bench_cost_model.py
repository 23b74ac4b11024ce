"""How well the slo policy's step-cost model predicts real steps of the embedded model.

    python -m benchmarks.bench_cost_model [--threads 2]

Loads the served model as ``kvserve serve --policy slo`` would, calibrates the model at
start-up (``server.calibration``), then runs held-out rounds of different shapes (decode
batches of 2 to 24 over contexts of 100 to 700 tokens, prefill chunks of 48 to 768 tokens
after prefixes of 0 to 1,500, and mixes of both) and compares every step's measured time
with the prediction made before it ran: from the calibrated prior alone, and from the
online model (refitted after every step, as the engine does). Then speculative rounds
(``SPEC_HELD_OUT``, n-gram drafts on repetitive prompts: decodes with 3 verification rows
beside prefill chunks), shapes the calibration never ran, reported on their own.

Every step of a quantized model is one fused kernel call (``model_runner.fused_step``): prefill
chunks, decodes and draft rows alike; the fit's ``has_prefill`` coefficient is what a step
with a chunk still costs beyond its tokens and attention.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import astuple
from pathlib import Path
from typing import Any

from scheduler.cost_model import FEATURES, StepCostModel, StepShape
from server.build import build_engine
from server.calibration import ROUNDS, Round, calibrate, run_rounds
from server.config import ServerConfig

HELD_OUT: tuple[Round, ...] = (
    (2, 700, 700, 8),  # one long prefill, batch-2 decodes over long contexts
    (1, 1500, 256, 2),  # chunks after long prefixes
    (6, 100, 48, 8),  # small chunks beside decodes
    (12, 60, 768, 6),  # one big prefill step, batch-12 decodes
    (24, 40, 256, 6),  # batch-24 decodes, mixed steps
)
# Speculative held-out rounds: drafts on decodes (the calibration has none).
SPEC_HELD_OUT: tuple[Round, ...] = (
    (4, 96, 384, 16),  # batch-4 decodes with drafts
    (8, 200, 128, 12),  # drafts beside prefill chunks
)


def _errors(
    model: StepCostModel, samples: list[tuple[StepShape, float]], online: bool
) -> list[float]:
    """|predicted - measured| / measured for each step; ``online``: refit after each."""
    predict = model.observe if online else (lambda shape, _: model.predict(shape))
    return [abs(predict(shape, seconds) - seconds) / seconds for shape, seconds in samples]


def _summary(prior: list[float], online: list[float]) -> dict[str, float]:
    return {
        "prior_median_abs_rel_error": statistics.median(prior),
        "online_median_abs_rel_error": statistics.median(online),
        "online_p90_abs_rel_error": sorted(online)[int(0.9 * len(online))],
    }


def measure(threads: int | None = None, seed: int = 1, dump: Path | None = None) -> dict[str, Any]:
    cfg = ServerConfig(policy="slo", threads=threads, metrics=False)
    built = build_engine(cfg)
    runner = built.runner
    cache = built.scheduler.kv.config
    max_model_len = built.model.max_model_len
    prior = calibrate(runner, cache, max_model_len)
    if dump is not None:
        calib = run_rounds(runner, cache, max_model_len, ROUNDS, seed=seed)
        held = run_rounds(runner, cache, max_model_len, HELD_OUT, seed=seed + 1)
        rows = [("calibration", calib), ("held_out", held)]
        dump.write_text(
            json.dumps(
                {name: [[*astuple(sh), t] for sh, t in data] for name, data in rows}, indent=1
            )
        )
    online = calibrate(runner, cache, max_model_len, seed=seed)  # refitted below
    samples = run_rounds(runner, cache, max_model_len, HELD_OUT, seed=seed + 1)
    spec = run_rounds(runner, cache, max_model_len, SPEC_HELD_OUT, seed=seed + 2, speculative=True)
    drafted = sum(1 for shape, _ in spec if shape.prefill_tokens and not shape.prefill_chunks)
    return {
        "steps": len(samples),
        "step_ms_range": [
            round(min(t for _, t in samples) * 1e3, 1),
            round(max(t for _, t in samples) * 1e3, 1),
        ],
        **_summary(_errors(prior, samples, False), _errors(online, samples, True)),
        # the online model goes on from the held-out rounds, as a server's would
        "speculative": {
            "steps": len(spec),
            "steps_with_drafts_only": drafted,
            **_summary(_errors(prior, spec, False), _errors(online, spec, True)),
        },
        "coefficients_s": dict(zip(FEATURES, prior.coefficients_s, strict=True)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cost_model")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dump", type=Path, help="also write raw (shape, seconds) samples here")
    args = p.parse_args(argv)
    result = measure(args.threads, dump=args.dump)
    low, high = result["step_ms_range"]
    print(
        f"{result['steps']} held-out steps of {low}-{high} ms: median |error| "
        f"{result['prior_median_abs_rel_error']:.1%} from the calibrated prior, "
        f"{result['online_median_abs_rel_error']:.1%} online "
        f"(p90 {result['online_p90_abs_rel_error']:.1%})"
    )
    spec = result["speculative"]
    print(
        f"{spec['steps']} speculative steps ({spec['steps_with_drafts_only']} with drafts and "
        f"no prefill chunk): median |error| {spec['prior_median_abs_rel_error']:.1%} from the "
        f"prior, {spec['online_median_abs_rel_error']:.1%} online "
        f"(p90 {spec['online_p90_abs_rel_error']:.1%})"
    )
    print("prior coefficients (s per unit):", json.dumps(result["coefficients_s"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
