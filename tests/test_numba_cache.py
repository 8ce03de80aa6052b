"""numba's disk cache keyed by a digest of every kernel source (alisa.ops.numba_cache)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from alisa.ops.numba_cache import PACKAGE, kernel, kernel_digest, kernel_sources


def _copy(tmp_path):
    copy = tmp_path / "alisa"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_an_edited_kernel_source_changes_the_digest(tmp_path):
    """Editing a row function that another kernel calls gives another digest (the stale case
    of numba issue 1833); a file without kernels leaves it as it was."""
    copy = _copy(tmp_path)
    assert kernel_digest(copy) == kernel_digest(PACKAGE)
    names = {path.relative_to(copy).as_posix() for path in kernel_sources(copy)}
    assert "ops/cpu.py" in names
    plain = copy / "sizes.py"
    assert b"numba" not in plain.read_bytes()
    plain.write_text(plain.read_text() + "\n# a comment\n")
    assert kernel_digest(copy) == kernel_digest(PACKAGE)
    edited = copy / "ops" / "cpu.py"
    edited.write_text(edited.read_text().replace("return", "return ", 1))
    assert kernel_digest(copy) != kernel_digest(PACKAGE)


def test_a_new_kernel_module_joins_the_digest(tmp_path):
    copy = _copy(tmp_path)
    (copy / "ops" / "extra.py").write_text("import numba\n")
    assert kernel_digest(copy) != kernel_digest(PACKAGE)


PROBE = """
import json, sys
from alisa.ops.cpu import _probe
from alisa.ops.numba_cache import cache_dir
import numpy as np
_probe(np.zeros(2))
print(json.dumps({"dir": str(cache_dir()), "hits": sum(_probe.stats.cache_hits.values())}))
"""


def _probe_run(cache_root) -> dict:
    env = {**os.environ, "ALISA_CACHE_DIR": str(cache_root)}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.splitlines()[-1])


def test_kernels_are_cached_under_the_digest_and_loaded_from_there(tmp_path):
    """A fresh process compiles into ``ALISA_CACHE_DIR/numba/<digest>``; the next one loads it."""
    first = _probe_run(tmp_path)
    assert first["dir"] == str(tmp_path / "numba" / kernel_digest(PACKAGE))
    assert first["hits"] == 0
    assert list((tmp_path / "numba" / kernel_digest(PACKAGE)).rglob("*.nbi"))
    assert _probe_run(tmp_path)["hits"] == 1


def test_a_kernel_always_caches_under_the_digest():
    with pytest.raises(ValueError, match="cache"):
        kernel(cache=True)
