"""LoRA adapters at serving speed: the ``lora`` section of ``make bench`` (``cpu/models.py``).

    python -m benchmarks.bench_lora --workload-file path/to/chat128.json     # as make bench
    python -m benchmarks.bench_lora --model embedded --quick --workload-file ...

On ``bench_models``' 1B-shaped random model (``random-1b-q4km``: Llama-3.2-1B's shape, Q4_K_M),
with random rank-16 adapters on every projection (``tools/make_random_lora``: PEFT files), chat128:

1. **Mixed adapters:** one kvserve server with 8 adapters loaded (``--lora a0=... a7=...``,
   ``--max-loras 8``); 8 users, request i naming adapter i % 8, so a step holds rows of up to
   8 adapters; against the same load on the base model on the same server. Interleaved
   base, lora, lora, base (per round): output tok/s of the two, pooled.
2. **One adapter against llama.cpp:** every request on adapter a0: kvserve serving the PEFT
   directory against ``llama-server --lora a0.gguf`` (llama-server applies it to every
   request), the GGUF made from the same PEFT files by ``convert_lora_to_gguf.py`` of the same
   llama.cpp build (f16), at 1 and 8 users; interleaved kvserve, llama.cpp, llama.cpp,
   kvserve.

The machine is shared: only ratios of runs interleaved in this process mean anything; each
figure comes with the CPU model and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.launch import cpu_model

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_ADAPTERS = 8
# Issue 40's targets: mixed adapters >= 0.85x the base alone; one adapter >= 1.2x / 1.5x
# llama-server --lora at 1 / 8 users.
TARGET_MIXED = 0.85
TARGET_VS_LLAMA = {1: 1.2, 8: 1.5}


@dataclass
class LoraFigures:
    model: str
    cpu: str
    rank: int
    mixed_users: int
    runs: list[dict[str, Any]] = field(default_factory=list)  # every run, in order

    def pooled(self, kind: str, users: int) -> float:
        """Output tok/s of ``kind``'s runs at ``users``, pooled (tokens / seconds)."""
        rows = [r for r in self.runs if r["kind"] == kind and r["users"] == users and r["ok"]]
        tokens = sum(r["output_tokens"] for r in rows)
        seconds = sum(r["duration_s"] for r in rows)
        return tokens / seconds if seconds else 0.0

    def ratio(self, a: str, b: str, users: int) -> float | None:
        pa, pb = self.pooled(a, users), self.pooled(b, users)
        return pa / pb if pa and pb else None

    def verdicts(self) -> dict[str, Any]:
        mixed = self.ratio("kvserve-8-adapters", "kvserve-base", self.mixed_users)
        out: dict[str, Any] = {"mixed_vs_base": mixed, "mixed_target": TARGET_MIXED}
        for users, target in TARGET_VS_LLAMA.items():
            out[f"vs_llama_{users}"] = self.ratio("kvserve-1-adapter", "llama.cpp-lora", users)
            out[f"vs_llama_{users}_target"] = target
        return out


def converter_path(cache_dir: Path) -> Path | None:
    """llama.cpp's convert_lora_to_gguf.py in the unpacked source of the build (None: none)."""
    path = cache_dir / "src" / "convert_lora_to_gguf.py"
    return path if path.is_file() else None


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prepare(
    model_path: Path, work: Path, rank: int, converter: Path | None
) -> tuple[list[Path], Path | None, str]:
    """The 8 PEFT adapters (cached in ``work``, a folder per base model) and a0 as GGUF
    (None, and why, without a converter)."""
    from benchmarks.tools.make_random_lora import gguf_config, write_base_config, write_peft

    config = gguf_config(model_path)
    work = work / model_path.stem  # adapters of one base model: another's would not fit
    work.mkdir(parents=True, exist_ok=True)
    adapters = []
    for i in range(NUM_ADAPTERS):
        folder = work / f"a{i}-r{rank}"
        if not (folder / "adapter_model.safetensors").is_file():
            write_peft(folder, config, rank=rank, alpha=2.0 * rank, seed=i)
        adapters.append(folder)
    if converter is None or not converter.is_file():
        return adapters, None, "no convert_lora_to_gguf.py (no llama.cpp source)"
    gguf = work / f"a0-r{rank}.gguf"
    if not gguf.is_file():
        base = write_base_config(work / "base-config", config)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(converter.parent / "gguf-py"), env.get("PYTHONPATH", "")]
        )
        cmd = [sys.executable, str(converter), str(adapters[0]), "--base", str(base),
               "--outtype", "f16", "--outfile", str(gguf)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            return adapters, None, f"convert_lora_to_gguf.py failed: {proc.stderr[-2000:]}"
    return adapters, gguf, "convert_lora_to_gguf.py --outtype f16"


def _run_summary(kind: str, users: int, report: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(report, str):
        return {"kind": kind, "users": users, "ok": False, "error": report,
                "load_avg": os.getloadavg()[0]}  # fmt: skip
    return {
        "kind": kind,
        "users": users,
        "ok": report["requests"]["ok"] == report["requests"]["planned"],
        "output_tokens": report["output_tokens_total"],
        "duration_s": report["duration_s"],
        "output_tok_s": round(report["output_token_throughput_tps"], 2),
        "itl_p99_ms": None if report["latency_s"]["itl"]["p99"] is None
        else round(report["latency_s"]["itl"]["p99"] * 1e3, 1),
        "load_avg": round(os.getloadavg()[0], 2),
    }  # fmt: skip


def run(
    model_path: Path,
    model_name: str,
    chat_path: Path,
    *,
    levels: list[tuple[int, int]],
    mixed: tuple[int, int],
    output_tokens: int,
    threads: int,
    rank: int,
    rounds: int,
    work: Path,
    llama_server: Path | None,
    converter: Path | None,
    say: Any = _say,
) -> tuple[LoraFigures, str]:
    """Both comparisons; the figures and how a0's GGUF was made (or why not)."""
    from benchmarks import bench_llama_cpp, bench_serving
    from loadtest.launch import ServerProcess

    adapters, gguf, gguf_note = prepare(model_path, work, rank, converter)
    figures = LoraFigures(model_name, cpu_model(), rank, mixed[0])
    serve = ["--runner", "torch", "--model", str(model_path), "--threads", str(threads)]
    loras = [a for i, path in enumerate(adapters) for a in ("--lora", f"a{i}={path}")]
    serve_all = [*serve, *loras, "--max-loras", str(NUM_ADAPTERS)]

    def workload(num_requests: int, names: tuple[str, ...]) -> Any:
        base = bench_serving.chat128_workload(chat_path, num_requests, output_tokens)
        from dataclasses import replace

        return replace(base, adapters=names)

    def load(users: int, num_requests: int, desc: str) -> dict[str, Any]:
        return {"users": users, "num_requests": num_requests, "duration_s": 3600.0,
                "progress": False, "desc": desc}  # fmt: skip

    # 1. 8 adapters mixed against the base, on one server: base, lora, lora, base per round.
    users, num_requests = mixed
    say(f"[lora] mixed: {users} users, {NUM_ADAPTERS} adapters against the base ({model_name})")
    names = tuple(f"a{i}" for i in range(NUM_ADAPTERS))
    with ServerProcess(serve_all) as server:
        bench_serving.warm_and_run(
            server, workload(NUM_ADAPTERS, names), **load(NUM_ADAPTERS, NUM_ADAPTERS, "warm")
        )
        for _ in range(rounds):
            for kind in (
                "kvserve-base",
                "kvserve-8-adapters",
                "kvserve-8-adapters",
                "kvserve-base",
            ):
                chosen = names if kind == "kvserve-8-adapters" else ()
                report = bench_serving.run_load(
                    server, workload(num_requests, chosen), **load(users, num_requests, kind)
                )
                figures.runs.append(_run_summary(kind, users, report))
                say(f"[lora]   {kind}: {figures.runs[-1].get('output_tok_s')} tok/s")
    # 2. One adapter against llama-server --lora, per level: kvserve, llama, llama, kvserve.
    for users, num_requests in levels:
        say(f"[lora] one adapter against llama.cpp: {users} users")
        for _ in range(rounds):
            for kind in (
                "kvserve-1-adapter",
                "llama.cpp-lora",
                "llama.cpp-lora",
                "kvserve-1-adapter",
            ):
                report: dict[str, Any] | str
                if kind.startswith("kvserve"):
                    with ServerProcess([*serve, "--lora", f"a0={adapters[0]}"]) as server:
                        report = bench_serving.warm_and_run(
                            server,
                            workload(num_requests, ("a0",)),
                            **load(users, num_requests, kind),
                        )
                elif llama_server is None or gguf is None:
                    report = "not measured: " + (gguf_note if gguf is None else "no llama-server")
                else:
                    try:
                        with bench_llama_cpp.LlamaServer(
                            llama_server, model_path, threads, extra=("--lora", str(gguf))
                        ) as peer:
                            report = bench_serving.warm_and_run(
                                peer, workload(num_requests, ()), api="openai",
                                **load(users, num_requests, kind),
                            )  # fmt: skip
                    except (RuntimeError, TimeoutError, OSError) as e:
                        report = f"not measured: {type(e).__name__}: {e}"
                figures.runs.append(_run_summary(kind, users, report))
                say(f"[lora]   {kind}: {figures.runs[-1].get('output_tok_s')} tok/s")
    return figures, gguf_note


def format_table(f: LoraFigures) -> str:
    v = f.verdicts()

    def r(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}x"

    lines = [
        f"LoRA adapters (lora): {f.model}, random rank-{f.rank} adapters on every projection; "
        f"CPU {f.cpu}; output tok/s pooled over interleaved runs.",
        "",
        "| comparison | users | kvserve tok/s | other tok/s | ratio | target |",
        "|---|---|---|---|---|---|",
        f"| 8 adapters mixed vs the base alone | {f.mixed_users} | "
        f"{f.pooled('kvserve-8-adapters', f.mixed_users):.1f} | "
        f"{f.pooled('kvserve-base', f.mixed_users):.1f} | {r(v['mixed_vs_base'])} | "
        f">= {TARGET_MIXED}x |",
    ]
    for users, target in TARGET_VS_LLAMA.items():
        lines.append(
            f"| 1 adapter vs llama-server --lora | {users} | "
            f"{f.pooled('kvserve-1-adapter', users):.1f} | "
            f"{f.pooled('llama.cpp-lora', users):.1f} | {r(v[f'vs_llama_{users}'])} | "
            f">= {target}x |"
        )
    loads = [run["load_avg"] for run in f.runs]
    if loads:
        lines.append(f"\nLoad average during the runs: {min(loads):.1f} .. {max(loads):.1f}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import bench_llama_cpp, bench_models

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_lora", description=__doc__)
    p.add_argument("--model", default="random-1b-q4km", choices=bench_models.MODELS)
    p.add_argument("--workload-file", type=Path, required=True, help="chat128's prompt file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--output-tokens", type=int, default=None,
        help="tokens per answer (default: chat128's 128; fewer to fit a busy machine's time)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny counts (wiring, not figures)")
    p.add_argument("--llama-cpp", default="cached", choices=("build", "cached", "off"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    cache_dir = bench_llama_cpp.default_cache_dir(os.environ)
    llama = bench_llama_cpp.find_llama_cpp(args.llama_cpp, cache_dir, say=_say)
    quantize = (llama.binary.parent / "llama-quantize") if llama.binary else Path("/nonexistent")
    work = cache_dir.parent.parent / "models"
    ((path, _),) = bench_models.build_models([args.model], work, quantize).values()
    converter = converter_path(cache_dir)
    quick = args.quick
    figures, note = run(
        path, args.model, args.workload_file,
        levels=[(1, 1), (2, 2)] if quick else [(1, 4), (8, 16)],
        mixed=(2, 2) if quick else (8, 16),
        output_tokens=args.output_tokens or (8 if quick else 128),
        threads=args.threads, rank=4 if quick else args.rank, rounds=args.rounds,
        work=work / "lora", llama_server=llama.binary, converter=converter,
    )  # fmt: skip
    print(format_table(figures))
    print(f"\na0 as GGUF: {note}")
    if args.json:
        args.json.write_text(
            json.dumps(asdict(figures) | {"verdicts": figures.verdicts()}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
