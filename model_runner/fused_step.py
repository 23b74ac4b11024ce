"""A step's whole layer stack in one call of kvserve's CPU kernels: prefill chunks, decodes
and draft rows alike.

At batch 1 a decode step of a 4-bit model reads ~100 MB of weights, a few milliseconds; the
same step through PyTorch also dispatches ~30 tensor ops per layer (norms, RoPE, the KV write,
the attention gather and matmuls), milliseconds more. ``kv_step_layers`` runs norm, QKV,
RoPE, the paged KV write, attention over the block table, the output projection, the gated
MLP and both residual adds of every layer in C++ (see ``kernels/kernels.cpp``), so Python
runs the embedding lookup, one call, and the LM head.

A step is one flattened token batch: a prefill chunk is consecutive rows that share a block
table, a decode one row, a speculative verification k + 1 rows (``TorchRunner`` flattens
them). Every row's K/V is written before any row attends, and each row attends up to its
own position, so chunks are causal. A mixture-of-experts layer (Qwen3-MoE, Mixtral) runs
there too: its router, each row's choice and the experts grouped by the step's rows, as
``moe.MoeMlp`` does (``kernels.cpp``'s ``moe_mlp``); so does Gemma 3's block: the sandwich
norms after attention and the MLP, GeGLU (the gate-up epilogue's tanh GELU), each layer's
window and the sliding layers' own RoPE table (``StepLayer.window`` / ``rope``).

Used for every step of up to ``RunnerOptions.fused_max_rows`` rows when every matrix is
quantized (``QLinear``, each expert's too), compute is fp32 on CPU, and the pool is fp32,
fp16 or int8; ``FusedStep.unsupported`` names the reason otherwise (the runner then takes
the PyTorch path; both paths write the same pool).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from model_runner import kernels
from model_runner.families import family
from model_runner.kv_pool import KVPool
from model_runner.lora.native import NativeLora
from model_runner.model import LlamaModel
from model_runner.quant import QLinear, describe
from model_runner.step import StepRows

_KV_DTYPES = {
    torch.float32: kernels.KV_F32,
    torch.float16: kernels.KV_F16,
    torch.int8: kernels.KV_I8,
}


class FusedStep:
    """Binds a ``LlamaModel`` and its ``KVPool`` to ``kv_step_layers`` (pointers taken once:
    both own their tensors for the runner's lifetime)."""

    def __init__(self, model: LlamaModel, pool: KVPool, windows: Sequence[int | None]) -> None:
        """``windows``: each layer's (``AttentionSpec.window``; None = every position)."""
        reason = self.unsupported(model, pool)
        if reason is not None:
            raise ValueError(f"fused step unavailable: {reason}")
        self.lib = kernels.load()
        self.model = model
        self.pool = pool
        assert model.rope_cis is not None
        # [max_len, D/2] complex64 -> [max_len, D/2, 2] (cos, sin), viewed without a copy.
        self.rope = torch.view_as_real(model.rope_cis.squeeze(1)).contiguous()
        local = model.local_rope  # Gemma 3's sliding layers' own table
        self.local = None
        if local is not None:
            assert local.cis is not None
            self.local = torch.view_as_real(local.cis.squeeze(1)).contiguous()
        self._experts: list[ctypes.Array[kernels.QW]] = []  # the layers' expert tables, kept
        self.layers = self._bind_layers(windows)
        self.step = self._step_args()

    def _bind_layers(self, windows: Sequence[int | None]) -> ctypes.Array[kernels.StepLayer]:
        """Each layer's ``StepLayer``: its norms, matrices, KV pages, window, RoPE table and,
        for a mixture-of-experts layer, the router and the experts' tables."""
        model, pool = self.model, self.pool
        scales = pool.layer_scales or None
        layers = (kernels.StepLayer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            assert isinstance(layer.qkv, QLinear) and isinstance(layer.o, QLinear)
            bias, q_norm, k_norm = layer.qkv.bias, layer.q_norm, layer.k_norm
            layers[i] = kernels.StepLayer(
                layer.input_norm.data_ptr(),
                layer.post_norm.data_ptr(),
                bias.data_ptr() if bias is not None else None,
                q_norm.data_ptr() if q_norm is not None else None,
                k_norm.data_ptr() if k_norm is not None else None,
                describe(layer.qkv.weight),
                describe(layer.o.weight),
                kernels.QW(),
                kernels.QW(),
                pool.layer_data[i].data_ptr(),
                scales[i].data_ptr() if scales is not None else None,
            )
            for name in ("attn_out_norm", "mlp_out_norm"):  # Gemma's sandwich norms
                norm = getattr(layer, name)
                setattr(layers[i], name, norm.data_ptr() if norm is not None else None)
            if self.local is not None and model.layer_local_rope[i]:
                layers[i].rope = self.local.data_ptr()
            layers[i].window = windows[i] or 0
            layers[i].own_table = int(i in pool.window_layers)
            if layer.moe is None:
                assert isinstance(layer.gate_up, QLinear) and isinstance(layer.down, QLinear)
                layers[i].gate_up = describe(layer.gate_up.weight)
                layers[i].down = describe(layer.down.weight)
                continue
            gate_up, down = (
                (kernels.QW * len(mats))(*(describe(m.weight) for m in mats))
                for mats in (layer.moe.gate_up, layer.moe.down)
            )
            self._experts += [gate_up, down]
            layers[i].router = layer.moe.router.data_ptr()
            layers[i].expert_gate_up = ctypes.cast(gate_up, ctypes.POINTER(kernels.QW))
            layers[i].expert_down = ctypes.cast(down, ctypes.POINTER(kernels.QW))
        return layers

    def _step_args(self) -> kernels.StepArgs:
        """The step's constants: the model's shape, the pool's layout and the RoPE table."""
        model, pool = self.model, self.pool
        config = model.config
        experts = config.experts
        step = kernels.StepArgs()
        for name, value in (
            ("hidden_size", config.hidden_size),
            ("num_heads", config.num_heads),
            ("num_kv_heads", config.num_kv_heads),
            ("head_dim", config.head_dim),
            ("intermediate", config.intermediate_size),
            ("kv_dtype", _KV_DTYPES[pool.dtype]),
            ("num_blocks", pool.num_blocks),
            ("block_size", pool.block_size),
            ("num_experts", experts.num_experts if experts else 0),
            ("num_used", experts.num_used if experts else 0),
            ("expert_intermediate", experts.intermediate_size if experts else 0),
            ("norm_topk", int(experts.norm_topk_prob) if experts else 0),
            ("gelu", int(family(config.architecture).mlp_activation == "gelu_tanh")),
        ):
            setattr(step, name, value)
        step.window_num_blocks = pool.num_window_blocks
        step.eps = model.eps
        step.residual = int(model.activation_bits == 16)
        step.rope = self.rope.data_ptr()
        return step

    def _window_table(self, rows: StepRows) -> torch.Tensor:
        """The rows' tables in the sliding layers' pool, in its own ids ([rows, width])."""
        off = self.pool.num_blocks
        tables = rows.window_block_tables()
        width = max(len(t) for t in tables)
        padded = [[b - off for b in t] + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.int32)

    @staticmethod
    def unsupported(model: LlamaModel, pool: KVPool) -> str | None:
        """Why this model + pool cannot take the fused path, or None.

        The device, dtype and weights are looked at first: the kernels are loaded (built,
        the first time: minutes of g++) only for a CPU model whose matrices are all
        quantized, so a CUDA or float runner never touches them."""
        if model.device.type != "cpu" or model.dtype != torch.float32 or model.rope_cis is None:
            return "needs fp32 compute on CPU"
        if model.local_rope is not None and model.local_rope.cis is None:
            return "needs the sliding layers' RoPE table in fp32"
        linears = [
            (l.qkv, l.o, *((l.gate_up, l.down) if l.moe is None else (*l.moe.gate_up, *l.moe.down)))
            for l in model.layers  # noqa: E741
        ]
        if not all(isinstance(lin, QLinear) for group in linears for lin in group):
            return "needs every layer matrix quantized (each expert's too)"
        routers = [l.moe.router for l in model.layers if l.moe is not None]  # noqa: E741
        if not all(r.dtype == torch.float32 and r.is_contiguous() for r in routers):
            return "needs each router fp32 and contiguous"
        if not kernels.available():
            return f"kernels unavailable ({kernels.unavailable_reason()})"
        if model.config.head_dim > 512:
            return f"head_dim {model.config.head_dim} (the kernels take up to 512)"
        if model.config.num_heads // model.config.num_kv_heads > 64:
            return "more than 64 query heads per KV head"
        if pool.dtype not in _KV_DTYPES:
            return f"KV pool dtype {pool.dtype} (fp32, fp16 or int8 only)"
        return None

    def forward(self, rows: StepRows) -> torch.Tensor:
        """Hidden states [rows, hidden] after the last layer for the tokens of ``rows`` at
        their positions, each row with its request's block table; writes every layer's K/V
        of those tokens into the pool, with the rows' adapters (``rows.lora``:
        ``kernels/lora.h``)."""
        batch = rows.num_rows
        ids = torch.tensor(rows.token_ids, dtype=torch.int64)
        hidden = self.model.embed_rows(ids).contiguous()
        pos = torch.tensor(rows.positions, dtype=torch.int64)
        block_tables = rows.block_tables()
        width = max(len(t) for t in block_tables)
        padded = [[*blocks, *[0] * (width - len(blocks))] for blocks in block_tables]
        table = torch.tensor(padded, dtype=torch.int32)
        step = self.step
        step.hidden = hidden.data_ptr()
        step.positions = pos.data_ptr()
        step.block_tables = table.data_ptr()
        step.batch = batch
        step.max_blocks = width
        if rows.window_slot_mapping is not None:  # the sliding layers' own tables
            window = self._window_table(rows)
            step.window_tables = window.data_ptr()
            step.window_max_blocks = window.shape[1]
        step.nthreads = torch.get_num_threads()
        native = NativeLora(rows.lora) if rows.lora is not None else None
        step.lora = native.pointer if native is not None else None
        try:
            self.lib.kv_step_layers(self.layers, len(self.model.layers), ctypes.byref(step))
        finally:
            step.lora = None
        return hidden
