"""The quantized path's answers against the same file dequantized to fp32: vLLM's rule.

    python -m benchmarks.bench_answers                        # the three models of `models`
    python -m benchmarks.bench_answers --models embedded --tokens 16

For each model (``bench_models``'s files: the embedded Q4_1, its Q4_K_M, the random 1B Q4_K_M)
and each of 8 chat prompts, 64 free-running greedy tokens from kvserve's quantized path (the
kernels, at the server's default activation precision) and from the same GGUF dequantized to
fp32 (``--weights float32``), each with its step's log-probabilities. vLLM's
``check_logprobs_close``: where the two token streams first differ, each side's token must be
in the other's top 5, within 0.5 nats of the other's top. The table gives each prompt's first
divergence and both gaps. The random 1B model's text is noise; the rule still holds or not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning Python.",
    "What is the boiling point of water?",
)
TOP_K = 5
MAX_GAP_NATS = 0.5


@dataclass(slots=True)
class Divergence:
    model: str
    prompt: str
    first_diff: int | None  # None: identical for all tokens
    ours_in_ref_top5: bool = True
    ref_in_ours_top5: bool = True
    gap_in_ref: float = 0.0  # ref's top logprob minus ours' token's, in the reference
    gap_in_ours: float = 0.0
    answer: str = ""

    @property
    def ok(self) -> bool:
        return self.first_diff is None or (
            self.ours_in_ref_top5
            and self.ref_in_ours_top5
            and self.gap_in_ref <= MAX_GAP_NATS
            and self.gap_in_ours <= MAX_GAP_NATS
        )


def free_running(
    model: object, ids: list[int], tokens: int, adapter: str | Path | None = None
) -> tuple[list[int], list[object]]:
    """``tokens`` greedy tokens after ``ids`` and each step's log-probabilities (one request
    through the runner: a prefill, then decode steps), with the LoRA ``adapter`` (a PEFT
    directory or a GGUF LoRA file) when given."""
    import torch

    from model_runner.config import RunnerOptions
    from model_runner.runner import TorchRunner
    from scheduler import SamplingParams
    from scheduler.output import ScheduledSeq, SchedulerOutput

    block = 16
    blocks = -(-(len(ids) + tokens) // block)
    options = RunnerOptions(blocks, block, dtype=torch.float32, device="cpu", kv_dtype="float32")
    runner = TorchRunner(model.config, model.state_dict, options)  # type: ignore[attr-defined]
    lora = None
    if adapter is not None:
        runner.lora.load("adapter", adapter)
        lora = runner.lora.resolve("adapter")
    table = list(range(blocks))
    greedy = SamplingParams(temperature=0.0)
    first = ScheduledSeq("a", list(ids), 0, table, greedy, True, lora=lora)
    step = SchedulerOutput(0, prefill=[first])
    logits = runner.step_logits(step)["a"][-1]
    out: list[int] = []
    logprobs: list[object] = []
    for i in range(tokens):
        lp = torch.log_softmax(logits.double(), dim=-1)
        logprobs.append(lp)
        out.append(int(lp.argmax()))
        if i == tokens - 1:
            break
        pos = len(ids) + i
        step = SchedulerOutput(
            1 + i, decode=[ScheduledSeq("a", [out[-1]], pos, table, greedy, True, lora=lora)]
        )
        logits = runner.step_logits(step)["a"][-1]
    return out, logprobs


def compare(name: str, prompt: str, ours: tuple[list[int], list[object]],
            ref: tuple[list[int], list[object]], answer: str) -> Divergence:  # fmt: skip
    a, a_lp = ours
    b, b_lp = ref
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    d = Divergence(name, prompt, first, answer=answer)
    if first is None:
        return d
    la, lb = a_lp[first], b_lp[first]
    d.ours_in_ref_top5 = a[first] in lb.topk(TOP_K).indices.tolist()  # type: ignore[attr-defined]
    d.ref_in_ours_top5 = b[first] in la.topk(TOP_K).indices.tolist()  # type: ignore[attr-defined]
    d.gap_in_ref = float(lb[b[first]] - lb[a[first]])  # type: ignore[index]
    d.gap_in_ours = float(la[a[first]] - la[b[first]])  # type: ignore[index]
    return d


def run(files: dict[str, Path], tokens: int, threads: int, say: object = print) -> list[Divergence]:
    """Every model's 8 prompts (the quantized path and the dequantized one, one model at a
    time so that only one fp32 copy is resident)."""
    import torch

    from model_runner.loader import load_model

    torch.set_num_threads(threads)
    rows: list[Divergence] = []
    for name, path in files.items():
        say(f"[answers] {name}: {len(PROMPTS)} prompts x {tokens} tokens")  # type: ignore[operator]
        quantized = load_model(str(path), weights="auto")
        chats = {}
        for p in PROMPTS:
            text = quantized.tokenizer.apply_chat_template([{"role": "user", "content": p}])
            chats[p] = quantized.tokenizer.encode(text, add_special_tokens=False)
        ours = {p: free_running(quantized, ids, tokens) for p, ids in chats.items()}
        answers = {
            p: quantized.tokenizer.decode(ours[p][0], skip_special_tokens=True) for p in PROMPTS
        }
        del quantized
        dense = load_model(str(path), weights="float32")
        for p, ids in chats.items():
            rows.append(compare(name, p, ours[p], free_running(dense, ids, tokens), answers[p]))
        del dense
    return rows


def format_table(rows: list[Divergence]) -> str:
    lines = [
        f"vLLM's rule, quantized path against the same file dequantized to fp32: where greedy "
        f"tokens first differ, each side's token in the other's top {TOP_K} within "
        f"{MAX_GAP_NATS} nats.",
        "",
        "| model | prompt | first difference | gap in fp32 | gap in ours | holds | answer starts |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        where = "none" if r.first_diff is None else f"token {r.first_diff}"
        start = r.answer.replace("\n", " ").replace("|", "/")[:48]
        lines.append(
            f"| {r.model} | {r.prompt} | {where} | {r.gap_in_ref:.3f} | {r.gap_in_ours:.3f} | "
            f"{'yes' if r.ok else 'NO'} | {start} |"
        )
    held = sum(r.ok for r in rows)
    lines.append(f"\n{held} / {len(rows)} hold.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import bench_llama_cpp, bench_models

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_answers", description=__doc__.splitlines()[0]
    )
    p.add_argument("--models", default=",".join(bench_models.MODELS))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    cache_dir = bench_llama_cpp.default_cache_dir(os.environ)
    tools = bench_models._tools(cache_dir)
    built = bench_models.build_models(args.models.split(","), cache_dir.parent.parent / "models",
                                      tools["llama-quantize"])  # fmt: skip
    rows = run({n: path for n, (path, _) in built.items()}, args.tokens, args.threads,
               say=lambda m: print(m, file=sys.stderr, flush=True))  # fmt: skip
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"ok": r.ok} for r in rows], indent=1))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
