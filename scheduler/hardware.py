"""Hardware profiles: capacities, link and compute rates, measured or from published figures."""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

GIB = 1024**3
OPTIONAL_RATES = (
    "step_overhead_s",
    "recompute_flops",
    "kv_bytes_per_s",
    "select_overhead_s",
    "decode_miss",
    "select_miss",
)
# 0 means "not measured" for OPTIONAL_RATES; these are None instead (0 would be a broken rate).
UNMEASURED = ("select_bytes_per_s", "decode_miss", "select_miss")
TEXT_FIELDS = ("name", "overlap", "simulated", "device_type", "cpu_model", "torch_version", "dtype")
FLAGS = ("overlap", "simulated")  # of the fields above, the booleans (a string would read true)
# Physical ceilings (bytes/s, FLOP/s): a measured rate above them is a broken measurement (a
# division by a time of about zero), never "infinitely fast". Any device: beyond HBM3e and
# tensor-core peaks with room to spare; a CPU: a few hundred GB/s of DRAM, tens of TFLOP/s.
BYTE_RATES = (
    "h2d_bytes_per_s",
    "d2h_bytes_per_s",
    "device_bytes_per_s",
    "kv_bytes_per_s",
    "select_bytes_per_s",
)
FLOP_RATES = ("device_flops", "recompute_flops")
CEILINGS = {"": (1e14, 1e17), "cpu": (1e12, 1e15)}


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One machine as the cost model sees it.

    Attributes
    ----------
    name
        Label printed with every plan.
    device_bytes, host_bytes
        Memory of the fast device (GPU; the model's pool on a CPU-only box) and of the host tier.
    h2d_bytes_per_s, d2h_bytes_per_s
        Host-to-device and device-to-host copy bandwidth.
    device_flops
        Dense matmul throughput on the device, FLOP/s.
    device_bytes_per_s
        Device memory bandwidth (decode is bound by reading weights and KV).
    overlap
        True when copies run beside compute (CUDA side streams): a step costs
        max(compute, transfer). False on a CPU-only box: compute + transfer.
    recompute_flops
        Effective FLOP/s of rebuilding K/V from stored inputs (small matmuls run below peak);
        0 means ``device_flops``.
    kv_bytes_per_s
        Effective rate at which decode attention reads KV (fitted by ``alisa profile``); 0 means
        ``device_bytes_per_s``.
    step_overhead_s
        Fixed time per decode step not explained by bytes and FLOPs (kernel launches, Python),
        fitted by ``alisa profile``; 0 for published presets.
    select_bytes_per_s
        ``retention="host"``: key-sketch bytes per second at which a selection chooses its
        tokens (scores every seen token's sketch, takes the top-k, frees and fills slots), fitted
        by ``alisa profile`` on real retention="host" steps that each select; a selection costs
        ``seen tokens * sketch bytes per token / select_bytes_per_s`` and comes once every
        ``Workload.reselect_every`` steps. None (presets, older profiles): the sketch is costed
        as read at ``kv_bytes_per_s``.
    select_overhead_s
        ``retention="host"``: fixed time per selection (its per-layer small ops), fitted with
        ``select_bytes_per_s``; 0 when not measured.
    simulated
        True for presets built from published figures rather than measured here.
    decode_miss, select_miss
        How well the calibration fits its own steps: the largest relative miss of the fitted
        decode step cost on the resident steps it was fitted to, and of the fitted selection
        cost on the ``retention="host"`` steps; None where not calibrated (presets, defaults,
        older profiles). A plan refuses a profile that misses by more than
        :data:`PLAN_TOLERANCE` (:func:`calibration_error`).
    device_type, cpu_model, torch_version, dtype
        Where a measured profile was taken (``"cpu"``/``"cuda"``, the CPU's model name, torch's
        version, the model dtype it was calibrated in); empty for presets and old profiles.
        ``device_type="cpu"`` tightens the physical bounds on the rates.
    """

    name: str
    device_bytes: int
    host_bytes: int
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    device_flops: float
    device_bytes_per_s: float
    overlap: bool = True
    step_overhead_s: float = 0.0
    recompute_flops: float = 0.0
    kv_bytes_per_s: float = 0.0
    select_bytes_per_s: float | None = None
    select_overhead_s: float = 0.0
    simulated: bool = False
    decode_miss: float | None = None
    select_miss: float | None = None
    device_type: str = ""
    cpu_model: str = ""
    torch_version: str = ""
    dtype: str = ""

    def __post_init__(self) -> None:
        bytes_ceiling, flops_ceiling = CEILINGS.get(self.device_type, CEILINGS[""])
        ceilings = {
            **dict.fromkeys(BYTE_RATES, bytes_ceiling),
            **dict.fromkeys(FLOP_RATES, flops_ceiling),
        }
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name in FLAGS and not isinstance(value, bool):
                raise ValueError(f"{item.name}={value!r} must be true or false")
            if item.name in TEXT_FIELDS and item.name not in FLAGS and not isinstance(value, str):
                raise ValueError(f"{item.name}={value!r} must be a string")
            if item.name in TEXT_FIELDS or (value is None and item.name in UNMEASURED):
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise ValueError(f"{item.name}={value!r} must be a finite number")
            if value < 0 or (value == 0 and item.name not in OPTIONAL_RATES):
                raise ValueError(f"{item.name}={value!r} must be positive")
            ceiling = ceilings.get(item.name)
            if ceiling is not None and value > ceiling:
                where = f"on {self.device_type}" if self.device_type else "on any device"
                raise ValueError(
                    f"{item.name}={value:.3g} is above the physical bound {ceiling:.0e} {where}: "
                    "a broken measurement (re-run `alisa profile`)"
                )

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


# The most a calibrated cost may miss its own steps by for a plan to be made from it (the cost
# model is to hold within 20 % of measured steps: issue 67).
PLAN_TOLERANCE = 0.2


def calibration_error(profile: HardwareProfile) -> str | None:
    """Why ``profile``'s calibration cannot be planned with, or None when it fits.

    A calibration whose fitted costs miss the very steps they were fitted to by more than
    :data:`PLAN_TOLERANCE` (a loaded machine, a kernel path the cost formulas do not describe)
    would plan from wrong times; the plan is refused instead, naming the miss.
    """
    misses = {
        "decode step (resident KV)": profile.decode_miss,
        "host selection (retention='host')": profile.select_miss,
    }
    off = {
        what: miss for what, miss in misses.items() if miss is not None and miss > PLAN_TOLERANCE
    }
    if not off:
        return None
    named = ", ".join(f"the {what} by {miss:.0%}" for what, miss in off.items())
    return (
        f"profile {profile.name!r}: its calibrated cost misses the steps it was measured on "
        f"({named}; a plan needs {PLAN_TOLERANCE:.0%}), so its plans would cost wrong times: "
        "re-run `alisa profile` on a quiet machine (nothing else running), or plan with "
        "--hardware"
    )


def mismatches(profile: HardwareProfile, cpu_model: str, dtype: str) -> list[str]:
    """Why a measured profile may not describe this run: another CPU or dtype, or no record.

    Presets (``simulated``) describe another machine by design and give none; an empty
    ``dtype`` (uncalibrated defaults) matches any.
    """
    if profile.simulated:
        return []
    if not profile.cpu_model:
        return [
            f"profile {profile.name!r} does not record its CPU and dtype (saved by an older "
            "alisa); re-run `alisa profile` for a calibrated cost model"
        ]
    notes = []
    if profile.cpu_model != cpu_model:
        notes.append(f"profile was measured on CPU {profile.cpu_model!r}, this is {cpu_model!r}")
    if profile.dtype and profile.dtype != dtype:
        notes.append(f"profile was calibrated in {profile.dtype}, the plan uses {dtype}")
    return notes


def load_profile(path: str | Path) -> HardwareProfile:
    """Read a profile written by ``alisa profile``; clear errors for a missing or bad file."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise ValueError(f"profile file {str(file)!r} is a directory; give the JSON file in it")
    if not file.is_file():
        raise ValueError(f"profile file {str(file)!r} does not exist (run `alisa profile` first)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"profile file {str(file)!r} cannot be read: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"profile file {str(file)!r} is not UTF-8 text (not a profile?)") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"profile file {str(file)!r} is not valid JSON: {error.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"profile file {str(file)!r} is not a JSON object")
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"profile file {str(file)!r} has unknown fields {unknown}")
    required = [f.name for f in fields(HardwareProfile) if f.default is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise ValueError(
            f"profile file {str(file)!r} lacks the field(s) {', '.join(missing)} (an incomplete "
            "or hand-edited file?); re-run `alisa profile` to write a whole one"
        )
    try:
        return HardwareProfile(**data)
    except ValueError as error:
        raise ValueError(f"profile file {str(file)!r}: {error}") from None


# Published figures (fp16 dense tensor-core throughput at a realistic 70 % of peak; HBM
# bandwidth; PCIe host link as ALISA and FlexGen measured it, 16-25 GB/s). Host: 128 GiB DRAM as
# ALISA's testbed.
PRESETS: dict[str, HardwareProfile] = {
    "v100-32gb": HardwareProfile(
        name="V100-32GB (published figures)",
        device_bytes=32 * GIB,
        host_bytes=128 * GIB,
        h2d_bytes_per_s=16e9,
        d2h_bytes_per_s=16e9,
        device_flops=0.7 * 125e12,
        device_bytes_per_s=900e9,
        simulated=True,
    ),
    "a100-40gb": HardwareProfile(
        name="A100-40GB (published figures)",
        device_bytes=40 * GIB,
        host_bytes=128 * GIB,
        h2d_bytes_per_s=25e9,
        d2h_bytes_per_s=25e9,
        device_flops=0.7 * 312e12,
        device_bytes_per_s=1555e9,
        simulated=True,
    ),
    "h100-80gb": HardwareProfile(
        name="H100-80GB (published figures)",
        device_bytes=80 * GIB,
        host_bytes=128 * GIB,
        h2d_bytes_per_s=25e9,
        d2h_bytes_per_s=25e9,
        device_flops=0.7 * 989e12,
        device_bytes_per_s=3350e9,
        simulated=True,
    ),
}


def preset(name: str) -> HardwareProfile:
    """A published-figures preset by name; the error lists the known names."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(
            f"hardware preset {name!r} is unknown; known: {', '.join(sorted(PRESETS))}"
        )
    return PRESETS[key]
