"""This machine's hardware profile for the scheduler: where ``alisa profile`` saves it, and the
rough defaults used until it has run."""

from __future__ import annotations

import platform
from pathlib import Path

import psutil
import torch

from alisa.model.loading import cache_root
from scheduler import HardwareProfile, load_profile


def default_profile_path(device: torch.device) -> Path:
    """Where ``alisa profile`` saves this machine's profile for a device type."""
    return cache_root() / f"profile-{platform.node() or 'host'}-{device.type}.json"


def cpu_model() -> str:
    """This machine's CPU model name (recorded in a measured profile, checked by the plan)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # Linux: platform.processor() is often empty or just "x86_64"
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def machine_profile(device: torch.device, path: str | None = None) -> HardwareProfile:
    """The measured profile if there is one (``alisa profile``), else rough defaults.

    The defaults (noted in the name) only steer the host-versus-recompute choice; byte budgets
    are always exact.
    """
    chosen = Path(path).expanduser() if path else default_profile_path(device)
    if path or chosen.is_file():
        return load_profile(chosen)
    memory = psutil.virtual_memory()
    return HardwareProfile(
        name=f"{device.type} (defaults, not measured: run `alisa profile`)",
        device_bytes=memory.total,
        host_bytes=memory.available,
        h2d_bytes_per_s=5e9,
        d2h_bytes_per_s=5e9,
        device_flops=5e10,
        device_bytes_per_s=1e10,
        overlap=device.type == "cuda",
        device_type=device.type,
        cpu_model=cpu_model(),
    )
