"""The one table of what a LoRA adapter may update (``TARGETS``), and everything derived from
it: the Hugging Face and llama.cpp module names adapter files use (``lora.files``), each
target's shape in a base model (``lora.layout``), and the column spans of the fused
projections kvserve's model holds (the torch, Triton and native backends, ``lora.backend``).

kvserve's model holds a layer's projections fused (``weights.load_weights``)::

    qkv     | q: heads x D | k: kv_heads x D | v: kv_heads x D |     (columns of the output)
    o       | o: hidden |
    gate_up | gate: intermediate | up: intermediate |
    down    | down: hidden |

so a target is a span of one projection's output columns, in the table's order. The kernels
(``kernels/lora.h``) hold the same table (each target's name, projection and output width,
by index); ``check_kernel_table`` compares it with this one when the kernels load, as their
format table is compared with ``interleave.GEOMETRY``.

Plain data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model_runner.config import ModelConfig

# A fused projection of a layer, in the order the layer runs them.
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# What a target's output (or input) width is, by name (``widths``).
WIDTHS = ("heads", "kv_heads", "hidden", "intermediate")


@dataclass(frozen=True, slots=True)
class Target:
    """One matrix an adapter may update: kvserve's ``name``, its Hugging Face module
    (``hf_module``, PEFT's key) and llama.cpp's tensor name (``gguf_module``, an adapter
    GGUF's ``blk.N.<gguf_module>.weight.lora_a``), the fused ``projection`` whose output
    columns it is a span of, its output and input widths (``WIDTHS``), and whether its
    output rows are heads that RoPE rotates (``rotary``: their order changes, as the base's
    do, ``lora.layout``)."""

    name: str
    hf_module: str
    gguf_module: str
    projection: str
    out_width: str
    in_width: str
    rotary: bool = False


# In the kernels' order (``kernels/lora.h`` LORA_TARGETS: a target's index is its place here).
TARGETS = (
    Target("q", "q_proj", "attn_q", "qkv", "heads", "hidden", rotary=True),
    Target("k", "k_proj", "attn_k", "qkv", "kv_heads", "hidden", rotary=True),
    Target("v", "v_proj", "attn_v", "qkv", "kv_heads", "hidden"),
    Target("o", "o_proj", "attn_output", "o", "hidden", "heads"),
    Target("gate", "gate_proj", "ffn_gate", "gate_up", "intermediate", "hidden"),
    Target("up", "up_proj", "ffn_up", "gate_up", "intermediate", "hidden"),
    Target("down", "down_proj", "ffn_down", "down", "hidden", "intermediate"),
)
BY_NAME = {t.name: t for t in TARGETS}
TARGET_OF = {t.hf_module: t.name for t in TARGETS}  # Hugging Face module -> target
GGUF_MODULES = {t.gguf_module: t.hf_module for t in TARGETS}  # llama.cpp's name -> HF module
# A checkpoint's fused modules (Phi-3's) -> the projection whose targets' rows they stack.
FUSED_MODULES = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}
# Every module name an adapter may target (PEFT's target_modules).
MODULES = (*TARGET_OF, *FUSED_MODULES)


def targets_of(projection: str) -> tuple[Target, ...]:
    """The targets of ``projection``, in column order."""
    return tuple(t for t in TARGETS if t.projection == projection)


def widths(config: ModelConfig) -> dict[str, int]:
    """Each of ``WIDTHS`` in ``config``'s model."""
    return {
        "heads": config.num_heads * config.head_dim,
        "kv_heads": config.num_kv_heads * config.head_dim,
        "hidden": config.hidden_size,
        "intermediate": config.intermediate_size,
    }


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(out_features, in_features)`` of each target in ``config``'s model."""
    w = widths(config)
    return {t.name: (w[t.out_width], w[t.in_width]) for t in TARGETS}


@dataclass(frozen=True, slots=True)
class Span:
    """A target's output columns ``[col0, col0 + width)`` of its projection."""

    target: str
    col0: int
    width: int


def spans(config: ModelConfig) -> dict[str, tuple[Span, ...]]:
    """Each projection's targets as column spans of its output, for ``config``'s model."""
    w = widths(config)
    out: dict[str, tuple[Span, ...]] = {}
    for projection in PROJECTIONS:
        col0, parts = 0, []
        for t in targets_of(projection):
            parts.append(Span(t.name, col0, w[t.out_width]))
            col0 += w[t.out_width]
        out[projection] = tuple(parts)
    return out


def kernel_rows() -> list[tuple[str, int, int]]:
    """The table as the kernels hold it: per target index, ``(name, projection index,
    output width index)``."""
    return [(t.name, PROJECTIONS.index(t.projection), WIDTHS.index(t.out_width)) for t in TARGETS]


def check_kernel_table(rows: list[tuple[str, int, int]]) -> str | None:
    """Why the kernels' target table (``kv_lora_target``'s rows) differs from ``TARGETS``,
    or None."""
    ours = kernel_rows()
    if rows == ours:
        return None
    return (
        f"the kernels' LoRA targets {rows} differ from lora.targets.TARGETS' {ours} "
        "(name, projection, output width)"
    )
