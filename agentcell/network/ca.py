"""The egress CA: the certificate authority the egress proxy signs its TLS certificates with, for the
hosts whose requests it must read to put a secret in (network/inspection.py).

One CA per server state directory (key 0600, directory 0700), created on first use. Its certificate
(never its key) goes into every sandbox's trust store, so code there accepts the proxy's certificate
for a secret's host; nothing else gets a certificate from it. Leaf certificates are minted per host
name on demand (about 1 ms; cached), valid for 7 days, with one EC key shared by all leaves of a
server (a leaf key protects nothing the CA key does not: both live only in the server's memory).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import ssl
import tempfile
from collections import OrderedDict

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CACHE = 512  # minted SSL contexts kept


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class EgressCA:
    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.key = key
        self.cert = cert
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._leaf_key_pem = self._leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        self._contexts: OrderedDict[str, ssl.SSLContext] = OrderedDict()

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def load_or_create(cls, directory: str) -> EgressCA:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        key_path, cert_path = os.path.join(directory, "ca.key"), os.path.join(directory, "ca.pem")
        try:
            with open(key_path, "rb") as f:
                key = serialization.load_pem_private_key(f.read(), None)
            with open(cert_path, "rb") as f:
                cert = x509.load_pem_x509_certificate(f.read())
            if isinstance(key, ec.EllipticCurvePrivateKey) and cert.not_valid_after_utc > _now() + datetime.timedelta(
                    days=30):
                return cls(key, cert)
        except (OSError, ValueError):
            pass
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"agentcell egress CA ({secrets.token_hex(4)})")])
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(_now() - datetime.timedelta(hours=1))
                .not_valid_after(_now() + datetime.timedelta(days=3650))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(ski, critical=False)
                .sign(key, hashes.SHA256()))
        _write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
        _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return cls(key, cert)

    def server_context(self, host: str) -> ssl.SSLContext:
        """A server-side TLS context whose certificate is valid for `host` (a name or an IP)."""
        ctx = self._contexts.get(host)
        if ctx is not None:
            self._contexts.move_to_end(host)
            return ctx
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])  # the proxy speaks HTTP/1.1: HTTP/2 clients fall back
        # load_cert_chain takes files only: a private temporary file, gone at once
        with tempfile.NamedTemporaryFile("wb", prefix="agentcell-leaf-") as f:
            f.write(self._leaf(host) + self._leaf_key_pem)
            f.flush()
            ctx.load_cert_chain(f.name)
        self._contexts[host] = ctx
        while len(self._contexts) > CACHE:
            self._contexts.popitem(last=False)
        return ctx

    def issue(self, host: str, *more: str) -> bytes:
        """A leaf certificate for `host` (and `more` names) and its key, PEM (for servers that are not
        this process: tests)."""
        return self._leaf(host, *more) + self._leaf_key_pem

    def _leaf(self, host: str, *more: str) -> bytes:
        names: list[x509.GeneralName] = []
        for name in (host, *more):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                names.append(x509.DNSName(name))
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
                .issuer_name(self.cert.subject).public_key(self._leaf_key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(_now() - datetime.timedelta(hours=1))
                .not_valid_after(_now() + datetime.timedelta(days=7))
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM)


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
