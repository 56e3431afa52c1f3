"""The minimiser every calibration fit uses: Nelder-Mead on the log of StepTimeParams constants
(`fit_loss`), and the loss they minimise on measured times (`log_error_loss`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields, replace

import numpy as np

from kvpilot.twin.steptime import StepTimeParams


def log_error_loss(pred: np.ndarray, meas: np.ndarray) -> float:
    """Mean |log error|, plus a steep penalty on every point more than 20% off."""
    err = np.log(pred / meas)
    over = np.maximum(np.abs(err) - np.log(1.2), 0.0)
    return float(np.abs(err).mean() + 5.0 * (over**2).mean())


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, *, step: float = 0.3, iters: int = 600,
                tol: float = 1e-7) -> np.ndarray:
    """A plain Nelder-Mead simplex minimiser (numpy only)."""
    n = len(x0)
    simplex = [x0.astype(float)]
    for i in range(n):
        x = x0.astype(float).copy()
        x[i] += step
        simplex.append(x)
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if abs(values[-1] - values[0]) < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        xr = centroid + (centroid - worst)
        fr = f(xr)
        if fr < values[0]:
            xe = centroid + 2.0 * (centroid - worst)
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (worst - centroid)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:
                best = simplex[0]
                simplex = [best] + [best + 0.5 * (x - best) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


def _bounded(name: str, value: float) -> float:
    if name.endswith("_eff"):
        return min(value, 1.0)
    if name == "gemm_sharpness":
        return max(value, 1.0)
    return value


def fit_loss(loss: Callable[[StepTimeParams], float], start: StepTimeParams, names: Iterable[str],
             iters: int = 800) -> StepTimeParams:
    """Minimise `loss` over the named constants (positive; efficiencies capped at 1), Nelder-Mead
    on their logs, from `start`."""
    names = tuple(names)
    valid = {f.name for f in fields(StepTimeParams)}
    unknown = set(names) - valid
    if unknown:
        raise ValueError(f"unknown StepTimeParams fields: {sorted(unknown)}")

    def params_of(x: np.ndarray) -> StepTimeParams:
        return replace(start, **{n: _bounded(n, float(np.exp(v))) for n, v in zip(names, x, strict=True)})

    x0 = np.log(np.array([getattr(start, n) for n in names], dtype=float))
    return params_of(nelder_mead(lambda x: loss(params_of(x)), x0, iters=iters))
