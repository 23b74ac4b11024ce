"""What the rest of kvserve knows about adapters without torch: their errors and the
``AdapterInfo`` the fronts list (the registry, files and kernels import torch)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from scheduler.lora import BASE_ADAPTER_LABEL

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(frozen=True, slots=True)
class AdapterCounts:
    """How adapters come and go (``kvserve_lora_adapters_*``): those laid out in memory now,
    and since start the lay-outs (first loads and re-reads after an eviction) and evictions."""

    resident: int
    loads_total: int
    evictions_total: int


class AdapterError(ValueError):
    """An adapter that cannot be served: unreadable, of a kind kvserve does not apply, or not
    made for this base model. The message names the file and the reason."""


class AdapterNotFoundError(LookupError):
    """No adapter of that name is served (or it is being unloaded); the message lists the
    names that are."""


class AdapterConflictError(ValueError):
    """An adapter of that name is already loaded (or still unloading)."""


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What the fronts list about one adapter (``/v1/models``, ``GetModelInfo``)."""

    name: str
    path: str
    kind: str  # "peft" or "gguf"
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    digest: str
    num_parameters: int
    resident: bool = True

    @property
    def key(self) -> str:
        return adapter_key(self.name, self.digest)


def adapter_key(name: str, digest: str) -> str:
    """What names an adapter's weights in the prefix cache's keys."""
    return f"{name}@{digest}"


def check_name(name: str, base_name: str = "") -> None:
    """An adapter name: 1-128 of letters, digits and ``._:/@+-``, neither the base model's
    nor ``base``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise AdapterError(
            f"adapter name {name!r}: use 1-128 letters, digits and ._:/@+- (starting with a "
            "letter or digit)"
        )
    if (base_name and name == base_name) or name == BASE_ADAPTER_LABEL:
        raise AdapterError(
            f"adapter name {name!r} is taken: the base model's name, or "
            f"{BASE_ADAPTER_LABEL!r} (its label in the metrics); pick another"
        )
