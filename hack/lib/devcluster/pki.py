"""Keys and certificates for one cluster run, made with the openssl CLI.

A fresh CA per run lets the kubeconfig verify the apiserver's certificate
(no insecure-skip-tls-verify anywhere) and lets kube-controller-manager publish
that CA as kube-root-ca.crt. The service-account key pair signs and checks
pod tokens. openssl is used because it is on every machine we run on.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path
    sa_pub: Path
    kubelet_client_cert: Path
    kubelet_client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _key(name: str, cwd: Path) -> None:
    # EC keys: generating them takes milliseconds, RSA-2048 can take a second.
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key", cwd=cwd)


def issue(name: str, subject: str, extensions: str, cwd: Path) -> None:
    """NAME.key and NAME.crt in `cwd`: a new key and its certificate for `subject`, signed by the CA there
    (ca.key), with the X.509v3 `extensions` (lines of an openssl extfile)."""
    _key(name, cwd)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=cwd)
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "30",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.crt",
        cwd=cwd,
    )


def generate(directory: Path, hosts: list[str]) -> Pki:
    """Write a CA, an apiserver serving cert for `hosts` (IPs or names) and SA keys."""
    directory.mkdir(parents=True, exist_ok=True)
    d = directory
    _key("ca", d)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        "ca.key",
        "-days",
        "30",
        "-subj",
        "/CN=kvpilot-devcluster-ca",
        "-out",
        "ca.crt",
        cwd=d,
    )
    sans = ",".join((f"IP:{h}" if h.replace(".", "").isdigit() else f"DNS:{h}") for h in hosts)
    issue(
        "apiserver",
        "/CN=kube-apiserver",
        f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n",
        d,
    )
    _key("sa", d)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    # The apiserver's client cert for the kubelets (kubectl logs, exec, port-forward), which accept only
    # clients signed by this CA.
    issue(
        "kubelet-client",
        "/O=system:masters/CN=kube-apiserver-kubelet-client",
        "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature\n",
        d,
    )
    return Pki(
        d / "ca.crt",
        d / "apiserver.crt",
        d / "apiserver.key",
        d / "sa.key",
        d / "sa.pub",
        d / "kubelet-client.crt",
        d / "kubelet-client.key",
    )
