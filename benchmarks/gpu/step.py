"""The GPU sections' step measurements: decode steps timed and profiled, and the closed serving
loop with the GPU's busy time.

- ``measure_decode``: the median wall time of a decode step at one batch size and context.
- ``profile_decode``: torch.profiler over a few such steps; the kernels that took the most
  device time, each with its share of the step (CUDA activity on a GPU; on CPU, in the dry
  run, the CPU ops: the same code, figures that mean nothing).
- ``serve_closed_loop``: users in closed loop through the engine's three calls (``schedule``,
  ``execute``, ``update``), in process; output tokens per second and the GPU's busy fraction,
  the device time of each step's forward from CUDA events (``ForwardTimer``) over the wall.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.harness.sizes import Sizes
from cache_manager import KVCacheConfig, KVCacheManager
from model_runner.runner import TorchRunner
from model_runner.step import StepRows
from scheduler import Request, Scheduler, SchedulerConfig
from scheduler.output import ScheduledSeq, SchedulerOutput
from scheduler.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def greedy_seq(rid: str, token_ids: list[int], start: int, block_ids: list[int]) -> ScheduledSeq:
    """A scheduled greedy seq computing ``token_ids`` from position ``start``."""
    return ScheduledSeq(rid, token_ids, start, block_ids, GREEDY, True)


def step_plan(step: int, prefill=(), decode=()) -> SchedulerOutput:  # type: ignore[no-untyped-def]
    """A scheduler output of these prefill and decode seqs."""
    return SchedulerOutput(step_id=step, prefill=list(prefill), decode=list(decode))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepare_decode(
    runner: TorchRunner, sizes: Sizes, batch: int
) -> Callable[[int], SchedulerOutput]:
    """Fill ``batch`` requests' contexts to ``decode_context`` keys (prefill steps, not
    timed); the plan of their ``s``-th decode step, for s below ``decode_steps``."""
    bs, ctx = sizes.block_size, sizes.decode_context
    pages = -(-(ctx + sizes.decode_steps + 1) // bs)
    if batch * pages > runner.num_blocks:
        raise ValueError(f"decode batch {batch} needs {batch * pages} blocks > {runner.num_blocks}")
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    chunk = max(1, sizes.max_num_batched_tokens // ctx)
    step = 0
    for i in range(0, batch, chunk):
        prefill = [
            greedy_seq(f"r{j}", [1] * ctx, 0, tables[j]) for j in range(i, min(batch, i + chunk))
        ]
        runner.execute(step_plan(step, prefill=prefill))
        step += 1

    def decode(s: int) -> SchedulerOutput:
        if not 0 <= s < sizes.decode_steps:
            raise ValueError(f"decode step {s} outside 0..{sizes.decode_steps - 1}")
        seqs = [greedy_seq(f"r{j}", [2], ctx + s, tables[j]) for j in range(batch)]
        return step_plan(step + s, decode=seqs)

    return decode


def measure_decode(runner: TorchRunner, sizes: Sizes, batch: int) -> float:
    """Median seconds of a decode step of ``batch`` requests at ``decode_context`` keys."""
    decode = prepare_decode(runner, sizes, batch)
    times: list[float] = []
    for s in range(sizes.decode_steps):
        plan = decode(s)
        t0 = time.perf_counter()
        runner.execute(plan)  # returns host tokens: the step has finished on the device
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


@dataclass(slots=True)
class StepProfile:
    """Where ``steps`` decode steps of ``batch`` went: the wall time of one, the device time
    of all the kernels (ops on CPU) in one, and the top kernels."""

    batch: int
    steps: int
    step_ms: float
    kernels_ms: float  # device time of every kernel, per step (on CPU: every op's self time)
    top: list[dict[str, Any]]  # name, us per step, calls per step, share of the step


def _device_self_us(event: Any, cuda: bool) -> float:
    """An averaged event's own time (µs, all calls): device time of a kernel on CUDA, the
    CPU self time of an op otherwise."""
    if not cuda:
        return float(event.self_cpu_time_total)
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profile_decode(
    runner: TorchRunner, sizes: Sizes, batch: int, num_steps: int, top: int = 12
) -> StepProfile:
    """torch.profiler over ``num_steps`` decode steps of ``batch`` requests (after one
    unprofiled step): the ``top`` kernels by device time, each with its time per step and
    its share of the step's wall time. CUDA activity on a GPU, CPU activity elsewhere."""
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    num_steps = max(1, min(num_steps, sizes.decode_steps - 1))
    decode = prepare_decode(runner, sizes, batch)
    runner.execute(decode(0))
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        _sync(runner.device)
        t0 = time.perf_counter()
        for s in range(1, num_steps + 1):
            runner.execute(decode(s))
        _sync(runner.device)
        wall = time.perf_counter() - t0
    rows = []
    for e in prof.key_averages():
        us = _device_self_us(e, cuda)
        if us > 0:
            rows.append((us, e.key, e.count))
    rows.sort(reverse=True)
    step_us = wall / num_steps * 1e6
    total_us = sum(us for us, _, _ in rows) / num_steps
    return StepProfile(
        batch=batch,
        steps=num_steps,
        step_ms=step_us / 1e3,
        kernels_ms=total_us / 1e3,
        top=[
            {
                "name": name,
                "us": us / num_steps,
                "calls": count / num_steps,
                "of_step": us / num_steps / step_us,
            }
            for us, name, count in rows[:top]
        ],
    )


class ForwardTimer:
    """Stands in for a runner's ``paths`` and times each step's forward: a CUDA event
    recorded before the forward's host preparation and one after its last kernel is queued,
    so a span is the forward's device time (its host preparation counted, the LM head and
    sampling not); host time on CPU. ``busy_s`` sums the spans."""

    def __init__(self, paths: Any, device: torch.device) -> None:
        self.inner = paths
        self.device = device
        self.events: list[tuple[Any, Any]] = []
        self.host_s = 0.0
        self.steps = 0

    def forward(self, step: StepRows) -> torch.Tensor:
        self.steps += 1
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            out = self.inner.forward(step)
            self.host_s += time.perf_counter() - t0
            return out  # type: ignore[no-any-return]
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.inner.forward(step)
        end.record()
        self.events.append((start, end))
        return out  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def busy_s(self) -> float:
        if self.device.type != "cuda":
            return self.host_s
        _sync(self.device)
        return sum(s.elapsed_time(e) for s, e in self.events) / 1e3


def serve_closed_loop(
    runner: TorchRunner, sizes: Sizes, num_users: int, prompts: Sequence[list[int]]
) -> dict[str, float]:
    """``num_users`` users, each sending its next prompt when the last one finished
    (``output_len`` greedy tokens, ``ignore_eos``): output tokens per second over the whole
    run, its steps, and the GPU's busy fraction (``ForwardTimer``'s spans over the wall)."""
    kv = KVCacheManager(KVCacheConfig(num_blocks=runner.num_blocks, block_size=sizes.block_size))
    config = SchedulerConfig(
        max_num_seqs=num_users,
        max_num_batched_tokens=sizes.max_num_batched_tokens,
        max_model_len=runner.info.max_model_len,
    )
    sched = Scheduler(config, kv)
    pending = list(enumerate(prompts))
    pending.reverse()

    def submit() -> None:
        i, prompt = pending.pop()
        sampling = SamplingParams(temperature=0.0, max_tokens=sizes.output_len, ignore_eos=True)
        sched.add_request(Request(f"u{i}", list(prompt), sampling))

    for _ in range(min(num_users, len(pending))):
        submit()
    timer = ForwardTimer(runner.paths, runner.device)
    runner.paths = timer  # type: ignore[assignment]
    output_tokens = steps = 0
    try:
        t0 = time.perf_counter()
        while sched.num_waiting or sched.num_running:
            plan = sched.schedule()
            result = runner.execute(plan)
            steps += 1
            for out in sched.update(plan, result):
                output_tokens += len(out.new_token_ids)
                if out.finished and pending:
                    submit()
        _sync(runner.device)
        wall = time.perf_counter() - t0
    finally:
        runner.paths = timer.inner
    busy = timer.busy_s()
    return {
        "output_tokens": output_tokens,
        "wall_s": wall,
        "tok_s": output_tokens / wall,
        "steps": steps,
        "forward_steps": timer.steps,
        "gpu_busy": busy / wall,
    }
