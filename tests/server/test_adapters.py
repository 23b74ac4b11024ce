"""server.lora.Adapters over a list (the cluster's OpenAI ingress, the Ray router): the same
answers as over a live registry (tests/server/test_lora_server.py), and no loading."""

from __future__ import annotations

import pytest

from model_runner.lora.info import AdapterError, AdapterInfo, AdapterNotFoundError
from scheduler.request import LoraRef
from server.lora import Adapters
from server.rpc import generation_pb2 as pb

SQL = AdapterInfo("sql", "/adapters/sql", "peft", 8, 16.0, ("q_proj",), "abc", 0)


def test_listed_adapters_resolve_and_refuse_loads() -> None:
    """The ingress lists and resolves what the replicas reported; an unknown name is refused
    naming what is served; loading is the replicas' (AdapterError)."""
    adapters = Adapters(infos=[SQL], base_name="smol")
    assert not adapters.can_load
    assert adapters.infos() == [SQL] and adapters.names() == ["sql"]
    assert adapters.resolve("sql", 0.5) == LoraRef("sql", SQL.key, 0.5)
    with pytest.raises(AdapterNotFoundError, match="serves 'smol' and the adapters: 'sql'"):
        adapters.resolve("chat")
    for call in (lambda: adapters.load("chat", "/x"), lambda: adapters.unload("sql")):
        with pytest.raises(AdapterError, match="this front holds no adapters"):
            call()


def test_keys_resolve_without_being_listed_and_scales_apply() -> None:
    """The router's adapters are known by key only: resolved, never listed. llama.cpp's
    server-wide scale picks the adapter of a request that names none."""
    adapters = Adapters(keys={"chat": "chat@def"})
    assert adapters.infos() == []
    assert adapters.for_request(pb.GenerateRequest(adapter="chat")) == LoraRef("chat", "chat@def")
    listed = Adapters(infos=[SQL])
    listed.set_scales({"sql": 2.0})
    assert listed.for_request(pb.GenerateRequest()) == LoraRef("sql", SQL.key, 2.0)
    assert listed.for_request(pb.GenerateRequest(adapter_scale=0)) is None
