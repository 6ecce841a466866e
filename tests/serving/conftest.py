"""Shared pieces of the serving tests: fake and tiny engines, a step gate, servers on free ports.

Most server tests run on `jaxspec.engine.fake.FakeEngine` (the engine contract without XLA: next token =
previous + 1 mod 64, the first `accept` proposals right); a few end-to-end ones use the real tiny engine."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from jaxspec.engine.api import EngineAPI
from jaxspec.engine.engine import Engine
from jaxspec.engine.fake import FakeEngine
from jaxspec.menu import Menu
from jaxspec.policy.acceptance import AcceptanceTracker
from jaxspec.policy.cost_model import OnlineCostConfig
from jaxspec.policy.goodput import GoodputPolicy
from jaxspec.serving.client import GenerationClient
from jaxspec.serving.serve_config import ServeConfig
from jaxspec.serving.service import GenerationServer
from tests.conftest import wait_until  # noqa: F401 - the serving tests import it from here
from tests.policy.sim import linear_cost, synthetic_cost_model

HOST = "127.0.0.1"


def small_menu(*, slots: int = 8, k_menu=(0,), max_len: int = 128) -> Menu:
    """One batch bucket (= slots), one window, one prefill chunk: few shapes to compile."""
    return Menu(num_slots=slots, max_len=max_len, batch_buckets=(slots,), k_menu=k_menu, window_buckets=(max_len,),
                prefill_buckets=(32,))


def tiny_engine(model, proposer=None, *, slots: int = 8, k_menu=(0,), max_len: int = 128) -> Engine:
    """The real engine over `model` on a small menu, warmed up."""
    engine = Engine(model, proposer, small_menu(slots=slots, k_menu=k_menu, max_len=max_len))
    engine.warmup(progress=False)
    return engine


def fake_engine(*, slots: int = 8, k_menu=(0,), max_len: int = 128, accept: int = 0) -> FakeEngine:
    """A FakeEngine with the ascii tokenizer's 64 ids on a small menu, warmed up (nothing compiles)."""
    engine = FakeEngine(small_menu(slots=slots, k_menu=k_menu, max_len=max_len), vocab_size=64, accept=accept,
                        proposer_name=f"fake(accept={accept})")
    engine.warmup(progress=False)
    return engine


def all_slots_free(engine: EngineAPI) -> bool:
    """No slot holds a token (every request's slot was freed)."""
    return all(engine.length(slot) == 0 for slot in range(engine.menu.num_slots))


def synthetic_goodput(engine: EngineAPI) -> GoodputPolicy:
    """SmartSpec over synthetic step costs (no online correction): speculates, deterministically."""
    c = engine.menu
    cost = synthetic_cost_model(linear_cost(), c.batch_buckets, c.k_menu, c.window_buckets,
                                online=OnlineCostConfig(ema_weight=0.0))
    return GoodputPolicy(cost, AcceptanceTracker())


class StepGate:
    """Holds the engine thread at the start of each step's dispatch (`engine.dispatch_step`) while closed (tests of
    timing-dependent paths)."""

    def __init__(self, engine: EngineAPI):
        self._open = threading.Event()
        self._open.set()
        self.blocked = threading.Event()  # the engine thread is waiting at the gate
        dispatch = engine.dispatch_step

        def gated(*args, **kwargs):
            if not self._open.is_set():
                self.blocked.set()
                self._open.wait()
                self.blocked.clear()
            return dispatch(*args, **kwargs)

        engine.dispatch_step = gated

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()


def free_port(host: str = HOST) -> int:
    """A TCP port free on `host` now (the kernel's pick; port 0 turns a server off, so tests name ports)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_server(engine, tokenizer, policy, **config) -> GenerationServer:
    return GenerationServer(engine, tokenizer, policy, ServeConfig(host=HOST, port=free_port(), **config),
                            model_name="tiny").start()


def client_for(server: GenerationServer, **kwargs) -> GenerationClient:
    return GenerationClient(f"{HOST}:{server.port}", **kwargs)


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for 127.0.0.1 / localhost, with `cryptography` or the openssl CLI; skips without both."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    try:
        import cryptography  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("needs the `cryptography` package or the `openssl` CLI to make a test certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                       check=True, capture_output=True, timeout=60)
        return cert, key
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                               x509.DNSName("localhost")]), critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(private, hashes.SHA256()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return cert, key
