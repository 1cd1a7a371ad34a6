"""TLS of the link between boxes: contexts that trust the cluster's own CA and nothing
else (no system store), require a certificate from each side, and speak TLS 1.3 only.
Roles follow the certificates' extended key usage (certs.py): the head's context serves
with the head's certificate, and OpenSSL checks the head's is a server's and each box's a
client's."""

from __future__ import annotations

import ssl
from pathlib import Path

from cryptography import x509

from appliance.cluster.certs import name_of
from appliance.settings.cluster import ClusterSettings


class TlsSetupError(ValueError):
    """The cluster's TLS files are missing or unusable (the message names the setting)."""


def head_context(settings: ClusterSettings) -> ssl.SSLContext:
    """The head's: serves with its certificate, requires each caller's."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.num_tickets = 0  # no session tickets: nothing arrives unasked after the handshake
    return _pinned(context, settings)


def box_context(settings: ClusterSettings) -> ssl.SSLContext:
    """An agent's and its workers': calls the head with the box's certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # The head is known by its certificate's purpose (only the head's serves) and this
    # cluster's CA, not by a host name: agents reach it by address.
    context.check_hostname = False
    return _pinned(context, settings)


def peer_name(certificate: bytes | None) -> str:
    """The box a peer's certificate (DER, as TLS checked it) names."""
    if certificate is None:
        return ""
    return name_of(x509.load_der_x509_certificate(certificate))


def _pinned(context: ssl.SSLContext, settings: ClusterSettings) -> ssl.SSLContext:
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    ca, cert, key = _files(settings)
    try:
        context.load_verify_locations(cafile=str(ca))  # this cluster's CA alone
    except (OSError, ssl.SSLError) as error:
        raise TlsSetupError(
            f"cluster.ca_file {ca} is not a readable CA certificate: {error}"
        ) from None
    try:
        context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as error:
        raise TlsSetupError(
            f"cluster.cert_file {cert} with cluster.key_file {key} cannot be used: {error}"
        ) from None
    return context


def _files(settings: ClusterSettings) -> tuple[Path, Path, Path]:
    files = (settings.ca_file, settings.cert_file, settings.key_file)
    if None in files:
        missing = [
            name
            for name, path in zip(("ca_file", "cert_file", "key_file"), files, strict=True)
            if path is None
        ]
        raise TlsSetupError(
            f"cluster.{', cluster.'.join(missing)} not set: the link between boxes is TLS "
            "with the cluster's own certificates (make them with `appliance certs --out DIR "
            "BOX...` and give each box ca.crt and its own .crt and .key)"
        )
    ca, cert, key = files
    assert ca is not None and cert is not None and key is not None
    return ca, cert, key
