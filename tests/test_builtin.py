"""Built-in models on fake packages: chunks assembled once, checked by SHA-256, never imported."""

import hashlib
import json

import pytest

from alisa.model import builtin
from alisa.model.builtin import BUILTIN_MODELS, BuiltinModel, assemble_chunks, locate_builtin_gguf
from alisa.model.loading import resolve_model_path

CHUNKS = [b"GGUF" + bytes(range(200)), b"middle" * 50, b"tail"]
DIGEST = hashlib.sha256(b"".join(CHUNKS)).hexdigest()


def write_parts(folder, chunks=CHUNKS):
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    for index, data in enumerate(chunks):
        part = folder / f"model.gguf.part{index:02d}"
        part.write_bytes(data)
        parts.append(part)
    return parts


def test_chunks_are_concatenated_in_order_and_verified(tmp_path):
    target = tmp_path / "cache" / "gguf" / "model.gguf"
    assert assemble_chunks(write_parts(tmp_path / "parts"), target, DIGEST) == target
    assert target.read_bytes() == b"".join(CHUNKS)
    assert [path.name for path in target.parent.iterdir()] == ["model.gguf"]


def test_assembly_happens_once(tmp_path):
    parts = write_parts(tmp_path / "parts")
    target = assemble_chunks(parts, tmp_path / "model.gguf", DIGEST)
    for part in parts:
        part.unlink()
    assert assemble_chunks(parts, target, DIGEST) == target
    assert target.read_bytes() == b"".join(CHUNKS)


def test_digest_mismatch_names_the_file_and_leaves_nothing(tmp_path):
    parts = write_parts(tmp_path / "parts", [CHUNKS[0], b"corrupt", CHUNKS[2]])
    target = tmp_path / "cache" / "model.gguf"
    with pytest.raises(ValueError) as error:
        assemble_chunks(parts, target, DIGEST)
    message = str(error.value)
    assert "model.gguf" in message and DIGEST in message and "sha256=" in message
    assert list(target.parent.iterdir()) == []


def test_missing_chunk_is_named(tmp_path):
    parts = write_parts(tmp_path / "parts")
    parts[1].unlink()
    with pytest.raises(ValueError, match="model.gguf.part01"):
        assemble_chunks(parts, tmp_path / "model.gguf", DIGEST)
    assert not (tmp_path / "model.gguf").exists()


def test_chunked_model_needs_a_digest():
    with pytest.raises(ValueError, match="sha256=None"):
        BuiltinModel(package="p", gguf_name="m.gguf", install="x", chunks=(("p", "m.part00"),))


def fake_packages(root, names, chunks=CHUNKS):
    """Packages whose ``__init__`` raises: locating them must not import them."""
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text("raise ImportError('never import me')\n")
    for index, data in enumerate(chunks):
        (root / names[index + 1] / "data").mkdir()
        (root / names[index + 1] / "data" / f"m.gguf.part{index:02d}").write_bytes(data)


def fake_model(prefix):
    return BuiltinModel(
        package=f"{prefix}_main",
        gguf_name="m.gguf",
        install="make fake",
        chunks=tuple((f"{prefix}_part{i + 1}", f"data/m.gguf.part{i:02d}") for i in range(3)),
        sha256=DIGEST,
    )


def test_builtin_chunks_are_found_without_importing_and_assembled_into_the_cache(
    tmp_path, monkeypatch
):
    names = ["alisa_fake_main", *(f"alisa_fake_part{i + 1}" for i in range(3))]
    fake_packages(tmp_path / "site", names)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(BUILTIN_MODELS, "fake-model", fake_model("alisa_fake"))
    path = locate_builtin_gguf("fake-model", tmp_path / "cache")
    assert path == tmp_path / "cache" / "gguf" / "m.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)


def test_missing_chunk_package_error_names_it_and_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(BUILTIN_MODELS, "fake-model", fake_model("alisa_absent"))
    monkeypatch.setenv("ALISA_CACHE_DIR", str(tmp_path))
    assert locate_builtin_gguf("fake-model", tmp_path) is None
    with pytest.raises(ValueError) as error:
        resolve_model_path("fake-model")
    message = str(error.value)
    assert "alisa-absent-part2" in message and "make fake" in message


def test_gemma_entry_pins_every_package_it_needs():
    gemma = BUILTIN_MODELS["gemma3-270m"]
    assert len(gemma.chunks) == 4 and len(gemma.sha256) == 64
    for package in gemma.packages:
        assert f"{package.replace('_', '-')}==1.0.0" in gemma.install
    assert "make gemma" in gemma.install
    assert builtin.package_dir("alisa_surely_not_installed") is None


def test_copies_of_one_gguf_share_one_conversion_and_an_edit_does_not(tmp_path, monkeypatch):
    """Each clone's or virtual environment's copy of a built-in GGUF was converted again (538 MB
    each, keyed by its path and mtime): the conversion is named by the bytes, read once per
    (path, size, mtime)."""
    from alisa.model import loading

    monkeypatch.setenv("ALISA_CACHE_DIR", str(tmp_path / "cache"))
    first, second, edited = (tmp_path / name / "model.gguf" for name in ("a", "b", "c"))
    for path, data in ((first, b"GGUF" * 1000), (second, b"GGUF" * 1000), (edited, b"GGUX" * 1000)):
        path.parent.mkdir()
        path.write_bytes(data)
    shared = loading.gguf_cache_dir(first)
    assert loading.gguf_cache_dir(second) == shared and shared.parent == tmp_path / "cache/models"
    assert loading.gguf_cache_dir(edited) != shared  # same size and name, other bytes
    index = json.loads((tmp_path / "cache/models/digests.json").read_text())
    assert len(index) == 3  # one digest per (path, size, mtime), kept for the next load
    monkeypatch.setattr(loading.hashlib, "sha256", None)  # a known file is not read again
    assert loading.gguf_cache_dir(first) == shared
