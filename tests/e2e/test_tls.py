"""TLS for clients: a stack started with a freshly generated self-signed certificate (tls.certfile,
tls.keyfile) serves HTTPS, WSS and gRPC over TLS on its usual ports, to real clients that trust that
certificate; a plaintext client, or one that does not trust it, gets nothing."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import websockets

from common.model_source import load_tokenizer
from common.protos.salience.v1 import salience_pb2 as pb
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc
from tests.e2e.test_salience import generate, greedy
from tests.stack import Stack, start_stack


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1 and its key, as `openssl req -x509` would make them."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    certfile, keyfile = directory / "cert.pem", directory / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    keyfile.chmod(0o600)
    return certfile, keyfile


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    certs = tmp_path_factory.mktemp("certs")
    certfile, keyfile = self_signed(certs)
    started = start_stack(tmp_path_factory.mktemp("tls"), TILLER_TLS__CERTFILE=str(certfile),
                          TILLER_TLS__KEYFILE=str(keyfile))
    yield started
    started.down()


@pytest.fixture(scope="module")
def certfile(tls_stack: Stack) -> Path:
    assert tls_stack.settings.tls.certfile is not None
    return tls_stack.settings.tls.certfile


def test_https_serves_clients_that_trust_the_certificate_only(tls_stack: Stack, certfile: Path) -> None:
    assert tls_stack.http_url.startswith("https://")
    body = {"model": tls_stack.settings.served_model_name, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=tls_stack.http_url, verify=ssl.create_default_context(cafile=str(certfile))) as client:
        assert client.get("/health").status_code == 200
        completion = client.post("/v1/completions", json=body, timeout=120)
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 4
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{tls_stack.http_url}/health")  # the system's trust store does not know it
    plain = f"http://127.0.0.1:{tls_stack.settings.http_port}/health"
    with pytest.raises(httpx.HTTPError):  # a plaintext request on the TLS port is not answered
        response = httpx.get(plain, timeout=10)
        pytest.fail(f"plaintext HTTP was answered: {response.status_code} {response.text[:200]}")


async def test_wss_streams_tokens(tls_stack: Stack, certfile: Path) -> None:
    assert tls_stack.ws_url.startswith("wss://")
    config = {"type": "config", "prompt": "Once upon a time",
              "parameters": {"max_tokens": 5, "temperature": 0, "ignore_eos": True}}
    tokens, completion = 0, None
    async with websockets.connect(tls_stack.ws_url, ssl=ssl.create_default_context(cafile=str(certfile))) as ws:
        await ws.send(json.dumps(config))
        async for raw in ws:
            msg = json.loads(raw)
            assert msg["type"] != "error", msg
            if msg["type"] == "token":
                tokens += 1
            elif msg["type"] == "completion":
                completion = msg
                break
    assert completion is not None and tokens == 5, (tokens, completion)


async def test_grpc_over_tls_serves_and_a_plaintext_channel_is_refused(tls_stack: Stack, certfile: Path) -> None:
    address = f"127.0.0.1:{tls_stack.settings.grpc_port}"
    credentials = grpc.ssl_channel_credentials(root_certificates=certfile.read_bytes())
    async with grpc.aio.secure_channel(address, credentials) as channel:
        stub = pb_grpc.SalienceStub(channel)
        opened = await stub.OpenSession(pb.OpenSessionRequest(model=tls_stack.settings.served_model_name), timeout=60)
        prompt = load_tokenizer(tls_stack.settings).encode("The capital of France is")
        result = await generate(stub, session_id=opened.session_id, append_tokens=prompt, offset=0, max_tokens=3,
                                **greedy())
        assert len(result.tokens) == 3, result
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.SalienceStub(channel).OpenSession(
                pb.OpenSessionRequest(model=tls_stack.settings.served_model_name), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
