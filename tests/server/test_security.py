"""TLS and API keys on gRPC, HTTP and metrics, with a throwaway CA made at test time; and
requests that belong to their caller (ids scoped per key)."""

from __future__ import annotations

import asyncio
import io
import ssl
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from metrics.prometheus import PrometheusSink
from server import cli
from server.asgi import metrics_app, start_asgi_server
from server.auth import AuthError, NotAdminError, Security, TlsFiles, key_owner, request_owner
from server.client import KVServeClient
from server.rpc import generation_pb2 as pb
from server.rpc import generation_pb2_grpc as pb_grpc
from tests.server.helpers import collect, expected_tokens, make_fake_runner, serve

KEYS = frozenset({"key-alice", "key-bob"})


@dataclass
class Pki:
    ca: trustme.CA
    ca_file: Path
    cert_file: Path
    key_file: Path
    client_cert: bytes
    client_key: bytes

    def tls(self, client_ca: bool = False) -> TlsFiles:
        ca = str(self.ca_file) if client_ca else None
        return TlsFiles(str(self.cert_file), str(self.key_file), ca)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A fresh CA, a server certificate for 127.0.0.1 and a client certificate."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@example.com")
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.cert_chain_pems[0].write_to_path(str(files["cert"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    return Pki(
        ca, files["ca"], files["cert"], files["key"],
        client.cert_chain_pems[0].bytes(), client.private_key_pem.bytes(),
    )  # fmt: skip


def tls_channel(
    pki: Pki, key: str | None, client_cert: bool = False
) -> Callable[[str], grpc.aio.Channel]:
    def make(address: str) -> grpc.aio.Channel:
        creds = grpc.ssl_channel_credentials(
            root_certificates=pki.ca_file.read_bytes(),
            private_key=pki.client_key if client_cert else None,
            certificate_chain=pki.client_cert if client_cert else None,
        )
        if key is not None:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(key)
            )
        return grpc.aio.secure_channel(address, creds)

    return make


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateResponse]:  # type: ignore[type-arg]
    """The remaining messages of a call already read with ``read()`` (no iterator mixing)."""
    msgs = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        msgs.append(msg)
    return msgs


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_tls_and_api_key_server_refuses_plaintext_and_keyless_and_serves_a_good_client(
    pki: Pki,
) -> None:
    """gRPC: plaintext fails, TLS without a key or with a wrong one is UNAUTHENTICATED,
    health stays open, TLS + key streams. HTTP: the openai SDK over HTTPS gets 401 without a
    good key and the exact text with one; plain http to the TLS port fails."""
    security = Security(api_keys=KEYS, tls=pki.tls())
    async with serve(http=True, security=security, channel=tls_channel(pki, "key-alice")) as h:
        async with grpc.aio.insecure_channel(h.address) as plain:
            plain_code = await _code(
                pb_grpc.GenerationStub(plain).GetModelInfo(pb.GetModelInfoRequest(), timeout=3)
            )
        async with tls_channel(pki, None)(h.address) as keyless:
            stub = pb_grpc.GenerationStub(keyless)
            keyless_code = await _code(stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5))
            stream_code = await _code(
                collect(stub.Generate(pb.GenerateRequest(text="x"), timeout=5))
            )
            wrong_code = await _code(
                stub.GetModelInfo(
                    pb.GetModelInfoRequest(), metadata=(("authorization", "Bearer nope"),)
                )
            )
            health = health_pb2_grpc.HealthStub(keyless)
            status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
        msgs = await collect(h.client.generate("hi", request_id="g1", max_tokens=4))

        ca = ssl.create_default_context(cafile=str(pki.ca_file))
        good = openai.AsyncOpenAI(
            base_url=f"{h.http_url}/v1", api_key="key-bob", max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(verify=ca),
        )  # fmt: skip
        bad = openai.AsyncOpenAI(
            base_url=f"{h.http_url}/v1", api_key="key-eve", max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(verify=ca),
        )  # fmt: skip
        done = await good.completions.create(
            model="fake", prompt="hi", max_tokens=3, extra_headers={"X-Request-Id": "h1"}
        )
        with pytest.raises(openai.AuthenticationError) as denied:
            await bad.completions.create(model="fake", prompt="hi", max_tokens=3)
        async with httpx.AsyncClient(verify=ca) as https:
            open_health = (await https.get(f"{h.http_url}/health")).status_code
            keyless_models = await https.get(f"{h.http_url}/v1/models")
        plain_url = h.http_url.replace("https://", "http://")
        with pytest.raises(httpx.HTTPError):
            async with httpx.AsyncClient() as http:
                await http.get(
                    f"{plain_url}/v1/models", headers={"Authorization": "Bearer key-bob"}
                )
        await good.close()
        await bad.close()
    assert plain_code == grpc.StatusCode.UNAVAILABLE
    assert keyless_code == stream_code == wrong_code == grpc.StatusCode.UNAUTHENTICATED
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(
        h.runner, "g1", 4, owner=key_owner("key-alice")
    )
    bob = key_owner("key-bob")
    assert done.choices[0].text == h.tokenizer.decode(
        expected_tokens(h.runner, "h1", 3, owner=bob), skip_special_tokens=True
    )
    assert denied.value.status_code == 401 and "invalid API key" in denied.value.message
    assert open_health == 200
    assert keyless_models.status_code == 401
    assert "Bearer" in keyless_models.json()["error"]["message"]


async def test_client_certificates_are_required_with_a_client_ca(pki: Pki) -> None:
    """With --tls-client-ca, a TLS client without a certificate is refused; one with a
    certificate from that CA is served."""
    security = Security(tls=pki.tls(client_ca=True))
    async with serve(security=security, channel=tls_channel(pki, None, client_cert=True)) as h:
        async with tls_channel(pki, None)(h.address) as no_cert:
            refused = await _code(
                pb_grpc.GenerationStub(no_cert).GetModelInfo(pb.GetModelInfoRequest(), timeout=3)
            )
        info = await h.client.model_info()
    assert refused == grpc.StatusCode.UNAVAILABLE
    assert info.model == "fake"


async def test_metrics_need_an_admin_key_and_speak_tls(pki: Pki) -> None:
    """The metrics endpoint behind TLS + keys: 401 without a key, 403 with a tenant's key
    (the figures are every tenant's), the exposition with the admin key."""
    registry = CollectorRegistry()
    PrometheusSink(registry, model_info={"model": "m"})
    security = Security(
        api_keys=KEYS | {"key-admin"}, tls=pki.tls(), admin_keys=frozenset({"key-admin"})
    )
    server = await start_asgi_server(metrics_app(registry, security), "127.0.0.1", 0, security)
    try:
        url = f"https://127.0.0.1:{server.port}/metrics"
        ca = ssl.create_default_context(cafile=str(pki.ca_file))
        async with httpx.AsyncClient(verify=ca) as https:
            denied = await https.get(url)
            tenant = await https.get(url, headers={"Authorization": "Bearer key-alice"})
            allowed = await https.get(url, headers={"Authorization": "Bearer key-admin"})
    finally:
        await server.stop()
    assert denied.status_code == 401
    assert tenant.status_code == 403
    assert tenant.json()["error"]["type"] == "permission_error"
    assert "--admin-api-key" in tenant.json()["error"]["message"]
    assert allowed.status_code == 200 and "kvserve_model_info{" in allowed.text


async def test_a_second_tenants_abort_leaves_the_first_tenants_stream_untouched() -> None:
    """Alice streams 'x'. Bob's Abort('x') finds nothing, and Bob may run his own 'x' at the
    same time (no ALREADY_EXISTS). Alice's stream ends with every token; her own Abort of a
    second request works."""
    runner = make_fake_runner(max_model_len=1024, sleep_s=0.005)
    alice = (("authorization", "Bearer key-alice"),)
    bob = (("authorization", "Bearer key-bob"),)
    async with serve(runner, security=Security(api_keys=KEYS)) as h:
        stub = h.client.stub
        request = pb.GenerateRequest(
            text="alice's prompt", request_id="x", stopping=pb.StoppingOptions(max_tokens=60)
        )
        alice_call = stub.Generate(request, metadata=alice)
        first = await alice_call.read()
        bob_abort = await stub.Abort(pb.AbortRequest(request_id="x"), metadata=bob)
        bob_msgs = await collect(
            stub.Generate(pb.GenerateRequest(text="bob", request_id="x",
                                             stopping=pb.StoppingOptions(max_tokens=3)),
                          metadata=bob)
        )  # fmt: skip
        alice_rest = await read_rest(alice_call)
        second = stub.Generate(
            pb.GenerateRequest(
                text="a", request_id="y", stopping=pb.StoppingOptions(max_tokens=500)
            ),
            metadata=alice,
        )
        await second.read()
        own_abort = await stub.Abort(pb.AbortRequest(request_id="y"), metadata=alice)
        second_rest = await read_rest(second)
    msgs = [first, *alice_rest]
    assert bob_abort.found is False
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(
        h.runner, "x", 60, owner=key_owner("key-alice")
    )
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].request_id == "x"
    assert [t for m in bob_msgs for t in m.token_ids] == expected_tokens(
        h.runner, "x", 3, owner=key_owner("key-bob")
    )
    assert own_abort.found is True
    assert second_rest[-1].finish_reason == pb.FINISH_REASON_ABORT


async def test_without_keys_requests_are_scoped_by_peer_host() -> None:
    """With auth off the owner is the peer's host: the same id from two connections of one
    host is one request (ALREADY_EXISTS), as before keys existed."""
    runner = make_fake_runner(max_model_len=1024, sleep_s=0.005)
    async with serve(runner) as h:
        call = h.client.stub.Generate(
            pb.GenerateRequest(text="p", request_id="same",
                               stopping=pb.StoppingOptions(max_tokens=200))
        )  # fmt: skip
        await call.read()
        async with grpc.aio.insecure_channel(h.address) as other:
            code = await _code(
                collect(pb_grpc.GenerationStub(other).Generate(
                    pb.GenerateRequest(text="q", request_id="same")
                ))
            )  # fmt: skip
        call.cancel()
        await asyncio.sleep(0)
    assert code == grpc.StatusCode.ALREADY_EXISTS


async def test_kvserve_generate_and_the_python_client_take_a_key_and_a_ca(pki: Pki) -> None:
    """`kvserve generate --api-key --tls-ca` and KVServeClient(api_key=, tls_ca=) are served
    by a TLS + key server; without the key, generate exits 1 naming UNAUTHENTICATED."""
    security = Security(api_keys=KEYS, tls=pki.tls())
    async with serve(security=security, channel=tls_channel(pki, "key-alice")) as h:
        ca = pki.ca_file.read_bytes()
        async with KVServeClient(h.address, api_key="key-bob", tls_ca=ca) as client:
            text, _ = await client.generate_text("hi", request_id="p1", max_tokens=3)
        argv = ["generate", "--address", h.address, "--tls-ca", str(pki.ca_file),
                "--max-tokens", "3", "--request-id", "c1", "hi"]  # fmt: skip
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = await asyncio.to_thread(cli.main, [*argv, "--api-key", "key-alice"])
            denied = await asyncio.to_thread(cli.main, argv)
    bob, alice = key_owner("key-bob"), key_owner("key-alice")
    assert text == h.tokenizer.decode(
        expected_tokens(h.runner, "p1", 3, owner=bob), skip_special_tokens=True
    )
    assert (code, denied) == (0, 1)
    assert out.getvalue().startswith(
        h.tokenizer.decode(
            expected_tokens(h.runner, "c1", 3, owner=alice), skip_special_tokens=True
        )
    )
    assert "UNAUTHENTICATED: missing API key" in err.getvalue()


def _refusal(check: Callable[[str | None], None], header: str | None) -> tuple[type, str]:
    try:
        check(header)
    except (AuthError, NotAdminError) as exc:
        return type(exc), str(exc)
    return type(None), ""


def test_the_owner_gate_answers_as_the_keys_do_without_holding_them() -> None:
    """Security.owner_gate() (key digests only, for the cluster's router) refuses a missing
    or wrong key and a tenant's key exactly as Security does, lets the admin key through,
    and is open without keys; request_owner names the owner a request's id is scoped by."""
    security = Security(api_keys=frozenset({"alice", "root"}), admin_keys=frozenset({"root"}))
    gate = security.owner_gate()
    assert "alice" not in repr(gate) and gate.auth_enabled
    headers = (None, "Basic x", "Bearer nope", "Bearer alice", "Bearer root")
    want = [_refusal(security.authenticate_admin, h) for h in headers]
    assert [kind for kind, _ in want] == [AuthError] * 3 + [NotAdminError, type(None)]
    assert [_refusal(gate.authenticate_admin, h) for h in headers] == want
    assert _refusal(Security().owner_gate().authenticate_admin, None) == (type(None), "")
    assert request_owner("Bearer alice", "10.0.0.1", True) == key_owner("alice")
    assert request_owner(None, "10.0.0.1", True) == "unauthenticated"
    assert request_owner("Bearer alice", "10.0.0.1", False) == "peer:10.0.0.1"
