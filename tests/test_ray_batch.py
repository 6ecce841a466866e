"""`jaxspec batch --ray` on a local Ray (2 CPUs) with the tiny model: the same records as `jaxspec batch`,
in input order; a replica killed mid-run (ray.kill) and a driver killed with kill -9 then rerun still give
every id exactly once and the same output; engine failures are error records; bad flags are one line."""

from __future__ import annotations

import collections
import functools
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from jaxspec import cli  # noqa: E402
from jaxspec.engine.args import EngineArgs  # noqa: E402
from jaxspec.serving import ray_batch  # noqa: E402
from jaxspec.serving.batch_job import BatchJobError  # noqa: E402
from jaxspec.serving.ray_batch import RayBatchConfig, run_ray_batch  # noqa: E402
from tests import ray_batch_entry  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--tokenizer", "ascii", "--menu", "tiny", "--policy", "none"]
ENGINE_ARGS = EngineArgs(model="tiny", tokenizer="ascii", menu="tiny", policy="none")
# the only fields that differ between two runs: timings, and what the prefix cache served (it depends on which
# requests ran before on the same replica)
TIMINGS = ("queued_s", "ttft_s", "tpot_s", "total_s", "cached_prompt_tokens")
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jam".split()


def make_input(path: Path, n: int = 40) -> None:
    """n good lines (every fifth sampled with a seed), a chat line, malformed lines, a duplicate id,
    a prompt too long for the cache."""
    lines = []
    for i in range(n):
        words = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(1 + i % 6))
        record = {"id": f"q{i}", "prompt": words, "max_tokens": 6 + i % 9}
        if i % 5 == 1:
            record.update(temperature=0.8, seed=100 + i)
        lines.append(json.dumps(record))
    lines[3] = json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 7})
    lines.insert(5, '{"id": "broken", "prompt": ')
    lines.insert(9, '{"prompt": "no id"}')
    lines.insert(12, json.dumps({"id": "q0", "prompt": "duplicate of q0"}))
    lines.insert(20, json.dumps({"id": "long", "prompt": "a" * 200}))
    lines.insert(21, "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def untimed(line: str) -> str:
    record = json.loads(line)
    if record["stats"] is not None:
        record["stats"].update({name: None for name in TIMINGS})
    return json.dumps(record, ensure_ascii=False)


def in_input_order(plain: Path, inp: Path) -> list[str]:
    """The plain job's record lines (written as requests finish) sorted into input order."""
    order = {}
    for number, line in enumerate(inp.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                obj = json.loads(line)
                key = json.dumps(obj["id"]) if isinstance(obj, dict) and "id" in obj else ("line", number)
            except ValueError:
                key = ("line", number)
            order.setdefault(key, number)

    def position(line: str):
        r = json.loads(line)
        return order[json.dumps(r["id"]) if r["id"] is not None else ("line", r["line"])]

    return sorted(plain.read_text(encoding="utf-8").splitlines(), key=position)


def assert_each_once(lines: list[str]) -> None:
    keys = collections.Counter(json.dumps([r["id"], r["line"] if r["id"] is None else None])
                               for r in map(json.loads, lines))
    assert all(c == 1 for c in keys.values()), [k for k, c in keys.items() if c > 1]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray for the module; its workers import the repository (the tests' replica builders)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    for attempt in range(3):  # Ray waits a fixed 30 s for its raylet, which a loaded 2-core machine can miss
        try:
            ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
            break
        except Exception as exc:
            if ray_batch.RAY_STARTUP_TIMEOUT not in str(exc) or attempt == 2:
                raise
            ray.shutdown()
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The input and single-process `jaxspec batch`'s output on it."""
    d = tmp_path_factory.mktemp("ray")
    make_input(d / "in.jsonl")
    assert cli.main(["batch", "--input", str(d / "in.jsonl"), "--output", str(d / "plain.jsonl"), "--no-progress",
                     "--max-tokens", "10", *TINY]) == 1  # error records (malformed, too long) and a duplicate
    return d / "in.jsonl", in_input_order(d / "plain.jsonl", d / "in.jsonl")


def test_two_replicas_give_the_plain_jobs_records_in_input_order(cluster, reference, tmp_path, capsys):
    inp, plain = reference
    out = tmp_path / "out.jsonl"
    code = cli.main(["batch", "--ray", "--replicas", "2", "--block-lines", "7", "--input", str(inp), "--output",
                     str(out), "--max-tokens", "10", *TINY])
    err = capsys.readouterr().err
    assert code == 1, err
    got = out.read_text(encoding="utf-8").splitlines()
    assert_each_once(got)
    assert [untimed(line) for line in got] == [untimed(line) for line in plain]  # byte for byte, timings aside
    assert "replica 0: tiny / none" in err and "replica 1: tiny / none" in err
    assert "duplicate id 'q0'" in err and "1 duplicate ids" in err and "tok/s" in err
    assert not (tmp_path / "out.jsonl.blocks").exists()
    # a rerun of the finished job runs nothing and leaves the output as it is
    before = out.read_bytes()
    assert cli.main(["batch", "--ray", "--block-lines", "7", "--input", str(inp), "--output", str(out),
                     "--max-tokens", "10", "--no-progress", *TINY]) == 1  # still one duplicate id
    assert out.read_bytes() == before
    assert f"{len(got)} already done" in capsys.readouterr().err


def test_each_replica_runs_its_engine_on_a_mesh(cluster, reference, tmp_path, capsys):
    """`--mesh` applies to every replica: each actor shards its own engine over data=2, model=2 of its devices
    (the 8 forced host devices of tests/conftest.py, inherited by the local Ray's workers) and the records are
    still the single-device job's."""
    inp, plain = reference
    out = tmp_path / "out.jsonl"
    code = cli.main(["batch", "--ray", "--replicas", "1", "--block-lines", "16", "--mesh", "data=2,model=2",
                     "--input", str(inp), "--output", str(out), "--max-tokens", "10", "--no-progress", *TINY])
    err = capsys.readouterr().err
    assert code == 1, err
    got = out.read_text(encoding="utf-8").splitlines()
    assert [untimed(line) for line in got] == [untimed(line) for line in plain]
    assert "replica 0: tiny / none, mesh data=2,model=2" in err


def _replicas_of_this_process() -> list[str]:
    prefix = f"{ray_batch.ACTOR_NAME}-{os.getpid()}-"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def test_a_replica_killed_mid_run_has_its_blocks_redone_elsewhere(cluster, reference, tmp_path):
    inp, plain = reference
    out, log = tmp_path / "out.jsonl", io.StringIO()
    build = functools.partial(ray_batch_entry.slow_replica, ENGINE_ARGS, 0.03)
    job = {}
    runner = threading.Thread(target=lambda: job.setdefault("summary", run_ray_batch(
        build, inp, out, config=RayBatchConfig(replicas=2, block_lines=4), defaults=_defaults(), progress=False,
        log=log)))
    runner.start()
    blocks = tmp_path / "out.jsonl.blocks"
    deadline = time.monotonic() + 120
    while not list(blocks.glob("block-*.jsonl")) and runner.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    names = _replicas_of_this_process()
    assert len(names) == 2 and runner.is_alive(), log.getvalue()
    ray.kill(ray.get_actor(names[0]))
    runner.join(timeout=120)
    assert not runner.is_alive() and "summary" in job, log.getvalue()
    got = out.read_text(encoding="utf-8").splitlines()
    assert_each_once(got)
    assert [untimed(line) for line in got] == [untimed(line) for line in plain]
    assert "replica 0 died" in log.getvalue()
    assert job["summary"].completed == sum(json.loads(line)["error"] is None for line in plain)


def _defaults():
    from jaxspec.types import SamplingParams

    return SamplingParams(max_tokens=10)


def test_driver_killed_with_kill_9_then_rerun(cluster, reference, tmp_path):
    inp, plain = reference
    out, blocks = tmp_path / "out.jsonl", tmp_path / "out.jsonl.blocks"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "tests.ray_batch_entry", "--ray", "--ray-address", cluster,
                             "--replicas", "2", "--block-lines", "4", "--input", str(inp), "--output", str(out),
                             "--max-tokens", "10", "--no-progress", "--step-delay", "0.03", *TINY],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(blocks.glob("block-*.jsonl"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"the driver ended before the kill: {err.decode()[-2000:]}"
    finished = sorted(blocks.glob("block-*.jsonl"))
    assert 2 <= len(finished) < 12
    for block in finished:  # whole blocks only: every line a record
        assert all(json.loads(line)["finish_reason"] for line in block.read_text(encoding="utf-8").splitlines())
    assert out.read_bytes() == b""  # the output is written once, when every block is done
    done_before = sum(len(b.read_text(encoding="utf-8").splitlines()) for b in finished)

    log = io.StringIO()
    summary = run_ray_batch(functools.partial(ray_batch.build_replica, ENGINE_ARGS), inp, out,
                            config=RayBatchConfig(replicas=2, block_lines=4), defaults=_defaults(), progress=False,
                            log=log)
    got = out.read_text(encoding="utf-8").splitlines()
    assert_each_once(got)
    assert [untimed(line) for line in got] == [untimed(line) for line in plain]
    assert summary.already_done >= done_before and not blocks.exists()


def test_a_request_failing_in_the_engine_is_an_error_record(cluster, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": 5}) + "\n"
                           for i, p in enumerate(["abc", "!boom", "xyz", "hello"])), encoding="utf-8")
    summary = run_ray_batch(ray_batch_entry.failing_fake_replica, inp, out,
                            config=RayBatchConfig(replicas=1, block_lines=2), progress=False, log=io.StringIO())
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == [0, 1, 2, 3]
    assert records[1]["finish_reason"] == "error" and "injected prefill failure" in records[1]["error"]
    assert all(r["error"] is None and len(r["token_ids"]) == 5 for r in records if r["id"] != 1)
    assert (summary.completed, summary.errors, summary.exit_code) == (3, 1, 1)


def test_clear_errors(cluster, reference, tmp_path, capsys):
    inp, _ = reference
    out = str(tmp_path / "o.jsonl")
    base = ["batch", "--input", str(inp), "--output", out, *TINY]
    assert cli.main([*base, "--replicas", "2"]) == 2
    assert "--replicas need --ray" in capsys.readouterr().err
    assert cli.main([*base, "--ray", "--replicas", "0"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err
    assert cli.main([*base, "--ray", "--ray-address", "127.0.0.1:1"]) == 2
    assert "no Ray cluster at 127.0.0.1:1" in capsys.readouterr().err
    assert cli.main([*base, "--ray", "--replicas", "3"]) == 2  # the local cluster has 2 CPUs
    assert "need 3 CPUs; the Ray cluster has 2" in capsys.readouterr().err
    # blocks of one job are not mixed with another input or block size
    out = str(tmp_path / "other.jsonl")
    base = ["batch", "--input", str(inp), "--output", out, *TINY]
    Path(out + ".blocks").mkdir()
    Path(out + ".blocks/job.json").write_text(json.dumps({"version": 1, "input_sha256": "0" * 64, "lines": 3,
                                                          "block_lines": 64}))
    assert cli.main([*base, "--ray"]) == 2
    assert "holds the blocks of another job" in capsys.readouterr().err
    # replicas that cannot build their engine: one line naming the cause
    with pytest.raises(BatchJobError, match=r"no replica could build its engine \(replica 0: .*no such model"):
        run_ray_batch(ray_batch_entry.broken_replica, inp, tmp_path / "b.jsonl", config=RayBatchConfig(replicas=1),
                      progress=False, log=io.StringIO())


def test_a_local_ray_that_does_not_start_is_one_clear_line(reference, tmp_path, monkeypatch, capsys):
    """Ray's bare startup-timeout Exception becomes a batch error naming the remedy, not a traceback."""
    inp, _ = reference

    def init_times_out(**_):
        raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init_times_out)
    assert cli.main(["batch", "--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--ray", *TINY]) == 2
    err = capsys.readouterr().err
    assert "the local Ray did not start" in err and "ray start --head" in err
    assert "Traceback" not in err
