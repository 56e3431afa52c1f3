"""`kvpilot twin calibrate` and the profiles kvpilot ships: every shipped profile loads, the default CPU
profile predicts the observations it was fitted on as the fit reported, and bad input is one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvpilot.cli import main
from kvpilot.twin.calibration import CPU_OBSERVATIONS, CPU_PROFILE, DATA, TINY_MODEL_CONFIG
from kvpilot.twin.calibration.served import load_observations, predict
from kvpilot.twin.models import load_model_config
from kvpilot.twin.profiles import DeviceProfile


@pytest.mark.parametrize("path", sorted(DATA.glob("profile*.json")), ids=lambda p: p.name)
def test_every_shipped_profile_loads(path: Path) -> None:
    profile = DeviceProfile.load(path)
    assert profile.device.architecture == "cpu" and profile.step_time.frontend_s > 0


@pytest.mark.parametrize("path", sorted(DATA.glob("served*.json")), ids=lambda p: p.name)
def test_every_shipped_calibration_has_its_observations(path: Path) -> None:
    measured = load_observations(path)
    assert measured["peaks"]["bf16_flops"] > 0 and len(measured["observations"]) >= 20


def test_the_shipped_profile_predicts_its_observations_as_its_fit_did() -> None:
    # The errors `kvpilot twin calibrate` prints for the shipped fit: no kind's median beyond 3.5%.
    profile = DeviceProfile.load(CPU_PROFILE)
    obs = [o for o in load_observations(CPU_OBSERVATIONS)["observations"] if np.isfinite(o["seconds"])]
    params = replace(profile.step_time, step_jitter=0.0)
    pred = predict(load_model_config(TINY_MODEL_CONFIG), profile.device, params, obs)
    errors = np.abs(pred / np.array([o["seconds"] for o in obs]) - 1.0)
    for kind in ("decode", "prefill", "burst", "mixed"):
        mine = errors[[o["kind"] == kind for o in obs]]
        assert len(mine) and np.median(mine) < 0.035, (kind, np.median(mine))


def test_help_names_the_shipped_profile_and_observations(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # argparse wraps to the terminal's width, which differs between a desk and CI: fix it.
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit):
        main(["twin", "calibrate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--observations" in out and "--model-config" in out and "--output" in out
    # The defaults are the shipped files, named inside the package wherever it is installed.
    assert "the shipped kvpilot/twin/calibration/data/served.json" in out
    assert "kvpilot/twin/calibration/data/profile.json" in out


@pytest.mark.parametrize(("content", "match"), [
    (None, "cannot read observations"),
    ("{", "is not JSON"),
    (json.dumps({"peaks": {}}), "a JSON object with 'peaks' and 'observations'"),
])
def test_bad_observations_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  content: str | None, match: str) -> None:
    path = tmp_path / "served.json"
    if content is not None:
        path.write_text(content)
    assert main(["twin", "calibrate", "--observations", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpilot twin calibrate: error: ") and match in err and err.count("\n") == 1
