"""HTTPS for the gateway, as vLLM's ``--ssl-*`` flags ask for it."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Tls:
    """HTTPS, as vLLM's ``--ssl-*`` flags give it (uvicorn's settings of the same names)."""

    certfile: str  # the server's certificate chain (PEM; may hold the key too)
    keyfile: str | None = None  # its private key (PEM)
    ca_certs: str | None = None  # CAs whose client certificates are trusted
    cert_reqs: int = ssl.CERT_NONE  # client certificates: 0 none, 1 optional, 2 required

    def uvicorn_settings(self) -> dict[str, Any]:
        return {
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_ca_certs": self.ca_certs,
            "ssl_cert_reqs": self.cert_reqs,
        }

    def files(self) -> str:
        given = [
            ("certfile", self.certfile),
            ("keyfile", self.keyfile),
            ("ca-certs", self.ca_certs),
        ]
        return ", ".join(f"--ssl-{flag} {path}" for flag, path in given if path is not None)

    def check(self) -> None:
        """Loads the files as uvicorn will: an unreadable or unmatched one is then an error
        at start that names it, not a traceback inside uvicorn."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.certfile, self.keyfile)
        if self.ca_certs is not None:
            context.load_verify_locations(self.ca_certs)
