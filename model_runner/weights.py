"""The model's weights as it runs them: prepared once at load, each matrix made a layer by
``Linears.make_linear``, the one place a linear layer is chosen.

Hugging Face parameter names come in; at load time the weights are rearranged for speed:

- Q, K, V projections are fused into one ``[(H + 2 * kvh) * D, hidden]`` matrix (one GEMM),
  with the Qwen2 QKV bias fused alike.
- The softmax scale (``1/sqrt(D)``, Gemma's ``query_pre_attn_scalar ** -0.5``) is folded
  into the Q rows (attention runs with scale 1).
- Q and K rows are permuted inside each head from Hugging Face's half-split RoPE layout
  ``(x_0..x_{D/2-1}, x_{D/2}..x_{D-1})`` to interleaved pairs ``(x_0, x_{D/2}, x_1, ...)``, so
  RoPE is one in-place complex multiply. Q and K get the same permutation, so q.k (and
  attention) is unchanged; the pool stores keys in this layout. With partial rotary
  embeddings only the rotary dimensions are paired; the rest stay in place
  (``rope.rope_pair_order``).
- A checkpoint's fused ``qkv_proj`` / ``gate_up_proj`` (Phi-3) is split by rows first, so
  its parts are prepared as separate ones are.
- Gate and up are fused into one ``[2 * I, hidden]`` matrix, except on oneDNN, whose packed
  GEMMs fuse SiLU into the gate GEMM and the ``* up`` product into the up GEMM (``GateUp``).
- A layer of a mixture-of-experts model (``config.experts.layers``) has a ``moe.MoeMlp``
  instead of the dense MLP: its router and each expert's gate-up and down prepared as above.
- A norm weight is what the norm multiplies by: a family's ``norm_offset`` is added (Gemma's
  ``1 + w``), and such norms stay fp32 (Gemma computes them so).

A quantized matrix (``QuantWeight``, ``QuantStack``) stays in its own format and runs on
kvserve's CPU kernels (``QLinear``); a dense one runs as ``Linear``: on CPU pre-packed for
oneDNN (``torch.ops.mkldnn``), whose skinny GEMM streams fp32 weights near memory bandwidth
where MKL's ``F.linear`` reaches about half of it, and which fuses the residual add into the
output and down GEMMs; elsewhere (CUDA, or when the self-check fails) plain ``F.linear`` /
``addmm``. Every layer has the same calls (``linear(x)``, ``silu``, ``mul``, ``add``,
``silu_mul``), so the model never asks which it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar, overload

import torch
import torch.nn.functional as F

from model_runner import onednn
from model_runner.config import ModelConfig
from model_runner.families import family
from model_runner.moe import MoeMlp, expert_matrices, has_fused_experts
from model_runner.quant import QEmbedding, QLinear, QuantStack, QuantWeight, cat_rows
from model_runner.rope import rope_pair_order

Matrix = torch.Tensor | QuantWeight  # as a checkpoint holds it
Weight = Matrix | QuantStack  # prepared: Q, K and V of several formats stack
StateDict = Mapping[str, Matrix]
# What ``_parts`` reads and returns: vectors (plain tensors) or matrices as held.
_Read = TypeVar("_Read", torch.Tensor, Matrix)


class Linear:
    """``y = x @ W.T + b`` with optional fused epilogues; the weight is either a plain tensor
    or a oneDNN-packed one (CPU)."""

    __slots__ = ("bias", "out_features", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.packed = pack
        if pack:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        else:
            self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return onednn.linear(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(linear(x))``."""
        if self.packed:
            return onednn.linear(x, self.weight, self.bias, "swish", [], "")
        return F.silu(F.linear(x, self.weight, self.bias))

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``linear(x) * other``."""
        if self.packed:
            return onednn.linear_binary(x, other, self.weight, self.bias, "mul")
        return F.linear(x, self.weight, self.bias).mul_(other)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + linear(x)`` (a new tensor; ``residual`` is not modified)."""
        if self.packed:
            return onednn.linear_binary(x, residual, self.weight, self.bias, "add")
        if self.bias is None:
            return torch.addmm(residual, x, self.weight.t())
        return F.linear(x, self.weight, self.bias).add_(residual)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for a weight holding the gate rows, then the up rows."""
        gu = self(x)
        inter = gu.shape[-1] // 2
        return F.silu(gu[:, :inter]).mul_(gu[:, inter:])

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]


class GateUp:
    """``silu(gate) * up`` as two GEMMs: on oneDNN SiLU fused into the gate's, the product
    into the up's (one fused matrix would need the split and SiLU as two more ops)."""

    __slots__ = ("gate", "up")

    def __init__(self, gate: Linear | QLinear, up: Linear | QLinear) -> None:
        self.gate = gate
        self.up = up

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The gate, then the up projections [T, 2 * inter], as the fused matrix gives them
        (a LoRA step adds its updates to them before the SiLU)."""
        return torch.cat([self.gate(x), self.up(x)], dim=-1)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.up.mul(x, self.gate.silu(x))

    def tensors(self) -> list[torch.Tensor]:
        return [*self.gate.tensors(), *self.up.tensors()]


class Embedding:
    """The dense embedding lookup (``QEmbedding`` is the quantized one)."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]


AnyLinear = Linear | QLinear


def onednn_works(dtype: torch.dtype) -> bool:
    """Self-check of the oneDNN path on this machine: every epilogue against ``F.linear``."""
    if not onednn.available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=g).to(dtype)
        b = torch.randn(24, generator=g).to(dtype)
        x = torch.randn(3, 16, generator=g).to(dtype)
        other = torch.randn(3, 24, generator=g).to(dtype)
        packed = Linear(w, b, pack=True)
        dense = Linear(w, b, pack=False)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return all(
            torch.allclose(p.float(), d.float(), atol=tol, rtol=tol)
            for p, d in (
                (packed(x), dense(x)),
                (packed.silu(x), dense.silu(x)),
                (packed.mul(x, other), dense.mul(x, other)),
                (packed.add(x, other), dense.add(x, other)),
            )
        )
    except RuntimeError:
        return False


class Linears:
    """Makes the model's layers from prepared weights, in the run's dtype on its device:
    ``make_linear`` is the one place a linear layer is chosen. ``use_onednn=None``: packed
    for oneDNN on CPU when its self-check passes; ``activation_bits``: the quantized kernels'
    activation precision (``quant.ACTIVATION_BITS``)."""

    def __init__(
        self,
        dtype: torch.dtype,
        device: torch.device,
        use_onednn: bool | None = None,
        activation_bits: int = 16,
    ) -> None:
        if use_onednn is None:
            use_onednn = device.type == "cpu" and onednn_works(dtype)
        elif use_onednn and (device.type != "cpu" or not onednn_works(dtype)):
            raise ValueError(f"oneDNN linear layers unavailable for {device} / {dtype}")
        self.dtype = dtype
        self.device = device
        self.use_onednn = use_onednn
        self.activation_bits = activation_bits

    def dense(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` in the run's dtype on its device, contiguous."""
        return w.to(device=self.device, dtype=self.dtype).contiguous()

    def make_linear(self, weight: Weight, bias: torch.Tensor | None = None) -> AnyLinear:
        """The layer that runs ``weight`` (and ``bias``): the kernels' for a quantized one."""
        if isinstance(weight, (QuantWeight, QuantStack)):
            return QLinear(weight, bias, self.activation_bits)
        return Linear(self.dense(weight), bias, self.use_onednn)

    def make_gate_up(self, gate: Matrix, up: Matrix, silu: bool = True) -> AnyLinear | GateUp:
        """``silu(gate) * up`` (``silu_mul``): one fused matrix, or oneDNN's two GEMMs (which
        fuse the SiLU; another activation takes the fused matrix)."""
        if self.use_onednn and silu and not isinstance(gate, QuantWeight):
            return GateUp(self.make_linear(gate), self.make_linear(up))
        return self.make_linear(_cat_rows([gate, up]))

    def make_embedding(self, weight: Weight) -> Embedding | QEmbedding:
        if isinstance(weight, (QuantWeight, QuantStack)):
            return QEmbedding(weight)
        return Embedding(self.dense(weight))

    def backend(self, weights_format: str) -> str:
        """What runs the matrices: ``kvserve-<isa>-a<bits>`` (the kernels), onednn or torch."""
        if weights_format != "float":
            from model_runner import kernels

            return f"kvserve-{kernels.isa()}-a{self.activation_bits}"
        return "onednn" if self.use_onednn else "torch"


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: AnyLinear
    o: AnyLinear
    post_norm: torch.Tensor
    # The dense MLP: silu(gate) * up, then down; None on a layer with ``moe``.
    gate_up: AnyLinear | GateUp | None
    down: AnyLinear | None
    # Per-head RMSNorm weights [D] on Q and K before RoPE (a family with ``qk_norm``), in
    # RoPE pair order, the softmax scale folded into Q's; None for the Llama block.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # The mixture-of-experts MLP of a layer in ``config.experts.layers``, else None.
    moe: MoeMlp | None = None
    # Norms of the attention's and the MLP's outputs before their residual adds (a family
    # with ``sandwich_norms``: Gemma's post_attention / post_feedforward_layernorm), else None.
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None

    def norms(self) -> list[torch.Tensor]:
        """Every norm weight the layer holds."""
        held = (self.q_norm, self.k_norm, self.attn_out_norm, self.mlp_out_norm)
        return [self.input_norm, self.post_norm, *(t for t in held if t is not None)]

    def mlps(self) -> list[AnyLinear | GateUp | MoeMlp]:
        """The MLP's parts: gate-up and down, or the ``MoeMlp``."""
        if self.moe is not None:
            return [self.moe]
        assert self.gate_up is not None and self.down is not None
        return [self.gate_up, self.down]


@dataclass(slots=True)
class ModelWeights:
    """Every weight the forward pass reads, made by ``load_weights``."""

    layers: list[LayerWeights]
    embed: Embedding | QEmbedding
    norm: torch.Tensor
    lm_head: AnyLinear
    vocab_size: int  # rows of the embedding
    formats: str  # "Q4_1+Q8_0"-style: the quantized formats held, or "float"

    def num_bytes(self) -> int:
        """Bytes of every weight tensor held (shared tensors counted once)."""
        seen: dict[int, int] = {}
        tensors = [self.norm, *self.embed.tensors(), *self.lm_head.tensors()]
        for layer in self.layers:
            tensors += layer.norms()
            for linear in (layer.qkv, layer.o, *layer.mlps()):
                tensors += linear.tensors()
        for t in tensors:
            if not t.is_mkldnn:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            else:  # oneDNN-packed: opaque storage, the logical size
                seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())


def load_weights(config: ModelConfig, state_dict: StateDict, linears: Linears) -> ModelWeights:
    """The model's layers from a Hugging Face-named ``state_dict`` (read, not kept)."""
    missing = [k for k in _required_names(config, state_dict) if k not in state_dict]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"state dict lacks {len(missing)} weights the config needs: {shown}")
    quantized = [n for n, w in state_dict.items() if isinstance(w, QuantWeight)]
    if quantized and (linears.device.type != "cpu" or linears.dtype != torch.float32):
        raise ValueError(
            f"{len(quantized)} quantized weights ({quantized[0]}, ...) run on the CPU "
            f"kernels with float32 compute, not {linears.device} / {linears.dtype}"
        )
    head = "lm_head.weight" if "lm_head.weight" in state_dict else "model.embed_tokens.weight"
    if head == "model.embed_tokens.weight" and not config.tie_word_embeddings:
        raise ValueError("state dict has no lm_head.weight and the config does not tie it")
    prepared = _Prepared(state_dict, linears.device)
    embed = prepared.matrix("model.embed_tokens.weight")
    # Tied + oneDNN: the head is a packed copy of the embedding (the lookup needs it dense).
    # Tied + quantized: the lookup and the head share one QuantWeight.
    return ModelWeights(
        layers=[_layer(config, prepared, linears, i) for i in range(config.num_layers)],
        embed=linears.make_embedding(embed),
        norm=_norm(config, linears, prepared.vector("model.norm.weight")),
        lm_head=linears.make_linear(prepared.matrix(head)),
        vocab_size=embed.shape[0],
        formats=_describe_formats(state_dict),
    )


class _Prepared:
    """Reads ``state_dict``: matrices as held (quantized ones stay so), vectors as fp32 on
    the run device (for the arithmetic of the preparation, before the run dtype)."""

    def __init__(self, state_dict: StateDict, device: torch.device) -> None:
        self.state_dict = state_dict
        self.device = device

    def vector(self, name: str) -> torch.Tensor:
        w = self.state_dict[name]
        if isinstance(w, QuantWeight):
            w = w.dequantize()
        return w.to(device=self.device, dtype=torch.float32)

    def matrix(self, name: str) -> Matrix:
        w = self.state_dict[name]
        return w if isinstance(w, QuantWeight) else self.vector(name)


def _layer(config: ModelConfig, w: _Prepared, linears: Linears, i: int) -> LayerWeights:
    """Layer ``i``: its attention (``_attention``), O, norms, gate-up and down (or experts).

    Llama's ``post_attention_layernorm`` is the MLP's input norm; under sandwich norms
    (Gemma) it norms the attention's output, ``pre_feedforward_layernorm`` is the MLP's input
    norm and ``post_feedforward_layernorm`` norms the MLP's output. A family whose
    checkpoint fuses gate-up (Phi-3) has it split here, so its parts are prepared as any
    other family's."""
    fam = family(config.architecture)
    p = f"model.layers.{i}."

    def norm(kind: str) -> torch.Tensor:
        return _norm(config, linears, w.vector(f"{p}{kind}_layernorm.weight"))

    qkv, q_norm, k_norm = _attention(config, w, linears, i)
    layer = LayerWeights(
        input_norm=norm("input"),
        qkv=qkv,
        o=linears.make_linear(w.matrix(p + "self_attn.o_proj.weight")),
        post_norm=norm("pre_feedforward" if fam.sandwich_norms else "post_attention"),
        gate_up=None,
        down=None,
        q_norm=q_norm,
        k_norm=k_norm,
    )
    if fam.sandwich_norms:
        layer.attn_out_norm, layer.mlp_out_norm = norm("post_attention"), norm("post_feedforward")
    experts = config.experts
    if experts is not None and i in experts.layers:
        matrices = expert_matrices(w.matrix, w.state_dict, p, experts)
        layer.moe = MoeMlp(
            w.vector(p + "mlp.gate.weight").contiguous(),  # fp32 (MoeMlp)
            [linears.make_gate_up(gate, up) for gate, up, _ in matrices],
            [linears.make_linear(down) for _, _, down in matrices],
            experts,
        )
        return layer
    inter = config.intermediate_size
    gate_up_name = "gate_up" if fam.fused_gate_up else None
    gate, up = _parts(w.matrix, p + "mlp.", ("gate", "up"), gate_up_name, (inter, inter))
    layer.gate_up = linears.make_gate_up(gate, up, silu=fam.mlp_activation == "silu")
    layer.down = linears.make_linear(w.matrix(p + "mlp.down_proj.weight"))
    return layer


def _attention(
    config: ModelConfig, w: _Prepared, linears: Linears, i: int
) -> tuple[AnyLinear, torch.Tensor | None, torch.Tensor | None]:
    """Layer ``i``'s fused QKV (Q scaled, Q and K in RoPE pair order) and its QK-norm weights.

    With QK-norm the scale goes into Q's norm weight instead (a norm after the projection
    would undo a scaled Q), and both norm weights take the rows' RoPE pair order (RMSNorm
    over a head commutes with permuting it). A checkpoint's fused QKV (Phi-3) is split
    first."""
    p = f"model.layers.{i}.self_attn."
    h, kvh, d = config.num_heads, config.num_kv_heads, config.head_dim
    scale = config.softmax_scale
    fam = family(config.architecture)
    order = rope_pair_order(d, config.rope_dim)
    qkv_rows = (h * d, kvh * d, kvh * d)
    qkv_name = "qkv" if fam.fused_qkv else None
    wq, wk, wv = _parts(w.matrix, p, ("q", "k", "v"), qkv_name, qkv_rows, ".weight")
    wq = _interleave_rows(wq, h, order)
    wq = wq if fam.qk_norm else _scaled(wq, scale)
    wk = _interleave_rows(wk, kvh, order)
    q_norm = k_norm = None
    if fam.qk_norm:
        q, k = (_interleave_rows(w.vector(f"{p}{n}_norm.weight"), 1, order) for n in "qk")
        q_norm, k_norm = _norm(config, linears, q, scale), _norm(config, linears, k)
    bias: torch.Tensor | None = None
    if config.attention_bias:
        bq, bk, bv = _parts(w.vector, p, ("q", "k", "v"), qkv_name, qkv_rows, ".bias")
        bias = linears.dense(
            torch.cat(
                [_interleave_rows(bq, h, order) * scale, _interleave_rows(bk, kvh, order), bv]
            )
        )
    return linears.make_linear(_cat_rows([wq, wk, wv]), bias), q_norm, k_norm


def _norm(
    config: ModelConfig, linears: Linears, weight: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """An RMSNorm's fp32 ``weight`` as the norm multiplies by it, times ``scale``: with the
    family's offset added (Gemma's ``1 + w``) and kept in fp32, as such a family computes
    its norms; else in the run's dtype."""
    offset = family(config.architecture).norm_offset
    if not offset:
        return linears.dense(weight * scale)
    return ((weight + offset) * scale).contiguous()


def _parts(
    read: Callable[[str], _Read],
    prefix: str,
    names: tuple[str, ...],
    fused: str | None,
    rows: tuple[int, ...],
    suffix: str = ".weight",
) -> list[_Read]:
    """The projections ``names`` (``{prefix}{name}_proj{suffix}``), each its own tensor or,
    in a checkpoint that fuses them, consecutive ``rows`` of ``{prefix}{fused}_proj{suffix}``."""
    if fused is None:
        return [read(f"{prefix}{n}_proj{suffix}") for n in names]
    whole = read(f"{prefix}{fused}_proj{suffix}")
    if whole.shape[0] != sum(rows):
        raise ValueError(
            f"{prefix}{'/'.join(names)} fused: {whole.shape[0]} rows, the config needs "
            f"{' + '.join(map(str, rows))}"
        )
    starts = [sum(rows[:k]) for k in range(len(rows))]
    if isinstance(whole, QuantWeight):
        return [whole.rows(torch.arange(s, s + n)) for s, n in zip(starts, rows, strict=True)]
    return [whole[s : s + n] for s, n in zip(starts, rows, strict=True)]


@overload
def _interleave_rows(w: torch.Tensor, num_heads: int, order: torch.Tensor) -> torch.Tensor: ...
@overload
def _interleave_rows(w: Matrix, num_heads: int, order: torch.Tensor) -> Matrix: ...
def _interleave_rows(w: Matrix, num_heads: int, order: torch.Tensor) -> Matrix:
    """Permute each head's rows from half-split (HF) to RoPE pair order (``order``:
    ``rope.rope_pair_order``)."""
    head_dim = order.numel()
    if isinstance(w, QuantWeight):
        heads = torch.arange(num_heads).unsqueeze(1) * head_dim
        return w.rows((heads + order.to(heads.device)).flatten())
    shape = w.shape
    return w.reshape(num_heads, head_dim, -1)[:, order].reshape(shape)


def _scaled(w: Matrix, factor: float) -> Matrix:
    return w.scaled(factor) if isinstance(w, QuantWeight) else w * factor


def _dense(w: Weight) -> torch.Tensor:
    return w.dequantize() if isinstance(w, (QuantWeight, QuantStack)) else w


def _cat_rows(weights: list[Matrix]) -> Weight:
    """Stack row blocks; quantized ones stay quantized, each in its own format (else fp32)."""
    if all(isinstance(w, QuantWeight) for w in weights):
        quant = [w for w in weights if isinstance(w, QuantWeight)]
        if len({w.in_features for w in quant}) == 1:
            return cat_rows(quant)
    return torch.cat([_dense(w) for w in weights])


def _describe_formats(state_dict: StateDict) -> str:
    """``"Q4_1+Q8_0"``-style list of the quantized formats held, or ``"float"``."""
    sources = sorted({w.source for w in state_dict.values() if isinstance(w, QuantWeight)})
    return "+".join(sources) if sources else "float"


def _required_names(config: ModelConfig, state_dict: StateDict) -> list[str]:
    """The Hugging Face parameter names ``config``'s model reads (a MoE layer's experts one
    matrix each, or transformers 5's two fused stacks when ``state_dict`` holds those)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    fam, experts = family(config.architecture), config.experts
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        moe = experts if experts is not None and i in experts.layers else None
        layer = fam.layer_weights(config.attention_bias, moe)
        if moe is not None and has_fused_experts(state_dict, p):
            fused = (f"mlp.experts.{n}_proj" for n in ("gate_up", "down"))
            layer = (*(n for n in layer if ".experts." not in n), *fused)
        names += [p + n for n in layer]
    return names
