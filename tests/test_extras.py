"""experiments.extras: the bench extra's modules, and the error when one is missing."""

import sys

import pytest

from experiments.extras import INSTALL, bench_module, pyplot


@pytest.mark.parametrize("name", ["matplotlib", "scipy.stats", "rouge_score.rouge_scorer"])
def test_a_missing_bench_package_is_named_with_the_extra(name, monkeypatch):
    top = name.split(".")[0]
    if name != top:  # a submodule imported before is found without its package
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, top, None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"is not installed: .*bench extra") as error:
        bench_module(name)
    assert INSTALL in str(error.value) and name in str(error.value)


def test_a_module_missing_inside_an_installed_package_is_not_blamed_on_the_extra(
    tmp_path, monkeypatch
):
    (tmp_path / "half_installed.py").write_text("import no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="No module named 'no_such_module_here'"):
        bench_module("half_installed")


def test_installed_modules_are_returned():
    assert bench_module("scipy.stats").spearmanr is not None
    plt = pyplot()
    assert plt.get_backend().lower() == "agg"
