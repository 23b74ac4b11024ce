"""How well the slo policy's step-cost model predicts real steps of the embedded model.

    python -m benchmarks.bench_cost_model [--threads 2]

Loads the served model as ``kvserve serve --policy slo`` would, calibrates the model at
start-up (``server.calibration``), then runs held-out rounds of different shapes (decode
batches of 2 to 24 over contexts of 100 to 700 tokens, prefill chunks of 48 to 768 tokens
after prefixes of 0 to 1,500, and mixes of both) and compares every step's measured time
with the prediction made before it ran: from the calibrated prior alone, and from the
online model (refitted after every step, as the engine does).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import astuple
from pathlib import Path
from typing import Any

from scheduler.cost_model import FEATURES
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
    prior_errors: list[float] = []
    online_errors: list[float] = []
    for shape, seconds in samples:
        prior_errors.append(abs(prior.predict(shape) - seconds) / seconds)
        online_errors.append(abs(online.observe(shape, seconds) - seconds) / seconds)
    return {
        "steps": len(samples),
        "step_ms_range": [
            round(min(t for _, t in samples) * 1e3, 1),
            round(max(t for _, t in samples) * 1e3, 1),
        ],
        "prior_median_abs_rel_error": statistics.median(prior_errors),
        "online_median_abs_rel_error": statistics.median(online_errors),
        "online_p90_abs_rel_error": sorted(online_errors)[int(0.9 * len(online_errors))],
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
