"""`jaxspec serve`'s settings: `ServeConfig` (jaxspec/configs/serving.yaml and `--config` files use
its keys), how they load, and the check of a configured TLS key pair."""

from __future__ import annotations

import dataclasses
import ipaddress
import ssl
from pathlib import Path
from typing import Any

import yaml

from jaxspec.config_file import check_fields
from jaxspec.engine.args import EngineArgs
from jaxspec.resources import config_file

DEFAULT_CONFIG = config_file("serving.yaml")
TRANSPORT_LIMIT_FACTOR = 2  # gRPC's message limit is this × max_message_bytes: the guard answers in between


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Everything `jaxspec serve` takes; jaxspec/configs/serving.yaml and `--config` files use these keys.

    model / proposer / draft / policy / menu / tokenizer / dtype / mesh / kernels:  as for every engine command
        (jaxspec.engine.args.EngineArgs, which `engine_args()` returns); policy None = goodput with a
        proposer, else none; menu: a jaxspec/configs/engine.yaml name or a YAML path; tokenizer: 'model' (the
        model's own), or a toy one for random-weight presets: 'ascii', 'bytes'; dtype: 'auto' (float32 on
        CPU, bfloat16 on GPU/TPU), 'float32', 'bfloat16'; mesh: 'data=D,model=M' (None: the menu's, else 1,1);
        tree: a token-tree envelope 'N[:D]' for the ngram proposer (None: chains only); kernels: 'auto' or
        'xla' (None: $JAXSPEC_KERNELS, else auto); no_overlap: the synchronous scheduler loop (`--no-overlap`);
        num_pages, no_prefix_cache: the paged KV cache's pages and prefix sharing (`--num-pages`, `--no-prefix-cache`);
        logprobs: N > 0 lets requests ask for log-probabilities (at most N top alternatives), 0 = off
    host:               the address gRPC and HTTP bind; off loopback, plain text (no tls_cert) needs allow_plaintext
    port:               gRPC (jaxspec.v1.Generation); 0 = off
    metrics_port:       None = no metrics endpoint; 0 = an ephemeral port
    metrics_host:       the address /metrics binds (no auth, no TLS: loopback unless set)
    http_port:          the OpenAI-compatible HTTP API (jaxspec.serving.openai_api); None or 0 = off. At least one of
        port and http_port is on
    allow_plaintext:    serve without TLS on an address other than loopback (prompts, outputs and the
        bearer token then cross the network in clear)
    max_tokens_limit:   the largest max_tokens a request may ask for; default_max_tokens when it asks none
    max_queue:          requests waiting for a slot before calls get RESOURCE_EXHAUSTED
    max_running:        requests in slots at once (None: the largest batch bucket)
    max_stop_strings / max_stop_chars / max_message_bytes:  request size limits (a request message
        over max_message_bytes gets INVALID_ARGUMENT; gRPC itself refuses one over twice that)
    request_timeout_s:  a call's request message must arrive within this many seconds, else the
        call is cancelled (half-open calls must not hold threads)
    max_pending_calls:  calls (health checks excluded) waiting for their request message at once;
        more get RESOURCE_EXHAUSTED at once
    max_pending_calls_per_peer:  the same, per client connection, once its oldest waiting call has waited 0.5 s
        (a connection never holds more than half of max_pending_calls)
    drain_timeout_s:    how long SIGTERM waits for in-flight requests
    tls_cert, tls_key:  PEM files (both or neither); auth_token: required bearer token (None: no auth)
    """

    model: str | None = None
    proposer: str = "none"
    draft: str | None = None
    policy: str | None = None
    menu: str = "default"
    tokenizer: str = "model"
    dtype: str = "auto"
    mesh: str | None = None
    tree: str | None = None
    kernels: str | None = None
    no_overlap: bool = False
    logprobs: int = 0
    num_pages: int | None = None
    no_prefix_cache: bool = False
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    http_port: int | None = None
    metrics_host: str = "127.0.0.1"
    allow_plaintext: bool = False
    max_tokens_limit: int = 1024
    default_max_tokens: int = 128
    max_queue: int = 256
    max_running: int | None = None
    max_stop_strings: int = 8
    max_stop_chars: int = 256
    max_message_bytes: int = 1 << 20
    request_timeout_s: float = 5.0
    max_pending_calls: int = 64
    max_pending_calls_per_peer: int = 8
    drain_timeout_s: float = 120.0
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None

    def __post_init__(self):
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        if self.port == 0 and not self.http_port:
            raise ValueError("both servers are off (port 0 and no http_port): turn on gRPC (port) or HTTP (http_port)")
        for name in ("max_tokens_limit", "default_max_tokens", "max_queue", "max_stop_chars", "max_message_bytes",
                     "max_pending_calls", "max_pending_calls_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_stop_strings < 0:
            raise ValueError(f"max_stop_strings must be >= 0, got {self.max_stop_strings}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} exceeds "
                             f"max_tokens_limit={self.max_tokens_limit}")
        for name in ("drain_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key (or neither)")
        if self.tls_cert is None and not self.allow_plaintext and not is_loopback(self.host):
            raise ValueError(f"host {self.host!r} is not a loopback address and there is no TLS: prompts, outputs "
                             f"and the bearer token would cross the network in clear. Give tls_cert and tls_key "
                             f"(--tls-cert/--tls-key), or set allow_plaintext (--allow-plaintext) to accept that")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must be non-empty when set")
        if self.max_message_bytes * TRANSPORT_LIMIT_FACTOR >= 1 << 31:
            raise ValueError(f"max_message_bytes must be < {(1 << 31) // TRANSPORT_LIMIT_FACTOR}, "
                             f"got {self.max_message_bytes}")

    def engine_args(self) -> EngineArgs:
        """The engine this config names (ValueError for a bad proposer, tokenizer or policy)."""
        return EngineArgs(model=self.model, proposer=self.proposer, draft=self.draft, policy=self.policy,
                          menu=self.menu, tokenizer=self.tokenizer, dtype=self.dtype, mesh=self.mesh,
                          tree=self.tree, kernels=self.kernels, no_overlap=self.no_overlap, logprobs=self.logprobs,
                          num_pages=self.num_pages, no_prefix_cache=self.no_prefix_cache)


def load_serve_config(path: str | Path | None = None, **overrides) -> ServeConfig:
    """ServeConfig defaults <- the YAML file at `path` <- `overrides` that are not None."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"serving config {path} does not exist")
        values.update(check_fields(ServeConfig, yaml.safe_load(path.read_text()) or {}, path))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ServeConfig(**values)


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine: 'localhost' or a loopback IP (127.0.0.0/8, ::1). A
    wildcard ('0.0.0.0', '::', '') or any other name is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_tls_pair(cert: str | Path, key: str | Path) -> None:
    """Raise ValueError unless `key` is the unencrypted PEM private key of the PEM certificate chain
    `cert` (gRPC would only say that it cannot bind); FileNotFoundError for a missing file."""
    for path, marker, what in ((cert, b"-----BEGIN CERTIFICATE-----", "certificate"),
                               (key, b"PRIVATE KEY-----", "private key")):
        if not Path(path).is_file():
            raise FileNotFoundError(f"TLS file {path} does not exist")
        if marker not in Path(path).read_bytes():
            raise ValueError(f"TLS file {path} holds no PEM {what}")

    def encrypted() -> bytes:
        raise ValueError(f"TLS key {key} is encrypted; gRPC needs an unencrypted PEM key")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(cert), str(key), password=encrypted)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"TLS key {key} does not match the certificate {cert}") from None
        raise ValueError(f"cannot load the TLS certificate {cert} with key {key}: {exc.reason or exc}") from None


__all__ = ["DEFAULT_CONFIG", "TRANSPORT_LIMIT_FACTOR", "ServeConfig", "check_tls_pair", "is_loopback",
           "load_serve_config"]
