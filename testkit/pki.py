"""A throwaway PKI for tests: a CA and certificates with the identities and key usages the peer
link's checks are about (SAN URI/DNS, CN, serverAuth/clientAuth), written as PEM into a tmp dir.
EC P-256 keys: generating a few takes milliseconds."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    cert: Path
    key: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


class CA:
    def __init__(self, directory: Path, name: str = "rrto-test-ca"):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.path = self.dir / f"{name}.crt"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, *, cn: str | None = None, uris: tuple[str, ...] = (),
              dns: tuple[str, ...] = (), ips: tuple[str, ...] = (),
              usage: tuple[str, ...] = ("clientAuth",)) -> Issued:
        """A leaf certificate; ``usage`` lists extendedKeyUsage names (empty: no extension)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn else [])
        builder = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(self.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
        names += [x509.DNSName(d) for d in dns]
        names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=not cn)
        oids = {"clientAuth": ExtendedKeyUsageOID.CLIENT_AUTH,
                "serverAuth": ExtendedKeyUsageOID.SERVER_AUTH}
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([oids[u] for u in usage]),
                                            critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        out = Issued(self.dir / f"{name}.crt", self.dir / f"{name}.key")
        out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, out.key)
        return out

    def server(self, name: str = "gpu") -> Issued:
        """The GPU host's certificate, as robots dial it: localhost / 127.0.0.1, serverAuth."""
        return self.issue(name, cn=name, dns=("localhost",), ips=("127.0.0.1",),
                          usage=("serverAuth",))

    def robot(self, name: str) -> Issued:
        """A robot's client certificate: identity spiffe://fleet/NAME, clientAuth."""
        return self.issue(name, cn=name, uris=(f"spiffe://fleet/{name}",), usage=("clientAuth",))
