"""Declarative workloads: a small JSON file -> a seeded, fully determined list of requests.

Schema (every key optional except where said; lengths are tokens)::

    {
      "name": "shared-prefix",            # label in reports (default: the file's stem)
      "description": "...",
      "seed": 0,                          # one seed determines every draw below
      "num_requests": 100,                # default count bound (the CLI may override it)
      "prompt": {
        "source": "random",               # "random" (token ids) or "file" (texts)
        "len": <dist>,                    # random: prompt tokens after any shared prefix (128)
        "token_id_range": [100, 10000],   # random: ids drawn uniformly from [lo, hi)
                                          #   (default: [V // 8, 7 * V // 8) of the
                                          #   server's vocabulary V: no special tokens)
        "path": "prompts.json",           # file: {"prompts": [str, ...]} or [str, ...];
                                          #   relative to the workload file, or absolute
        "order": "cycle"                  # file: "cycle" (request i uses prompts[i % n])
                                          #   or "shuffle" (seeded uniform choice)
      },
      "shared_prefix": {                  # K system prompts shared by many requests
        "num_prefixes": 4,                # K
        "len": <dist>,                    # random source: each prefix's length, drawn once
        "texts": ["You are ...", ...],    # file source: the prefixes themselves (K = len)
        "fraction": 1.0,                  # share of requests that get a prefix (exact count)
        "order": "cycle"                  # "cycle" (k-th such request: prefix k % K) or
                                          #   "random" (seeded uniform: tenants in any order)
      },
      "output": {"len": <dist>, "ignore_eos": true},   # max_tokens per request (128, true)
      "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 50, "seed": 1},
      "priorities": [{"value": 0, "weight": 3}, {"value": 1, "weight": 1}],
      "cancel": {"fraction": 0.1, "after_tokens": <dist>}   # cancelled mid-stream (default 1)
    }

``<dist>`` is an int (fixed) or one of ``{"type": "fixed", "value": 64}``,
``{"type": "uniform", "min": 16, "max": 256}`` (inclusive) or
``{"type": "lognormal", "median": 128, "sigma": 0.8, "min": 1, "max": 2048}`` (the log of the
length is normal with mean ``ln(median)`` and std ``sigma``; rounded, then clipped).

Counts are exact, not sampled: of N requests, ``round(fraction * N)`` are cancelled and get a
shared prefix, and priorities are apportioned by weight with the largest-remainder method;
which requests get them is a seeded shuffle. A cancelled request is cancelled by the client
after ``after_tokens`` output tokens, clipped to ``[1, max_tokens - 1]`` (its ``max_tokens`` is
raised to 2 when it was 1, so that there is a middle of the stream to cancel in).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PROMPT_LEN = 128
DEFAULT_OUTPUT_LEN = 128


@dataclass(frozen=True, slots=True)
class LengthDist:
    """An integer length distribution: fixed, uniform (inclusive) or clipped lognormal."""

    kind: str = "fixed"
    value: int = 0  # fixed
    low: int = 1  # uniform min / lognormal clip min
    high: int | None = None  # uniform max / lognormal clip max (None: no upper clip)
    median: float = 1.0  # lognormal
    sigma: float = 0.0  # lognormal

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(
                f"length distribution type must be fixed|uniform|lognormal, got {self.kind!r}"
            )
        if self.kind == "fixed" and self.value < 1:
            raise ValueError(f"fixed length must be >= 1, got {self.value}")
        if self.kind == "uniform" and not (1 <= self.low <= (self.high or 0)):
            raise ValueError(
                f"uniform lengths need 1 <= min <= max, got min={self.low} max={self.high}"
            )
        if self.kind == "lognormal":
            if not (self.median > 0 and self.sigma >= 0):
                raise ValueError(
                    f"lognormal needs median > 0 and sigma >= 0, got {self.median}, {self.sigma}"
                )
            if self.low < 1 or (self.high is not None and self.high < self.low):
                raise ValueError(
                    f"lognormal clip needs 1 <= min <= max, got {self.low}, {self.high}"
                )

    @classmethod
    def parse(cls, spec: Any, default: int) -> LengthDist:
        if spec is None:
            return cls(value=default)
        if isinstance(spec, bool) or not isinstance(spec, int | dict):
            raise ValueError(f"a length is an int or a {{'type': ...}} object, got {spec!r}")
        if isinstance(spec, int):
            return cls(value=spec)
        kind = spec.get("type", "fixed")
        _check_keys(spec, {"type", "value", "min", "max", "median", "sigma"}, "length distribution")
        if kind == "fixed":
            return cls(value=int(spec["value"]))
        if kind == "uniform":
            return cls(kind="uniform", low=int(spec["min"]), high=int(spec["max"]))
        if kind == "lognormal":
            high = spec.get("max")
            return cls(
                kind="lognormal",
                median=float(spec["median"]),
                sigma=float(spec["sigma"]),
                low=int(spec.get("min", 1)),
                high=None if high is None else int(high),
            )
        return cls(kind=str(kind))  # raises in __post_init__

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            assert self.high is not None
            return rng.randint(self.low, self.high)
        n = round(math.exp(rng.gauss(math.log(self.median), self.sigma)))
        n = max(self.low, n)
        return n if self.high is None else min(self.high, n)

    def to_json(self) -> Any:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return {"type": "uniform", "min": self.low, "max": self.high}
        return {
            "type": "lognormal",
            "median": self.median,
            "sigma": self.sigma,
            "min": self.low,
            "max": self.high,
        }


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload, fully determined before the run starts.

    Exactly one of ``prompt_text`` / ``prompt_token_ids`` is set (text is prefix + prompt).
    """

    index: int
    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    max_tokens: int
    ignore_eos: bool
    priority: int = 0
    cancel_after_tokens: int | None = None
    prefix_id: int | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    # Structured outputs: one of {"json_schema": {...}}, {"regex": "..."}, {"choice": [...]}.
    constraint: Mapping[str, Any] | None = None
    adapter: str | None = None  # the LoRA adapter it names (None: the base model)

    @property
    def num_prompt_tokens(self) -> int | None:
        """Known for token prompts; None for text (the server tokenizes it)."""
        return None if self.prompt_token_ids is None else len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class Workload:
    """A parsed workload file. ``build(n)`` draws the first n requests (deterministic)."""

    name: str
    seed: int = 0
    num_requests: int = 100
    description: str = ""
    prompt_source: str = "random"
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist(value=DEFAULT_PROMPT_LEN))
    token_id_range: tuple[int, int] | None = None  # None: from the vocabulary size
    prompt_texts: tuple[str, ...] = ()
    prompt_order: str = "cycle"
    num_prefixes: int = 0
    prefix_len: LengthDist = field(default_factory=lambda: LengthDist(value=DEFAULT_PROMPT_LEN))
    prefix_texts: tuple[str, ...] = ()
    prefix_fraction: float = 1.0
    prefix_order: str = "cycle"
    output_len: LengthDist = field(default_factory=lambda: LengthDist(value=DEFAULT_OUTPUT_LEN))
    ignore_eos: bool = True
    sampling: Mapping[str, Any] = field(default_factory=lambda: {"temperature": 0.0})
    priorities: tuple[tuple[int, float], ...] = ((0, 1.0),)  # (value, weight)
    cancel_fraction: float = 0.0
    cancel_after: LengthDist = field(default_factory=lambda: LengthDist(value=1))
    constraint: Mapping[str, Any] | None = None  # every request's (see RequestSpec)
    # LoRA adapters the requests name in turn (request i: adapters[i % len]); () the base.
    adapters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.prompt_source not in ("random", "file"):
            raise ValueError(f"prompt.source must be random|file, got {self.prompt_source!r}")
        if self.prompt_source == "file" and not self.prompt_texts:
            raise ValueError("prompt.source 'file' needs a prompt file with at least one prompt")
        if self.prompt_order not in ("cycle", "shuffle"):
            raise ValueError(f"prompt.order must be cycle|shuffle, got {self.prompt_order!r}")
        if self.token_id_range is not None:
            lo, hi = self.token_id_range
            if not 0 <= lo < hi:
                raise ValueError(
                    f"prompt.token_id_range must be [lo, hi) with 0 <= lo < hi, got {lo}, {hi}"
                )
        if self.prefix_order not in ("cycle", "random"):
            raise ValueError(f"shared_prefix.order must be cycle|random, got {self.prefix_order!r}")
        if self.num_prefixes < 0:
            raise ValueError(f"shared_prefix.num_prefixes must be >= 0, got {self.num_prefixes}")
        if self.prompt_source == "file" and self.num_prefixes and not self.prefix_texts:
            raise ValueError("with prompt.source 'file', shared_prefix needs 'texts'")
        if self.prompt_source == "random" and self.prefix_texts:
            raise ValueError("with prompt.source 'random', shared prefixes are drawn: use 'len'")
        for name in ("prefix_fraction", "cancel_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if not self.priorities or any(w < 0 for _, w in self.priorities):
            raise ValueError(f"priorities need >= 1 entry with weights >= 0, got {self.priorities}")
        if sum(w for _, w in self.priorities) <= 0:
            raise ValueError("priority weights must not all be 0")
        if self.constraint is not None and (
            len(self.constraint) != 1 or set(self.constraint) - CONSTRAINT_KEYS
        ):
            raise ValueError(
                f"constraint must have exactly one of {sorted(CONSTRAINT_KEYS)}, "
                f"got {sorted(self.constraint)}"
            )
        unknown = set(self.sampling) - SAMPLING_KEYS
        if unknown:
            raise ValueError(
                f"unknown sampling keys {sorted(unknown)}; known: {sorted(SAMPLING_KEYS)}"
            )

    # ---------------------------------------------------------------- parsing

    @classmethod
    def from_dict(
        cls, spec: Mapping[str, Any], base_dir: Path | None = None, name: str = ""
    ) -> Workload:
        _check_keys(
            spec,
            {
                "name",
                "description",
                "seed",
                "num_requests",
                "prompt",
                "shared_prefix",
                "output",
                "sampling",
                "priorities",
                "cancel",
                "constraint",
                "adapters",
                # Multi-turn structure, read by loadtest.multiturn (each request a turn);
                # this loader sends the requests as independent prompts.
                "conversations",
            },
            "workload",
        )
        prompt = dict(spec.get("prompt", {}))
        _check_keys(prompt, {"source", "len", "token_id_range", "path", "order"}, "prompt")
        source = prompt.get("source", "random")
        texts: tuple[str, ...] = ()
        if source == "file":
            if "path" not in prompt:
                raise ValueError("prompt.source 'file' needs prompt.path")
            texts = load_prompt_file(_resolve(prompt["path"], base_dir))
        prefix = dict(spec.get("shared_prefix", {}))
        _check_keys(prefix, {"num_prefixes", "len", "texts", "fraction", "order"}, "shared_prefix")
        prefix_texts = tuple(str(t) for t in prefix.get("texts", ()))
        num_prefixes = int(prefix.get("num_prefixes", len(prefix_texts)))
        if prefix_texts and num_prefixes != len(prefix_texts):
            raise ValueError(
                f"shared_prefix.num_prefixes={num_prefixes} but {len(prefix_texts)} texts given"
            )
        output = dict(spec.get("output", {}))
        _check_keys(output, {"len", "ignore_eos"}, "output")
        cancel = dict(spec.get("cancel", {}))
        _check_keys(cancel, {"fraction", "after_tokens"}, "cancel")
        prio_specs = spec.get("priorities", [{"value": 0, "weight": 1}])
        priorities = []
        for p in prio_specs:
            _check_keys(p, {"value", "weight"}, "priorities[]")
            priorities.append((int(p["value"]), float(p.get("weight", 1.0))))
        id_range = prompt.get("token_id_range")
        return cls(
            name=str(spec.get("name", name or "workload")),
            description=str(spec.get("description", "")),
            seed=int(spec.get("seed", 0)),
            num_requests=int(spec.get("num_requests", 100)),
            prompt_source=str(source),
            prompt_len=LengthDist.parse(prompt.get("len"), DEFAULT_PROMPT_LEN),
            token_id_range=None if id_range is None else (int(id_range[0]), int(id_range[1])),
            prompt_texts=texts,
            prompt_order=str(prompt.get("order", "cycle")),
            num_prefixes=num_prefixes,
            prefix_len=LengthDist.parse(prefix.get("len"), DEFAULT_PROMPT_LEN),
            prefix_texts=prefix_texts,
            prefix_fraction=float(prefix.get("fraction", 1.0)),
            prefix_order=str(prefix.get("order", "cycle")),
            output_len=LengthDist.parse(output.get("len"), DEFAULT_OUTPUT_LEN),
            ignore_eos=bool(output.get("ignore_eos", True)),
            sampling=dict(spec.get("sampling", {"temperature": 0.0})),
            priorities=tuple(priorities),
            cancel_fraction=float(cancel.get("fraction", 0.0)),
            cancel_after=LengthDist.parse(cancel.get("after_tokens"), 1),
            constraint=spec.get("constraint"),
            adapters=tuple(str(a) for a in spec.get("adapters", ())),
        )

    @classmethod
    def load(cls, path: str | Path) -> Workload:
        path = Path(path)
        with path.open() as f:
            spec = json.load(f)
        return cls.from_dict(spec, base_dir=path.parent, name=path.stem)

    def describe(self) -> dict[str, Any]:
        """The parameters as JSON (for the report), prompt texts left out."""
        return {
            "name": self.name,
            "seed": self.seed,
            "prompt_source": self.prompt_source,
            "prompt_len": self.prompt_len.to_json() if self.prompt_source == "random" else None,
            "num_prompt_texts": len(self.prompt_texts),
            "num_prefixes": self.num_prefixes,
            "prefix_len": self.prefix_len.to_json()
            if self.num_prefixes and not self.prefix_texts
            else None,
            "prefix_fraction": self.prefix_fraction if self.num_prefixes else 0.0,
            "output_len": self.output_len.to_json(),
            "ignore_eos": self.ignore_eos,
            "sampling": dict(self.sampling),
            "priorities": [{"value": v, "weight": w} for v, w in self.priorities],
            "cancel_fraction": self.cancel_fraction,
            "cancel_after_tokens": self.cancel_after.to_json(),
            "constraint": sorted(self.constraint) if self.constraint else None,
            "adapters": list(self.adapters),
        }

    # ---------------------------------------------------------------- drawing

    def build(
        self, num_requests: int | None = None, vocab_size: int | None = None
    ) -> list[RequestSpec]:
        """The first ``num_requests`` requests (default: the workload's own count).

        ``vocab_size`` (the server's) sets the default token id range of random prompts:
        ``[vocab_size // 8, 7 * vocab_size // 8)``, clear of the special tokens kept at either
        end of a vocabulary. Random prompts need it unless ``token_id_range`` is given.

        Every draw comes from a ``random.Random`` seeded with ``(seed, purpose)``, so changing
        one aspect (say the cancel fraction) leaves the prompts and lengths as they were.
        """
        n = self.num_requests if num_requests is None else num_requests
        if n < 1:
            raise ValueError(f"num_requests must be >= 1, got {n}")

        id_range = self.token_id_range
        if id_range is None and self.prompt_source == "random":
            if vocab_size is None or vocab_size < 8:
                raise ValueError(
                    f"random prompts need prompt.token_id_range or the server's vocab_size "
                    f"(>= 8), got {vocab_size}"
                )
            id_range = (vocab_size // 8, 7 * vocab_size // 8)

        def rng(purpose: str) -> random.Random:
            return random.Random(f"{self.seed}:{purpose}")

        def random_tokens(r: random.Random, num_tokens: int) -> tuple[int, ...]:
            assert id_range is not None
            return tuple(r.randrange(*id_range) for _ in range(num_tokens))

        prefix_ids = self._assign_prefixes(n, rng("prefix-assign"))
        prefixes_tokens: list[tuple[int, ...]] = []
        if self.prompt_source == "random" and self.num_prefixes:
            r = rng("prefix-tokens")
            prefixes_tokens = [
                random_tokens(r, self.prefix_len.sample(r)) for _ in range(self.num_prefixes)
            ]
        priorities = _apportion_shuffled(
            [v for v, _ in self.priorities], [w for _, w in self.priorities], n, rng("priority")
        )
        num_cancel = _exact_count(self.cancel_fraction, n)
        cancelled = set(_shuffled(range(n), rng("cancel-pick"))[:num_cancel])
        r_prompt, r_out, r_cancel, r_order = (
            rng("prompt"),
            rng("output"),
            rng("cancel-after"),
            rng("order"),
        )

        specs: list[RequestSpec] = []
        for i in range(n):
            max_tokens = self.output_len.sample(r_out)
            cancel_after: int | None = None
            if i in cancelled:
                max_tokens = max(2, max_tokens)
                cancel_after = min(max(1, self.cancel_after.sample(r_cancel)), max_tokens - 1)
            prefix_id = prefix_ids[i]
            text: str | None = None
            token_ids: tuple[int, ...] | None = None
            if self.prompt_source == "random":
                body = random_tokens(r_prompt, self.prompt_len.sample(r_prompt))
                token_ids = (prefixes_tokens[prefix_id] if prefix_id is not None else ()) + body
            else:
                if self.prompt_order == "cycle":
                    body_text = self.prompt_texts[i % len(self.prompt_texts)]
                else:
                    body_text = r_order.choice(self.prompt_texts)
                text = (self.prefix_texts[prefix_id] if prefix_id is not None else "") + body_text
            specs.append(
                RequestSpec(
                    index=i,
                    prompt_text=text,
                    prompt_token_ids=token_ids,
                    max_tokens=max_tokens,
                    ignore_eos=self.ignore_eos,
                    priority=priorities[i],
                    cancel_after_tokens=cancel_after,
                    prefix_id=prefix_id,
                    sampling=self.sampling,
                    constraint=self.constraint,
                    adapter=self.adapters[i % len(self.adapters)] if self.adapters else None,
                )
            )
        return specs

    def _assign_prefixes(self, n: int, rng: random.Random) -> list[int | None]:
        """Which prefix each request gets: an exact count share it, as evenly as possible."""
        out: list[int | None] = [None] * n
        if not self.num_prefixes:
            return out
        with_prefix = _shuffled(range(n), rng)[: _exact_count(self.prefix_fraction, n)]
        for k, i in enumerate(sorted(with_prefix)):
            out[i] = (
                rng.randrange(self.num_prefixes)
                if self.prefix_order == "random"
                else k % self.num_prefixes
            )
        return out


CONSTRAINT_KEYS = frozenset({"json_schema", "regex", "choice"})
SAMPLING_KEYS = frozenset(
    {
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
    }
)


def load_prompt_file(path: str | Path) -> tuple[str, ...]:
    """Prompts from ``{"prompts": [...]}`` (the chat128 format) or a bare JSON list."""
    with Path(path).open() as f:
        data = json.load(f)
    prompts = data.get("prompts") if isinstance(data, dict) else data
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(
            f"{path}: expected {{'prompts': [str, ...]}} or [str, ...] with >= 1 prompt"
        )
    return tuple(prompts)


def _resolve(path: str, base_dir: Path | None) -> Path:
    p = Path(path)
    return p if p.is_absolute() or base_dir is None else base_dir / p


def _check_keys(spec: Mapping[str, Any], allowed: set[str], what: str) -> None:
    if not isinstance(spec, Mapping):
        raise ValueError(f"{what} must be an object, got {spec!r}")
    unknown = set(spec) - allowed
    if unknown:
        raise ValueError(f"unknown {what} keys {sorted(unknown)}; allowed: {sorted(allowed)}")


def _exact_count(fraction: float, n: int) -> int:
    """round(fraction * n), halves rounded up."""
    return math.floor(fraction * n + 0.5)


def _shuffled(items: Sequence[int] | range, rng: random.Random) -> list[int]:
    out = list(items)
    rng.shuffle(out)
    return out


def apportion(weights: Sequence[float], n: int) -> list[int]:
    """Split n into integer counts proportional to weights (largest remainder; ties: first)."""
    total = sum(weights)
    quotas = [w / total * n for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda k: (-(quotas[k] - counts[k]), k))
    for k in by_remainder[: n - sum(counts)]:
        counts[k] += 1
    return counts


def _apportion_shuffled(
    values: Sequence[int], weights: Sequence[float], n: int, rng: random.Random
) -> list[int]:
    out: list[int] = []
    for value, count in zip(values, apportion(weights, n), strict=True):
        out.extend([value] * count)
    rng.shuffle(out)
    return out


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start) of n open-loop requests; the first is sent at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}:arrivals")
    theta = 1.0 / (rate * burstiness)
    out = [0.0]
    for _ in range(n - 1):
        out.append(out[-1] + rng.gammavariate(burstiness, theta))
    return out


WORKLOADS_DIR = Path(__file__).resolve().parent / "workloads"
# The reference prompts: 64 chat prompts of exactly 128 SmolLM2 tokens (the chat128 format).
CHAT128_PROMPTS = WORKLOADS_DIR / "prompts" / "chat128.json"


def resolve_workload(name_or_path: str) -> Path:
    """A path to a workload file, or the name of one shipped in loadtest/workloads/."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = WORKLOADS_DIR / f"{name_or_path}.json"
    if shipped.is_file():
        return shipped
    names = sorted(p.stem for p in WORKLOADS_DIR.glob("*.json"))
    raise ValueError(f"no workload file {name_or_path!r}; shipped workloads: {', '.join(names)}")
