"""Rotary position embeddings as kvserve's model holds them: one angle per pair of a head's
dimensions, and the magnitude the pair's (cos, sin) carries.

Every path (the torch forward, the Triton fusions, the kernels' fused step, attention sinks'
re-rotation) rotates all ``head_dim / 2`` pairs by a table's (cos, sin), so the model's RoPE
variants are all in the table:

- the scalings of Hugging Face's ``ROPE_INIT_FUNCTIONS``: none, ``linear``, ``llama3``, and
  ``longrope`` (also spelled ``su``; Phi-3 / Phi-4), per-frequency short and long factors,
  and an attention factor that scales cos and sin;
- llama.cpp's per-frequency divisors (``rope_freqs.weight``, Llama 3.x GGUFs);
- partial rotary embeddings (``ModelConfig.rotary_dim`` < ``head_dim``; Phi-4-mini rotates
  3/4 of each head): the pairs past the rotary ones get angle 0 and magnitude 1, the identity.

A head's rows are held in pair order (``rope_pair_order``), so a pair is two adjacent values.
``RopeTable`` holds one table's rotations of every position (a model whose layers rotate
differently, Gemma 3's local and global layers, holds two).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from model_runner.config import ModelConfig

_SUPPORTED = "default, linear, llama3, longrope"


def rope_pair_order(head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """The permutation of a head's Hugging Face rows into pair order: the rotary part's
    half-split rows ``(x_0 .. x_{r/2-1}, x_{r/2} .. x_{r-1})`` become pairs
    ``(x_0, x_{r/2}, x_1, ...)``; the rows past ``rotary_dim`` (not rotated) stay put."""
    r = head_dim if rotary_dim is None else rotary_dim
    half = r // 2
    pairs = torch.stack([torch.arange(half), torch.arange(half, r)], dim=1).flatten()
    return torch.cat([pairs, torch.arange(r, head_dim)])


def rope_inv_freq(config: ModelConfig, max_model_len: int | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (fp32) with the checkpoint's theta and scaling; 0
    for the pairs past ``rotary_dim``. ``max_model_len`` (default: the config's positions)
    picks longrope's long factors when it exceeds ``original_max_position_embeddings``.

    Anything this does not know raises, because the model would silently write wrong text.
    """
    inv_freq = _rotary_inv_freq(config, max_model_len)
    pad = config.head_dim // 2 - inv_freq.numel()
    return torch.cat([inv_freq, torch.zeros(pad)]) if pad else inv_freq


def rope_magnitude(config: ModelConfig) -> torch.Tensor:
    """The magnitude [head_dim / 2] of each pair's (cos, sin): longrope's attention factor
    on the rotary pairs (Hugging Face multiplies cos and sin by it), else 1."""
    mag = torch.ones(config.head_dim // 2)
    mag[: config.rope_dim // 2] = _attention_factor(config)
    return mag


def _rope_type(config: ModelConfig) -> str:
    scaling = config.rope_scaling or {}
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    return "longrope" if kind == "su" else kind


def _rotary_inv_freq(config: ModelConfig, max_model_len: int | None) -> torch.Tensor:
    dim = config.rope_dim
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**shape)
    freq_factors = config.extra.get("rope_freqs")
    rope_type = _rope_type(config)
    if freq_factors is not None:
        # llama.cpp's GGUF stores Llama-3.x rope scaling as per-frequency divisors
        # (``rope_freqs.weight``, ggml's freq_factors) instead of a rope_scaling entry.
        if len(freq_factors) != dim // 2:
            raise ValueError(
                f"rope_freqs has {len(freq_factors)} factors, head_dim {dim} needs {dim // 2}"
            )
        if rope_type == "llama3":
            raise ValueError("rope_freqs and rope_scaling llama3 both scale RoPE: keep one")
        return inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling or {}
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if rope_type == "longrope":
        return _longrope(config, shape, max_model_len)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: {_SUPPORTED})")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _longrope(config: ModelConfig, shape: torch.Tensor, max_model_len: int | None) -> torch.Tensor:
    """transformers' ``_compute_longrope_parameters``: ``1 / (factors * theta ** shape)``,
    with the long factors when a sequence can run past the original context. transformers
    switches per forward pass (long once its positions pass it, the cached keys staying as
    they were rotated); kvserve fixes the choice for the run by ``max_model_len``, as vLLM
    and llama.cpp do, so a block's keys never depend on the batch that wrote them."""
    scaling = config.rope_scaling or {}
    original = _original(config)
    long = (max_model_len or config.max_position_embeddings) > original
    factors = scaling["long_factor" if long else "short_factor"]
    if len(factors) != config.rope_dim // 2:
        raise ValueError(
            f"longrope has {len(factors)} factors; {config.rope_dim} rotary dimensions need "
            f"{config.rope_dim // 2}"
        )
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * config.rope_theta**shape)


def _attention_factor(config: ModelConfig) -> float:
    """longrope's cos / sin scale: the config's ``attention_factor``, else
    ``sqrt(1 + ln(s) / ln(original))`` with ``s = factor`` or max / original positions
    (1 when ``s <= 1``); 1 for every other RoPE."""
    if _rope_type(config) != "longrope":
        return 1.0
    scaling = config.rope_scaling or {}
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = _original(config)
    factor = scaling.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _original(config: ModelConfig) -> int:
    """longrope's original context: the scaling's, else (as transformers' standardization
    sets it) the config's positions."""
    scaling = config.rope_scaling or {}
    return int(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)


class RopeTable:
    """One RoPE table of every position below ``max_len``: complex rotations
    ``mag * exp(i * angle)`` [max_len, 1, D/2] on fp32 runs (``cis``), cos / sin in the run's
    dtype [max_len, 1, D/2] on half-precision ones."""

    def __init__(
        self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_len = max_len
        self.dtype = dtype
        self.inv_freq = rope_inv_freq(config, max_len).to(device)
        self.mag = rope_magnitude(config).to(device)  # longrope's scale on cos and sin
        angles = torch.outer(torch.arange(max_len, device=device).float(), self.inv_freq)
        self.cis: torch.Tensor | None = None
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        if dtype == torch.float32:
            self.cis = self._rotations(angles).unsqueeze(1)
        else:
            self.cos, self.sin = self._cos_sin(angles)

    def _rotations(self, angles: torch.Tensor) -> torch.Tensor:
        """``mag * exp(i * angles)`` (complex64) for ``angles`` [..., D/2]."""
        return torch.polar(self.mag.expand_as(angles).contiguous(), angles)

    def _cos_sin(self, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``mag * (cos, sin)`` of ``angles`` [N, D/2] in the table's dtype, [N, 1, D/2]."""
        cos, sin = angles.cos() * self.mag, angles.sin() * self.mag
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)

    def rows(self, positions: torch.Tensor, max_position: int) -> RopeRows:
        """The rotations of ``positions`` [T] (largest ``max_position``); past the table
        (attention sinks stream past the context) the same product, computed for these
        positions only."""
        if max_position >= self.max_len:
            angles = positions.float().unsqueeze(1) * self.inv_freq
            if self.cis is not None:
                return RopeRows(cis=self._rotations(angles).unsqueeze(1))
            cos, sin = self._cos_sin(angles)
            return RopeRows(cos=cos, sin=sin)
        if self.cis is not None:
            return RopeRows(cis=self.cis.index_select(0, positions))
        assert self.cos is not None and self.sin is not None
        return RopeRows(
            cos=self.cos.index_select(0, positions), sin=self.sin.index_select(0, positions)
        )


@dataclass(frozen=True, slots=True)
class RopeRows:
    """One step's rotations, a row per token: complex ``cis`` or ``cos`` / ``sin``."""

    cis: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def rotate_(self, rot: torch.Tensor) -> None:
        """RoPE in place on interleaved pairs ``rot`` [T, n, D/2, 2]."""
        if self.cis is not None:
            torch.view_as_complex(rot).mul_(self.cis)
            return
        assert self.cos is not None and self.sin is not None
        x0, x1 = rot[..., 0], rot[..., 1]
        r0 = x0 * self.cos - x1 * self.sin
        r1 = x0 * self.sin + x1 * self.cos
        x0.copy_(r0)
        x1.copy_(r1)
