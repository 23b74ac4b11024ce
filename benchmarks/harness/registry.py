"""Every benchmark section, CPU and GPU, in one table: its name, its target, the function
that runs it and the sections it needs first. A new section is one line here.

``make bench`` (``run_all``) runs the CPU sections in table order, and ``bench_gpu`` the GPU
ones; ``run`` is the loop both share: each section's result goes into the context's report
as soon as it is measured, and the report is saved after each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from benchmarks.cpu import cache, chat128, models, serving
from benchmarks.gpu import sections as gpu
from benchmarks.harness.context import Context, Target
from benchmarks.harness.report import Report, SectionResult


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    target: Target
    run: Callable[[Context], SectionResult]
    needs: tuple[str, ...] = ()  # sections that run first (their figures are the denominators)


# Every GPU run measures the probes first: the device's own bandwidth and peak, which the
# figures are read against (bench_gpu's tables and docs/gpu.md).
PROBES = ("probes",)
SECTIONS: dict[str, Section] = {
    s.name: s
    for s in (
        # make bench, in the order of its table
        Section("chat128", "cpu", chat128.chat128),
        Section("policy", "cpu", serving.policy),
        Section("slo", "cpu", serving.slo),
        Section("prefix", "cpu", serving.prefix),
        Section("paged", "cpu", cache.paged),
        Section("spec", "cpu", serving.spec),
        Section("kvcache", "cpu", cache.kvcache),
        Section("sinks", "cpu", cache.sinks),
        Section("kernels", "cpu", models.kernels),
        Section("models", "cpu", models.models),
        Section("kvtier", "cpu", models.kvtier),
        Section("lora", "cpu", models.lora),
        # bench_gpu, in the order they run
        Section("probes", "gpu", gpu.probes),
        Section("attention", "gpu", gpu.attention, PROBES),
        Section("decode", "gpu", gpu.decode, PROBES),
        Section("prefill", "gpu", gpu.prefill, PROBES),
        Section("profile", "gpu", gpu.profile, PROBES),
        Section("serving", "gpu", gpu.serving, PROBES),
        Section("server", "gpu", gpu.server, PROBES),
    )
}


def names(target: Target) -> list[str]:
    """The sections of ``target``, in table order."""
    return [s.name for s in SECTIONS.values() if s.target == target]


def parse_names(text: str, target: Target) -> list[str]:
    """``--sections``: comma-separated names of ``target``'s sections (``all``: every one);
    ValueError names the unknown ones and the choices."""
    known = names(target)
    chosen = [n.strip() for n in text.split(",") if n.strip()]
    if chosen == ["all"]:
        return known
    unknown = [n for n in chosen if n not in known]
    if unknown or not chosen:
        raise ValueError(
            f"unknown sections {unknown or repr(text)}: use some of {', '.join(known)} or all"
        )
    return chosen


def plan(target: Target, chosen: Iterable[str]) -> list[Section]:
    """The sections to run for ``chosen``, what they need added, in table order."""
    wanted = set(chosen)
    for name in list(wanted):
        wanted.update(SECTIONS[name].needs)
    return [s for s in SECTIONS.values() if s.target == target and s.name in wanted]


def run(ctx: Context, chosen: Iterable[str]) -> Report:
    """Run the planned sections in order; each result lands in ``ctx.report`` (under its
    name) and the report is saved after each."""
    for section in plan(ctx.target, chosen):
        ctx.report.results[section.name] = section.run(ctx)
        ctx.saved()
    return ctx.report
