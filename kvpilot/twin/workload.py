"""Workloads for the engine twin: when requests arrive and how long they are.

A workload is written as one string a person can type:

    ARRIVAL:key=value,key=value,...      or      PATH.jsonl      (trace replay)

ARRIVAL is `poisson` (exponential gaps) or `gamma` (bursty: gamma gaps with coefficient of
variation `cv`, default 2; cv=1 is Poisson).  Keys:

    rate=R        requests per second (required for poisson and gamma)
    cv=C          burstiness of gamma arrivals
    prompt=LEN    prompt tokens        (default sharegpt)
    output=LEN    output tokens        (default sharegpt)
    prefix=N      every prompt starts with the same N-token system prompt (prefix caching)
    prefixes=K    ... one of K different ones, chosen at random (default 1)

LEN is `256` (fixed), `64..2048` (uniform, inclusive), `lognormal/MEDIAN/SIGMA` (rounded, at
least 1; clipped to 16x the median), or `sharegpt` (lognormal fits of ShareGPT conversations as
vLLM's benchmark tokenises them: prompts median 150 / sigma 1.0, outputs median 140 / sigma 0.9).

A trace is JSON lines `{"arrival_s": 0.12, "prompt_tokens": 512, "output_tokens": 128}`
(optional `"prefix": "key"` and `"prefix_tokens": N`), replayed as recorded; `trace:PATH`
works too.  Everything random draws from one numpy Generator seeded by the caller, so the same
spec and seed give the same requests.

Examples: `poisson:rate=10`, `gamma:rate=5,cv=3,prompt=lognormal/1000/0.6,output=200`,
`poisson:rate=2,prompt=4096,output=64..512`, `traces/prod.jsonl`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class WorkloadError(ValueError):
    """A workload spec or trace the twin cannot read; the message says what is allowed."""


@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: str  # fixed | uniform | lognormal
    a: float  # fixed value, uniform low, lognormal median
    b: float = 0.0  # uniform high, lognormal sigma

    @classmethod
    def parse(cls, text: str, field: str) -> LengthDist:
        t = text.strip().lower()
        try:
            if t == "sharegpt":
                return SHAREGPT_PROMPT if field == "prompt" else SHAREGPT_OUTPUT
            if ".." in t:
                lo, hi = (int(x) for x in t.split("..", 1))
                if not 1 <= lo <= hi:
                    raise WorkloadError(f"{field}={text}: need 1 <= low <= high")
                return cls("uniform", lo, hi)
            if t.startswith("lognormal/"):
                _, median, sigma = t.split("/")
                m, s = float(median), float(sigma)
                if m < 1 or s < 0:
                    raise WorkloadError(f"{field}={text}: need median >= 1 and sigma >= 0")
                return cls("lognormal", m, s)
            v = int(t)
            if v < 1:
                raise WorkloadError(f"{field}={text}: a length must be >= 1")
            return cls("fixed", v)
        except WorkloadError:
            raise
        except ValueError:
            raise WorkloadError(
                f"{field}={text!r}: a length is N (fixed), LOW..HIGH (uniform), lognormal/MEDIAN/SIGMA or sharegpt"
            ) from None

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, int(self.a), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b), endpoint=True, size=n)
        x = rng.lognormal(math.log(self.a), self.b, size=n)
        return np.clip(np.rint(x), 1, 16 * self.a).astype(np.int64)

    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a * math.exp(self.b**2 / 2)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"{int(self.a)}..{int(self.b)}"
        return f"lognormal/{self.a:g}/{self.b:g}"


SHAREGPT_PROMPT = LengthDist("lognormal", 150, 1.0)
SHAREGPT_OUTPUT = LengthDist("lognormal", 140, 0.9)


@dataclass(frozen=True, slots=True)
class RequestBatch:
    """Requests in arrival order (numpy arrays of equal length)."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    prefix_keys: list[str | None] | None = None
    prefix_tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrival_s)


@dataclass(frozen=True, slots=True)
class Workload:
    arrival: str = "poisson"  # poisson | gamma | trace
    rate: float = 1.0
    cv: float = 2.0
    prompt: LengthDist = SHAREGPT_PROMPT
    output: LengthDist = SHAREGPT_OUTPUT
    prefix_tokens: int = 0
    num_prefixes: int = 1
    trace_path: str | None = None
    spec: str = ""

    @classmethod
    def parse(cls, spec: str) -> Workload:
        text = spec.strip()
        if text.startswith("trace:"):
            return cls(arrival="trace", trace_path=text[len("trace:"):], spec=text)
        if text.endswith((".jsonl", ".json")) or "/" in text.split(":", 1)[0]:
            return cls(arrival="trace", trace_path=text, spec=text)
        kind, _, rest = text.partition(":")
        kind = kind.strip().lower()
        if kind not in ("poisson", "gamma"):
            raise WorkloadError(
                f"workload {spec!r}: start with poisson: or gamma: (e.g. poisson:rate=10,prompt=sharegpt), "
                "or give a .jsonl trace path"
            )
        fields: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise WorkloadError(f"workload {spec!r}: {item!r} is not key=value")
            fields[key.strip().lower()] = value.strip()
        allowed = {"rate", "cv", "prompt", "output", "prefix", "prefixes"}
        unknown = sorted(set(fields) - allowed)
        if unknown:
            raise WorkloadError(f"workload {spec!r}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
        if "rate" not in fields:
            raise WorkloadError(f"workload {spec!r}: rate=R (requests per second) is required")
        try:
            rate = float(fields["rate"])
            cv = float(fields.get("cv", 2.0))
            prefix = int(fields.get("prefix", 0))
            prefixes = int(fields.get("prefixes", 1))
        except ValueError as exc:
            raise WorkloadError(f"workload {spec!r}: {exc}") from None
        if not (rate > 0 and math.isfinite(rate)):
            raise WorkloadError(f"workload {spec!r}: rate must be a positive number")
        if not cv > 0:
            raise WorkloadError(f"workload {spec!r}: cv must be positive")
        if prefix < 0 or prefixes < 1:
            raise WorkloadError(f"workload {spec!r}: prefix must be >= 0 and prefixes >= 1")
        return cls(
            arrival=kind, rate=rate, cv=cv if kind == "gamma" else 1.0,
            prompt=LengthDist.parse(fields.get("prompt", "sharegpt"), "prompt"),
            output=LengthDist.parse(fields.get("output", "sharegpt"), "output"),
            prefix_tokens=prefix, num_prefixes=prefixes, spec=text,
        )

    def _gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.arrival == "poisson":
            return rng.exponential(1.0 / self.rate, size=n)
        shape = 1.0 / (self.cv**2)
        return rng.gamma(shape, 1.0 / (self.rate * shape), size=n)

    def generate(self, *, duration_s: float | None = None, num_requests: int | None = None,
                 seed: int = 0) -> RequestBatch:
        """The requests arriving in [0, duration_s), or the first `num_requests` (both: whichever
        ends first).  Same spec + seed -> same requests."""
        if duration_s is None and num_requests is None:
            raise WorkloadError("give a duration or a number of requests")
        if self.arrival == "trace":
            return self._replay(duration_s, num_requests)
        rng = np.random.default_rng(seed)
        if num_requests is not None:
            n = num_requests
            arrivals = np.cumsum(self._gaps(rng, n))
        else:
            assert duration_s is not None
            chunks, total, t = [], 0, 0.0
            while t < duration_s:
                size = max(64, int((duration_s - t) * self.rate * 1.2) + 16)
                g = np.cumsum(self._gaps(rng, size)) + t
                chunks.append(g)
                total += size
                t = float(g[-1])
            arrivals = np.concatenate(chunks)
        if duration_s is not None:
            arrivals = arrivals[arrivals < duration_s]
        n = len(arrivals)
        prompts = self.prompt.sample(rng, n)
        outputs = self.output.sample(rng, n)
        keys: list[str | None] | None = None
        ptoks = None
        if self.prefix_tokens:
            which = rng.integers(0, self.num_prefixes, size=n)
            keys = [f"prefix-{k}" for k in which.tolist()]
            ptoks = np.full(n, self.prefix_tokens, dtype=np.int64)
            prompts = prompts + self.prefix_tokens
        return RequestBatch(arrivals, prompts, outputs, keys, ptoks)

    def _replay(self, duration_s: float | None, num_requests: int | None) -> RequestBatch:
        path = Path(self.trace_path or "")
        rows = []
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise WorkloadError(f"cannot read trace {str(path)!r}: {exc.strerror}") from None
        for no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                row = (float(obj["arrival_s"]), int(obj["prompt_tokens"]), int(obj["output_tokens"]),
                       obj.get("prefix"), int(obj.get("prefix_tokens", 0)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise WorkloadError(
                    f"{path}:{no}: each line must be a JSON object with arrival_s, prompt_tokens and "
                    f"output_tokens ({type(exc).__name__}: {exc})"
                ) from None
            if row[0] < 0 or row[1] < 1 or row[2] < 1:
                raise WorkloadError(f"{path}:{no}: arrival_s must be >= 0 and token counts >= 1")
            rows.append(row)
        rows.sort(key=lambda r: r[0])
        if duration_s is not None:
            rows = [r for r in rows if r[0] < duration_s]
        if num_requests is not None:
            rows = rows[:num_requests]
        has_prefix = any(r[3] for r in rows)
        return RequestBatch(
            np.array([r[0] for r in rows], dtype=float),
            np.array([r[1] for r in rows], dtype=np.int64),
            np.array([r[2] for r in rows], dtype=np.int64),
            [r[3] for r in rows] if has_prefix else None,
            np.array([r[4] for r in rows], dtype=np.int64) if has_prefix else None,
        )

    def describe(self) -> dict[str, object]:
        if self.arrival == "trace":
            return {"arrival": "trace", "path": self.trace_path}
        d: dict[str, object] = {"arrival": self.arrival, "rate": self.rate, "prompt": str(self.prompt),
                                "output": str(self.output)}
        if self.arrival == "gamma":
            d["cv"] = self.cv
        if self.prefix_tokens:
            d["prefix"] = self.prefix_tokens
            d["prefixes"] = self.num_prefixes
        return d
