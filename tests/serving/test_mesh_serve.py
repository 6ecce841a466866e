"""`jaxspec serve --mesh data=1,model=3` on the real default model (SmolLM2-135M: 9 query heads, 3 kv
heads, tensor parallel over 3 forced host devices) answers a gRPC request with the same text as the
unsharded server. Correctness only: forced host devices share the same cores."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jaxspec.serving.client import GenerationClient
from tests.serving.conftest import HOST, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
MENU = "num_slots: 2\nmax_len: 256\nbatch_buckets: [1]\nk_menu: [0]\nwindow_buckets: [256]\nprefill_buckets: [64]\n"


def _serve_and_ask(menu: Path, *mesh_flags: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.Popen([sys.executable, "-m", "jaxspec.cli", "serve", "--menu", str(menu), "--proposer", "none",
                             "--policy", "none", "--host", HOST, "--port", str(free_port()), *mesh_flags],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    try:
        wait_until(lambda: any(" on 127.0.0.1:" in line for line in lines) or proc.poll() is not None,
                   timeout=600, what="the server to start")
        assert proc.poll() is None, "".join(lines)
        port = int(re.search(r"jaxspec serve: \S+ on [\d.]+:(\d+)", "".join(lines)).group(1))
        client = GenerationClient(f"{HOST}:{port}")
        wait_until(lambda: client.health() == "SERVING", timeout=600, what="warm-up")
        if mesh_flags:  # the server says which mesh it built
            assert any(line.startswith("mesh data=1,model=3: 3 cpu devices") for line in lines), "".join(lines)
        responses = list(client.generate(messages=[("user", "Name three primary colours.")], max_tokens=24,
                                         timeout=300))
        return "".join(r.text for r in responses)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.slow
def test_sharded_server_answers_like_the_unsharded_one(tmp_path):
    menu = tmp_path / "menu.yaml"
    menu.write_text(MENU)
    unsharded = _serve_and_ask(menu)
    sharded = _serve_and_ask(menu, "--mesh", "data=1,model=3")
    assert unsharded.strip(), "the unsharded server produced no text"
    assert sharded == unsharded
