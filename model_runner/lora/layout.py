"""An adapter's pairs, checked against the base model and laid out as kvserve's model holds
its weights (``LoraWeights``).

kvserve's model (``model_runner.model``) does not hold Hugging Face's Q and K rows: each
head's rows go from the half-split RoPE order ``(x_0 .. x_{D/2-1}, x_{D/2} .. x_{D-1})`` to
interleaved pairs ``(x_0, x_{D/2}, x_1, ...)``, and Q carries the softmax scale (``1/sqrt(D)``).
An update ``B @ A`` of Q or K must land in the same rows, so B's rows get the same
permutation (and Q's B the same scale); A, which reads the input, is untouched. A GGUF
adapter's Q and K rows come permuted as llama.cpp permutes its base (``files``): they are
put back in Hugging Face's order first, with the base's head counts.

Each pair is held as ``a`` ``[r, in]`` and ``bt = (scaling * B).T`` ``[r, out]`` (both
contiguous along the long dimension, as the grouped products read them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from model_runner.config import ModelConfig
from model_runner.families import family
from model_runner.lora.files import AdapterFile, LoraPair
from model_runner.lora.info import AdapterError
from model_runner.lora.targets import BY_NAME, FUSED_MODULES, TARGET_OF, target_shapes, targets_of
from model_runner.rope import rope_pair_order

if TYPE_CHECKING:
    import ctypes

    from model_runner.kernels import LoraPair as NativePair


def check_fits(adapter: AdapterFile, config: ModelConfig, max_rank: int) -> None:
    """Raise ``AdapterError`` (naming the file and the mismatch) unless every pair of
    ``adapter`` fits ``config``'s model and no rank is over ``max_rank``."""
    path = adapter.path
    arch = adapter.architecture
    moe_layers = set(config.experts.layers) if config.experts is not None else set()
    for layer, module in adapter.pairs:
        target = BY_NAME[TARGET_OF[module]] if module in TARGET_OF else None
        projection = target.projection if target else FUSED_MODULES.get(module)
        if layer in moe_layers and projection in ("gate_up", "down"):
            raise AdapterError(
                f"adapter {path!r} updates layer {layer}'s {module}, but that layer of the "
                f"{config.architecture} base is a mixture of experts: LoRA on experts is not "
                "supported; adapters on the attention (q_proj, k_proj, v_proj, o_proj) and on "
                "dense MLP layers run"
            )
    if arch is not None and arch != family(config.architecture).gguf_arch:
        raise AdapterError(
            f"adapter {path!r} was made for a {arch!r} model; the base model is "
            f"{config.architecture!r}"
        )
    if adapter.rank > max_rank:
        raise AdapterError(
            f"adapter {path!r} has rank {adapter.rank}, over --max-lora-rank {max_rank}: "
            "raise it (it bounds every adapter's memory and step cost) or use a smaller rank"
        )
    shapes = target_shapes(config)
    for (layer, module), pair in unfused_pairs(adapter, config).items():
        if layer >= config.num_layers:
            raise AdapterError(
                f"adapter {path!r} targets layer {layer}; the base model has "
                f"{config.num_layers} layers: it was made for another model"
            )
        out_features, in_features = shapes[TARGET_OF[module]]
        got = (int(pair.b.shape[0]), int(pair.a.shape[1]))
        if got != (out_features, in_features):
            raise AdapterError(
                f"adapter {path!r}: layer {layer} {module} updates a {got[0]} x {got[1]} "
                f"matrix; the base model's is {out_features} x {in_features}: it was made "
                "for another model"
            )


def _unpermute_gguf(b: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's row order of one head group -> Hugging Face's (gguf_loader.unpermute_qk)."""
    half = b.shape[0] // num_heads // 2
    return b.reshape(num_heads, half, 2, -1).transpose(1, 2).reshape(b.shape)


def unfused_pairs(adapter: AdapterFile, config: ModelConfig) -> dict[tuple[int, str], LoraPair]:
    """``adapter``'s pairs, those of a fused projection (Phi-3's ``qkv_proj``,
    ``gate_up_proj``) split into one per part: A shared, B's rows cut at ``config``'s sizes
    (``AdapterError`` when B's rows are not those sizes' sum)."""
    shapes = target_shapes(config)
    out: dict[tuple[int, str], LoraPair] = {}
    for (layer, module), pair in adapter.pairs.items():
        projection = FUSED_MODULES.get(module)
        if projection is None:
            out[(layer, module)] = pair
            continue
        parts = [t.name for t in targets_of(projection)]
        rows = [shapes[t][0] for t in parts]
        if pair.b.shape[0] != sum(rows):
            raise AdapterError(
                f"adapter {adapter.path!r}: layer {layer} {module} updates {pair.b.shape[0]} "
                f"rows; the base model's fused {module} has {sum(rows)}: it was made for "
                "another model"
            )
        for target, b in zip(parts, torch.split(pair.b, rows), strict=True):
            out[(layer, BY_NAME[target].hf_module)] = LoraPair(pair.a, b, pair.scaling)
    return out


def kvserve_rows(
    target: str, pair: LoraPair, config: ModelConfig, qk_layout: str = "hf"
) -> torch.Tensor:
    """``scaling * B`` (fp32, ``[out, r]``) with its rows in kvserve's order for ``target``."""
    b = pair.b * pair.scaling
    info = BY_NAME[target]
    if not info.rotary:
        return b
    heads = config.num_heads if info.out_width == "heads" else config.num_kv_heads
    d = config.head_dim
    fam = family(config.architecture)
    if qk_layout == "gguf" and fam.gguf_qk_permuted:
        b = _unpermute_gguf(b, heads)
    b = b.reshape(heads, d, -1)[:, rope_pair_order(d, config.rope_dim)].reshape(heads * d, -1)
    # Q's rows carry the softmax scale (weights._attention), but not under QK-norm, whose norm
    # weight holds it instead.
    scaled = target == "q" and not fam.qk_norm
    return b * config.softmax_scale if scaled else b


@dataclass(slots=True)
class LoraWeights:
    """One adapter in kvserve's layout: per layer, per target it updates, ``(a, bt)``."""

    digest: str
    rank: int
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    dtype: torch.dtype
    # The kernels' pair table (``lora.native.pair_table``), made on first use on that path.
    native: ctypes.Array[NativePair] | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + bt.nbytes for layer in self.layers for a, bt in layer.values())


def lay_out(
    adapter: AdapterFile, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> LoraWeights:
    """``adapter`` (already ``check_fits``) in kvserve's layout, ``dtype`` on ``device``."""
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
        {} for _ in range(config.num_layers)
    ]
    for (layer, module), pair in unfused_pairs(adapter, config).items():
        target = TARGET_OF[module]
        b = kvserve_rows(target, pair, config, adapter.qk_layout)
        a = pair.a.to(device=device, dtype=dtype).contiguous()
        bt = b.t().to(device=device, dtype=dtype).contiguous()
        layers[layer][target] = (a, bt)
    return LoraWeights(adapter.digest, adapter.rank, layers, dtype)
