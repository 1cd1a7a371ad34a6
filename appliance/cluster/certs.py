"""The cluster's own certificates (`appliance certs`): a CA made for this cluster alone, a
certificate for the head and one per box, each naming its box. The link between boxes
(channel.py) trusts this CA and no other, so a certificate bought or made elsewhere, or
one of another cluster, does not get in.

Roles are in the certificates' extended key usage: the head's serves (serverAuth), a box's
only calls (clientAuth), so a box's certificate cannot pose as the head to another box.
Keys are EC P-256, written mode 0600; the CA's key is needed again only to add boxes.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_NAME = "ca"  # ca.crt and ca.key in the folder
HEAD_NAME = "head"  # the head's certificate's default name
DEFAULT_DAYS = 3650
BOX_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


class CertError(ValueError):
    """A certificate cannot be made as asked (the message says why)."""


@dataclass(frozen=True)
class Issued:
    """One certificate written: whose, and its two files."""

    name: str
    cert: Path
    key: Path


def make_certs(
    folder: Path, boxes: list[str], head: str = HEAD_NAME, days: int = DEFAULT_DAYS
) -> list[Issued]:
    """Into `folder`: the cluster CA (made unless the folder holds one: then boxes are
    added to that cluster), the head's certificate unless there is one, and one per box in
    `boxes`. An existing box certificate is not replaced (CertError)."""
    for name in [head, *boxes]:
        check_name(name)
    if head in boxes or len(set(boxes)) != len(boxes):
        raise CertError("each box is named once, and none after the head")
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _load_or_make_ca(folder, days)
    issued = []
    if not (folder / f"{head}.crt").exists():
        issued.append(_issue(folder, head, ca_key, ca_cert, days, serves=True))
    for box in boxes:
        if (folder / f"{box}.crt").exists():
            raise CertError(f"{folder / (box + '.crt')} exists: box {box!r} has a certificate")
        issued.append(_issue(folder, box, ca_key, ca_cert, days, serves=False))
    return issued


def check_name(name: str) -> None:
    """A box name fit for a certificate and a file name."""
    if not BOX_NAME.fullmatch(name) or name == CA_NAME:
        raise CertError(
            f"{name!r} is not a box name for a certificate: letters, digits, '.', '_' and "
            f"'-', at most 63, and not {CA_NAME!r}"
        )


def name_of(cert: x509.Certificate) -> str:
    """The box a certificate names (its subject's common name)."""
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def _load_or_make_ca(
    folder: Path, days: int
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    cert_path, key_path = folder / f"{CA_NAME}.crt", folder / f"{CA_NAME}.key"
    if cert_path.exists() != key_path.exists():
        raise CertError(f"{folder} holds one of {CA_NAME}.crt and {CA_NAME}.key: both or neither")
    if cert_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise CertError(f"{key_path} is not an EC key `appliance certs` made")
        return key, x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    # A random serial in the name: two clusters' CAs never share a subject.
    subject = _name(f"appliance cluster CA {x509.random_serial_number():x}"[:64])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, cert_path, key, cert)
    return key, cert


def _issue(
    folder: Path,
    name: str,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    days: int,
    serves: bool,
) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    purpose = ExtendedKeyUsageOID.SERVER_AUTH if serves else ExtendedKeyUsageOID.CLIENT_AUTH
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([purpose]), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    _write(key_path, cert_path, key, cert)
    return Issued(name, cert_path, key_path)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _now() -> datetime.datetime:
    # A little in the past: boxes whose clocks lag a minute still accept it.
    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)


def _write(
    key_path: Path, cert_path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate
) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # Created 0600: the key is never readable by others, not even for a moment.
    descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(pem)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
