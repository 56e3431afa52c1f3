"""Device profiles: a device the twin has no preset for (a CPU, a GPU measured on site), as a JSON file.

    {"device": {"name": ..., "total_memory_bytes": ..., "bf16_flops": ..., "hbm_bandwidth": ...},
     "step_time": {<StepTimeParams fields>},
     "source": "how it was measured"}

`device` holds the `GpuSpec` fields (no NVLink unless `nvlink_bandwidth` is given) (peaks as measured, not a datasheet's), `step_time` the cost
model's constants fitted to step times measured on that device; fields left out take their defaults.
`kvpilot twin calibrate` fits one on a served vLLM's observations (kvpilot.twin.calibration, which ships
vLLM-CPU's); benchmarks/twin_vs_vllm.py --calibrate measures them on real vLLM.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvpilot.twin import jsonin
from kvpilot.twin.hardware import GpuSpec
from kvpilot.twin.steptime import StepTimeParams


class DeviceProfileError(ValueError):
    """A device profile file that cannot be used; the message names the field."""


@dataclass(frozen=True)
class DeviceProfile:
    device: GpuSpec
    step_time: StepTimeParams
    source: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"device": asdict(self.device), "step_time": self.step_time.as_dict(), "source": self.source}

    def as_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2) + "\n"

    def write(self, path: str | Path) -> None:
        Path(path).write_text(self.as_json())

    @classmethod
    def from_dict(cls, data: Any) -> DeviceProfile:
        if not isinstance(data, dict):
            raise DeviceProfileError("a device profile is a JSON object with 'device' and 'step_time'")
        for part in ("device", "step_time"):
            if part in data and not isinstance(data[part], dict):
                raise DeviceProfileError(f"{part}: must be an object")
        device = _typed(GpuSpec, {"nvlink_bandwidth": 0.0, **(data.get("device") or {})}, "device",
                        required=("name", "total_memory_bytes", "bf16_flops", "hbm_bandwidth"))
        step_time = _typed(StepTimeParams, data.get("step_time", {}), "step_time", required=())
        return cls(device, step_time, str(data.get("source", "")))

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        return cls.from_dict(read_json(path, "device profile", DeviceProfileError))


def read_json(path: str | Path, what: str, error: type[ValueError]) -> Any:
    """The JSON in `path`, at most jsonin.MAX_BYTES nested at most jsonin.MAX_DEPTH deep; `error` names
    `what` it is when the file cannot be read, is larger or deeper, or is not JSON."""
    try:
        data = jsonin.read_head(path)
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > jsonin.MAX_BYTES:
        raise error(f"{what} {path} is larger than {jsonin.MAX_BYTES // 1024} KiB: it is a few kilobytes")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 (byte offset {e.start})") from None
    if jsonin.too_deep(text):
        raise error(f"{what} {path} nests more than {jsonin.MAX_DEPTH} levels deep")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} {path} is not JSON: {e}") from None
    except ValueError as e:  # an integer beyond Python's digit limit
        raise error(f"{what} {path} is not JSON the twin can read: {str(e)[:200]}") from None


def _typed(kind: Any, data: Any, where: str, *, required: tuple[str, ...]) -> Any:
    known = {f.name: f for f in fields(kind)}
    for key in data:
        if key not in known:
            raise DeviceProfileError(f"{where}.{key}: unknown field; allowed: {', '.join(known)}")
    for key in required:
        if key not in data:
            raise DeviceProfileError(f"{where}.{key}: required")
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("name", "architecture", "product_label"):
            if not isinstance(value, str):
                raise DeviceProfileError(f"{where}.{key}: must be a string")
        elif isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise DeviceProfileError(f"{where}.{key}: must be a non-negative number, got {value!r}")
        elif key in ("total_memory_bytes", "cuda_context_bytes"):
            value = int(value)
        else:
            value = float(value)
        values[key] = value
    return kind(**values)
