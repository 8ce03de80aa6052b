"""The default thread count: usable CPUs (affinity, cgroup quota) less the load of other work."""

import os

import pytest

from alisa import threads
from alisa.threads import ThreadChoice, choose_threads, usable_cpus


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A fake machine: ``set(cpus, load, quota)``; quota is cgroup v2 text or None."""

    def configure(cpus: int, load: float, quota: str | None = None) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
        path = tmp_path / "cpu.max"
        if quota is not None:
            path.write_text(quota + "\n")
        monkeypatch.setattr(threads, "CGROUP_V2_QUOTA", path)
        monkeypatch.setattr(threads, "CGROUP_V1_QUOTA", tmp_path / "absent")

    return configure


def test_idle_machine_uses_every_usable_cpu(machine):
    machine(cpus=4, load=0.2)
    choice = choose_threads(None, environ={})
    assert choice.threads == 4 and choice.warning() is None


def test_busy_machine_leaves_the_busy_cpus_and_warns_when_nothing_is_idle(machine):
    machine(cpus=2, load=1.1)
    assert choose_threads(None, environ={}).threads == 1
    machine(cpus=2, load=3.0)
    choice = choose_threads(None, environ={})
    assert choice.threads == 1
    assert "oversubscribed" in choice.warning() and "load of 3.0" in choice.warning()


def test_cgroup_quota_caps_the_affinity(machine):
    machine(cpus=8, load=0.0, quota="150000 100000")  # 1.5 CPUs' worth of time
    assert usable_cpus() == 2
    machine(cpus=8, load=0.0, quota="max 100000")
    assert usable_cpus() == 8
    machine(cpus=8, load=0.0, quota="garbage")
    assert usable_cpus() == 8


def test_requested_and_environment_win_over_the_default(machine):
    machine(cpus=2, load=0.0)
    assert choose_threads(3, environ={}).threads == 3
    assert "lower --threads" in choose_threads(3, environ={}).warning()
    assert choose_threads(None, environ={"OMP_NUM_THREADS": "1"}).threads == 1
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='two'"):
        choose_threads(None, environ={"OMP_NUM_THREADS": "two"})
    with pytest.raises(ValueError, match="threads=0"):
        choose_threads(0, environ={})


def test_torchrun_processes_share_the_idle_cpus(machine):
    machine(cpus=8, load=0.0)
    assert choose_threads(None, environ={"LOCAL_WORLD_SIZE": "4"}).threads == 2
    assert choose_threads(None, environ={"LOCAL_WORLD_SIZE": "16"}).threads == 1


def test_oversubscription_counts_this_commands_threads():
    assert not ThreadChoice(threads=2, usable_cpus=2, load=0.0).oversubscribed
    assert ThreadChoice(threads=2, usable_cpus=2, load=1.0).oversubscribed
