"""The committed gRPC stubs match proto/ and import as a normal package."""

from __future__ import annotations

from pathlib import Path

from server.rpc import gen


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    """Regenerating from proto/kvserve/v1/generation.proto reproduces server/rpc/ byte for byte."""
    gen.generate(tmp_path)
    stale = [
        name
        for name in gen.GENERATED_FILES
        if (tmp_path / name).read_bytes() != (gen.RPC_DIR / name).read_bytes()
    ]
    assert not stale, f"stale stubs {stale}: run `python -m server.rpc.gen` (make proto)"


def test_stubs_import_as_package_with_canonical_names() -> None:
    """The stubs import from server.rpc and keep the kvserve.v1 package for reflection."""
    from server.rpc import generation_pb2, generation_pb2_grpc

    assert generation_pb2.DESCRIPTOR.name == "kvserve/v1/generation.proto"
    assert generation_pb2.DESCRIPTOR.package == "kvserve.v1"
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "kvserve.v1.Generation"
    assert generation_pb2.GenerateRequest.__module__ == "server.rpc.generation_pb2"
    assert generation_pb2_grpc.GenerationStub.__module__ == "server.rpc.generation_pb2_grpc"
