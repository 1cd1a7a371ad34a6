"""HTTPS on the API (server.ssl_certfile / server.ssl_keyfile, vLLM's --ssl-certfile and
--ssl-keyfile): a real `appliance serve` with a certificate of a CA made here answers the
official openai client that trusts that CA, and plain HTTP on its port gets no answer.
Its own page's browser requests (Origin https://...) pass the origin guard."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from server_process import API_KEY, ServerProcess

from appliance.server.serve import check_https
from appliance.settings.config import ServerSettings

pytestmark = pytest.mark.process  # starts its own server: HTTPS is set at start


@dataclass
class HttpsServer(ServerProcess):
    """ServerProcess over https: its readiness poll trusts `ca`."""

    ca: Path | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(httpx, "get", partial(httpx.get, verify=trusting(self.ca)))
            super().start(timeout)


def trusting(ca: Path | None) -> ssl.SSLContext:
    """A client context that trusts `ca` alone."""
    assert ca is not None
    return ssl.create_default_context(cafile=str(ca))


def write_server_cert(folder: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signs for 127.0.0.1 and localhost: (ca, cert, key)."""
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    later = now + datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.crt", folder / "server.crt", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


@pytest.fixture(scope="module")
def https_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpsServer]:
    ca, cert, key = write_server_cert(tmp_path_factory.mktemp("https"))
    env = {
        "APPLIANCE_API_KEY": API_KEY,
        "APPLIANCE_MODE": "colocated",
        "APPLIANCE_KV__MEMORY_MB": "64",
        "APPLIANCE_SERVER__SSL_CERTFILE": str(cert),
        "APPLIANCE_SERVER__SSL_KEYFILE": str(key),
    }
    process = HttpsServer(env, ca=ca)
    process.start()
    yield process
    process.stop()


def test_the_openai_client_reaches_the_api_over_https_with_the_ca(
    https_server: HttpsServer,
) -> None:
    client = openai.OpenAI(
        base_url=https_server.url + "/v1",
        api_key=API_KEY,
        max_retries=0,
        http_client=httpx.Client(verify=trusting(https_server.ca), timeout=120),
    )
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=4,
        temperature=0,
    )
    assert reply.choices[0].message.content and reply.usage is not None
    assert reply.usage.completion_tokens == 4 or reply.choices[0].finish_reason == "stop"
    assert any(f"{https_server.url}/v1" in line for line in https_server.output)  # ready line


def test_without_the_ca_or_over_plain_http_nothing_is_served(https_server: HttpsServer) -> None:
    untrusting = openai.OpenAI(base_url=https_server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        untrusting.models.list()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{https_server.port}/health", timeout=10)


def test_its_own_page_may_call_it_over_https(https_server: HttpsServer) -> None:
    """A browser on the server's page sends Origin https://host:port: its own origin."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(verify=trusting(https_server.ca), timeout=30) as client:
        own = client.get(
            https_server.url + "/v1/models", headers={**headers, "Origin": https_server.url}
        )
        other = client.get(
            https_server.url + "/v1/models",
            headers={**headers, "Origin": f"http://127.0.0.1:{https_server.port}"},
        )
    assert own.status_code == 200, own.text
    assert other.status_code == 403  # the http origin is another origin


def test_https_needs_both_files_and_usable_ones(tmp_path: Path) -> None:
    ca, cert, key = write_server_cert(tmp_path)
    check_https(ServerSettings(ssl_certfile=cert, ssl_keyfile=key))
    check_https(ServerSettings())
    with pytest.raises(ValueError, match=r"ssl_certfile and server\.ssl_keyfile go together"):
        check_https(ServerSettings(ssl_certfile=cert))
    with pytest.raises(ValueError, match=r"server.ssl_certfile .* cannot be used"):
        check_https(ServerSettings(ssl_certfile=ca, ssl_keyfile=key))  # not the key's cert
