"""LoRA adapter files -> ``AdapterFile``: every low-rank pair in Hugging Face's layout.

Two formats, as the anchors write them:

    PEFT        a directory: adapter_config.json (r, lora_alpha, use_rslora, target_modules,
                rank_pattern, alpha_pattern) + adapter_model.safetensors, keys such as
                base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight ([r, in]) and
                ...lora_B.weight ([out, r]); scaling alpha / r (rsLoRA: alpha / sqrt(r))
    GGUF        one file from llama.cpp's convert_lora_to_gguf.py: general.type = adapter,
                adapter.type = lora, adapter.lora.alpha, tensors blk.N.attn_q.weight.lora_a /
                .lora_b; llama.cpp's scaling alpha / r (alpha 0: 1). The converter permutes
                lora_b's rows of Q and K as it permutes the base's (``qk_layout = "gguf"``):
                ``lora.layout`` undoes that with the base's head counts.

Only what kvserve can apply is accepted: LoRA pairs on the attention and MLP projections
(q, k, v, o, gate, up, down). DoRA, LoRA biases, adapters of the embeddings or the LM head,
extra trained modules (``modules_to_save``) and activated LoRA are refused, each with an
``AdapterError`` that names the file and says why. Nothing here knows the base model: shapes
are checked against it in ``lora.layout``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from model_runner.lora.info import AdapterError
from model_runner.lora.targets import GGUF_MODULES, MODULES

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PEFT_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
# A mixture-of-experts layer's experts or router (PEFT's names; a GGUF's ffn_*_exps, ffn_gate_inp).
_EXPERT_KEY = re.compile(
    r"\.(?:mlp\.(?:experts|gate|shared_expert\w*)|block_sparse_moe)\.|^blk\.\d+\.ffn_(?:\w+_exps|gate_inp)\."
)
_EXPERTS_REFUSED = (
    "LoRA on a mixture-of-experts layer's experts or router is not supported; adapters on "
    "the attention (q_proj, k_proj, v_proj, o_proj) and on dense MLP layers run"
)
_DIGEST_CHUNK = 1 << 22


@dataclass(frozen=True, slots=True)
class LoraPair:
    """One projection's update ``scaling * B @ A`` (fp32, Hugging Face layout)."""

    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features, r]
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(slots=True)
class AdapterFile:
    """An adapter as read from disk: its pairs by (layer, module), in Hugging Face's row
    order except that ``qk_layout == "gguf"`` pairs of Q and K have llama.cpp's rows."""

    path: str
    kind: Literal["peft", "gguf"]
    pairs: dict[tuple[int, str], LoraPair]
    alpha: float
    digest: str  # BLAKE2b of the files' bytes: what the prefix cache keys KV made with it
    qk_layout: Literal["hf", "gguf"] = "hf"
    base_model: str = ""  # what the file says it was trained on, if it says
    architecture: str | None = None  # GGUF: the base's architecture
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max(p.rank for p in self.pairs.values())

    @property
    def target_modules(self) -> tuple[str, ...]:
        present = {module for _, module in self.pairs}
        return tuple(m for m in MODULES if m in present)

    @property
    def num_parameters(self) -> int:
        return sum(p.a.numel() + p.b.numel() for p in self.pairs.values())


def read_adapter(path: str | Path) -> AdapterFile:
    """The adapter at ``path``: a PEFT directory or a GGUF LoRA file (``AdapterError``
    otherwise)."""
    p = Path(path)
    if not p.exists():
        raise AdapterError(f"adapter {str(p)!r} does not exist")
    if p.is_dir():
        return _read_peft(p)
    with p.open("rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _read_gguf(p)
    raise AdapterError(
        f"adapter {str(p)!r} is neither a PEFT directory ({PEFT_CONFIG} + {PEFT_WEIGHTS}) nor "
        "a GGUF LoRA file"
    )


def _digest(*files: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        with f.open("rb") as stream:
            while chunk := stream.read(_DIGEST_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def _fail(path: Path | str, reason: str) -> AdapterError:
    return AdapterError(f"adapter {str(path)!r}: {reason}")


# ---------------------------------------------------------------------- PEFT


def _read_peft(folder: Path) -> AdapterFile:
    config_path = folder / PEFT_CONFIG
    weights_path = folder / PEFT_WEIGHTS
    if not config_path.is_file():
        raise _fail(folder, f"no {PEFT_CONFIG}: a PEFT adapter directory has one")
    if not weights_path.is_file():
        pickled = (folder / "adapter_model.bin").is_file()
        hint = (
            " (adapter_model.bin is a pickle, which kvserve does not load: save the adapter with "
            "safe_serialization=True)"
            if pickled
            else ""
        )
        raise _fail(folder, f"no {PEFT_WEIGHTS}{hint}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise _fail(folder, f"{PEFT_CONFIG} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise _fail(folder, f"{PEFT_CONFIG} must hold a JSON object")
    _check_peft_config(folder, config)
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(weights_path), device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError for bad files
        raise _fail(
            folder, f"{PEFT_WEIGHTS} cannot be read ({type(exc).__name__}: {exc}): corrupt or "
            "truncated"
        ) from exc  # fmt: skip
    alpha = _number(folder, config, "lora_alpha", default=config.get("r", 8))
    rslora = bool(config.get("use_rslora", False))
    alpha_pattern = config.get("alpha_pattern") or {}
    if not isinstance(alpha_pattern, dict):
        raise _fail(folder, "alpha_pattern must be an object of module pattern -> alpha")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _PEFT_KEY.match(key)
        if _EXPERT_KEY.search(key):
            raise _fail(folder, f"tensor {key!r}: {_EXPERTS_REFUSED}")
        if m is None or m.group(2) not in MODULES:
            raise _fail(folder, f"tensor {key!r} is not a LoRA pair of {', '.join(MODULES)}")
        halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    pairs = {}
    for (layer, module), ab in sorted(halves.items(), key=_layer_order):
        name = f"model.layers.{layer}.{module}"
        pair_alpha = float(_pattern_value(alpha_pattern, name, alpha))
        pairs[(layer, module)] = _pair(folder, name, ab.get("A"), ab.get("B"), pair_alpha, rslora)
    if not pairs:
        raise _fail(folder, f"{PEFT_WEIGHTS} holds no LoRA pairs")
    return AdapterFile(
        path=str(folder),
        kind="peft",
        pairs=pairs,
        alpha=float(alpha),
        digest=_digest(config_path, weights_path),
        base_model=str(config.get("base_model_name_or_path") or ""),
        notes={"use_rslora": rslora},
    )


def _check_peft_config(folder: Path, config: dict[str, Any]) -> None:
    """Refuse what kvserve does not apply, naming the setting."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _fail(folder, f"peft_type {peft_type!r}: only LORA adapters are served")
    if config.get("use_dora"):
        raise _fail(folder, "use_dora: DoRA adapters are not supported (plain LoRA only)")
    if config.get("bias", "none") not in (None, "none"):
        raise _fail(folder, f"bias {config['bias']!r}: LoRA biases are not supported")
    if config.get("modules_to_save"):
        raise _fail(
            folder, f"modules_to_save {config['modules_to_save']}: adapters that train whole "
            "modules are not supported"
        )  # fmt: skip
    if config.get("fan_in_fan_out"):
        raise _fail(folder, "fan_in_fan_out: LLaMA-family projections are not Conv1D")
    if config.get("alora_invocation_tokens") or config.get("invocation_string"):
        raise _fail(folder, "activated LoRA (an invocation string) is not supported")
    rank = config.get("r", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(folder, f"r must be a positive integer, got {rank!r}")


def _number(folder: Path, config: dict[str, Any], key: str, default: Any) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(folder, f"{key} must be a number, got {value!r}")
    return float(value)


def _layer_order(item: tuple[tuple[int, str], Any]) -> tuple[int, int]:
    (layer, module), _ = item
    return layer, MODULES.index(module)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank/alpha pattern rule: the first key matching the end of the module's name."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _pair(
    path: Path,
    name: str,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    alpha: float,
    rslora: bool = False,
    llama_cpp_scaling: bool = False,
) -> LoraPair:
    if a is None or b is None:
        missing = "lora_A" if a is None else "lora_B"
        raise _fail(path, f"{name} has no {missing}: a LoRA pair needs both matrices")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
        raise _fail(
            path, f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a pair "
            "of [r, in] and [out, r] matrices"
        )  # fmt: skip
    a32, b32 = a.to(torch.float32).contiguous(), b.to(torch.float32).contiguous()
    if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
        raise _fail(path, f"{name} holds non-finite values: the file is corrupt")
    rank = a32.shape[0]
    if llama_cpp_scaling:
        scaling = alpha / rank if alpha else 1.0
    else:
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    return LoraPair(a32, b32, scaling)


# ---------------------------------------------------------------------- GGUF


def _gguf_modules(architecture: object) -> dict[str, str]:
    """llama.cpp's per-layer tensor names -> the modules they update, for a base of GGUF
    ``architecture``: its family's own projections first (Phi-3's ``attn_qkv``, and its
    ``ffn_up`` holding gate and up)."""
    from model_runner.families import for_gguf

    modules = dict(GGUF_MODULES)
    try:
        fam = for_gguf(str(architecture or ""), {}, ())
    except ValueError:  # not a family kvserve runs: check_fits names the mismatch
        return modules
    for suffix, hf in fam.gguf_layer_tensors.items():
        if hf.endswith("_proj.weight"):
            modules[suffix.removesuffix(".weight")] = hf.split(".")[-2]
    return modules


def _read_gguf(path: Path) -> AdapterFile:
    from model_runner.errors import CheckpointError
    from model_runner.gguf_loader import _dequantize, _open, read_metadata

    try:
        reader = _open(path)
        metadata = read_metadata(reader, str(path))
    except CheckpointError as exc:
        raise _fail(path, str(exc)) from exc
    kind = metadata.get("general.type", "model")
    if kind != "adapter":
        raise _fail(path, f"general.type is {kind!r}: this GGUF is a model, not an adapter")
    adapter_type = metadata.get("adapter.type")
    if adapter_type != "lora":
        raise _fail(path, f"adapter.type is {adapter_type!r}: only LoRA adapters are served")
    if metadata.get("adapter.alora.invocation_tokens"):
        raise _fail(path, "activated LoRA (invocation tokens) is not supported")
    alpha = metadata.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _fail(path, f"adapter.lora.alpha must be a number, got {alpha!r}")
    modules = _gguf_modules(metadata.get("general.architecture"))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        m = _GGUF_KEY.match(tensor.name)
        if _EXPERT_KEY.search(tensor.name):
            raise _fail(path, f"tensor {tensor.name!r}: {_EXPERTS_REFUSED}")
        if m is None or m.group(2) not in modules:
            raise _fail(
                path, f"tensor {tensor.name!r} is not a LoRA pair of "
                f"{', '.join(modules)} (blk.N.<name>.weight.lora_a / .lora_b)"
            )  # fmt: skip
        try:
            array = _dequantize(tensor)
        except Exception as exc:  # an unknown type, a short file
            raise _fail(path, f"tensor {tensor.name!r} cannot be read ({exc})") from exc
        module = modules[m.group(2)]
        halves.setdefault((int(m.group(1)), module), {})[m.group(3).upper()] = torch.from_numpy(
            array
        )
    pairs = {
        key: _pair(
            path,
            f"blk.{key[0]}.{key[1]}",
            ab.get("A"),
            ab.get("B"),
            float(alpha),
            llama_cpp_scaling=True,
        )
        for key, ab in sorted(halves.items(), key=_layer_order)
    }
    if not pairs:
        raise _fail(path, "the file holds no LoRA tensors")
    return AdapterFile(
        path=str(path),
        kind="gguf",
        pairs=pairs,
        alpha=float(alpha),
        digest=_digest(path),
        qk_layout="gguf",
        base_model=str(metadata.get("general.base_model.0.name") or ""),
        architecture=str(metadata.get("general.architecture") or "") or None,
    )
