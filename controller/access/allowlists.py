"""What a RolloutJob may point the cluster at: LLM backend URLs and the tokenizer path.

Applied by the API to every created or applied job (`kube/validate.py`) and to backends added
while a job runs (`http/trainer.py`, `rolloutctl backends add|remove`). The lists are the controller's settings'
(`ControllerSettings.backend_allow_nets`, `.tokenizer_roots`), held by one `AllowLists` the API is built with.

- backend URL: http/https with a host; a literal address must not be link-local (169.254/16 holds
  cloud metadata services, fe80::/10), unspecified (0.0.0.0, ::), multicast or broadcast, unless
  an allowed network contains it; the cloud metadata host names are refused too. Host names are
  not resolved here (that would not stop DNS rebinding): egress firewalls remain the real fence.
- tokenizer: an absolute path under one of the tokenizer roots (tokenizers load offline only: a model hub
  name is refused, as is a relative path, which would depend on the daemon's working directory).
"""
from __future__ import annotations

import ipaddress
import os
import posixpath
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from rolloutd.crds.kit.paths import models_dir
from rolloutd.crds.kit.settings import ControllerSettings, Networks


def tokenizer_roots(home: Path, extra: tuple[Path, ...] = ()) -> tuple[str, ...]:
    """Directories an absolute `llm.tokenizer` may be under: `extra` ($ROLLOUTD_TOKENIZER_ROOTS) added to
    rolloutd's models dir (`$ROLLOUTD_HOME/models`) and the Hugging Face cache."""
    hf = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    return tuple(os.path.normpath(str(p)) for p in (models_dir(home), hf, *extra))


@dataclass(frozen=True)
class AllowLists:
    """The controller's lists: `backend_nets` a backend URL's literal address may be in although the default
    policy refuses them (link-local, unspecified…); `tokenizer_roots` a tokenizer path must be under."""

    backend_nets: Networks = ()
    tokenizer_roots: tuple[str, ...] = field(default_factory=lambda: tokenizer_roots(ControllerSettings().home))

    @classmethod
    def of(cls, settings: ControllerSettings) -> "AllowLists":
        return cls(settings.backend_allow_nets, tokenizer_roots(settings.home, settings.tokenizer_roots))


METADATA_HOSTS = {"metadata", "metadata.google.internal", "metadata.goog", "instance-data",
                  "instance-data.ec2.internal", "metadata.azure.com"}


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The literal address `host` denotes, in any form a resolver accepts (also 2852039166, 0xa9.0xfe.…)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(host))  # the legacy forms getaddrinfo takes
        except (OSError, ValueError):  # ValueError: a NUL in it
            return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def backend_url_problem(url: str, allow: AllowLists | None = None) -> str | None:
    """Why `url` may not be a backend, or None when it may (`allow`: the controller's lists; None: the defaults)."""
    allow = allow or AllowLists()
    if any(c <= " " or c == "\x7f" for c in url):  # no URL holds one; a NUL in the host was a 500 (inet_aton)
        return "not a valid URL: it holds a space or a control character"
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").rstrip(".").lower()
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as e:
        return f"not a valid URL: {e}"
    if parts.scheme not in ("http", "https"):
        return "must start with http:// or https://"
    if not host:
        return "has no host"
    if host in METADATA_HOSTS:
        return f"{host} is a cloud metadata service"
    ip = _address(host)
    if ip is None or any(ip in net for net in allow.backend_nets):
        return None
    if ip.is_link_local:
        return f"{ip} is link-local (cloud metadata services live there); allow it with ROLLOUTD_BACKEND_ALLOW_NETS"
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        return f"{ip} is not a unicast address a backend can have"
    return None


def tokenizer_problem(path: str, allow: AllowLists | None = None) -> str | None:
    """Why `path` may not be a tokenizer, or None when it may (`allow`: the controller's lists; None: the defaults)."""
    allow = allow or AllowLists()
    if not path.strip():
        return "must name a tokenizer directory or model"
    if "\x00" in path:
        return "contains a NUL byte"
    if path.startswith("~"):
        return "must not start with ~ (the daemon's home is not the controller's): give an absolute path"
    if not path.startswith("/"):
        return (f"{path!r} is not a tokenizer directory: no such directory beside the job file, and no model "
                "rolloutd prepared by that name (`rolloutctl apply -f FILE` and the client's `apply(FILE)` look for "
                "both; the API itself takes an absolute path only). Tokenizers load offline only, so a model hub "
                "name cannot load: give the directory holding tokenizer.json")
    normal = posixpath.normpath(path)
    roots = allow.tokenizer_roots
    if any(normal == r or normal.startswith(r.rstrip("/") + "/") for r in roots):
        return None
    return (f"{normal} is outside the tokenizer roots ({os.pathsep.join(roots) or 'none'}); "
            "add its directory to ROLLOUTD_TOKENIZER_ROOTS")
