"""Self-signed certificates for the TLS tests, made with the ``openssl`` command line (the
``cryptography`` package is not a dependency): ``from self_signed import make_cert``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

OPENSSL = shutil.which("openssl")


def make_cert(folder: Path, name: str, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """-> (certificate, key) PEM files: a P-256 key and a one-day self-signed certificate for
    ``host`` and ``localhost`` (a self-signed certificate is its own CA). Skips the test when
    there is no ``openssl``."""
    if OPENSSL is None:
        pytest.skip("needs the openssl command line to make a self-signed certificate")
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(
        [OPENSSL, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=IP:{host},DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key
