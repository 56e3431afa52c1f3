"""Every form a PostgreSQL password can take in a storage URL or a libpq string is masked, wherever
kvpilot shows the storage: `redacted` itself, `kvpilot tune`'s stderr and HTML report, and the
in-cluster tuner's refusal of a password on its command line."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.tuner.secrets import has_password, redacted

ROOT = Path(__file__).resolve().parents[3]
SECRET = "s3cr/t"

# (text, what it must read as once masked)
CASES = [
    ("postgresql://kv:s3cret@db:5432/kv", "postgresql://kv:***@db:5432/kv"),
    ("postgresql://kv:s3cr/t@db/kv", "postgresql://kv:***@db/kv"),
    ("postgresql://kv:s3cr@t@db/kv", "postgresql://kv:***@db/kv"),
    ("postgresql://kv:s3cr?t@db/kv", "postgresql://kv:***@db/kv"),
    ("postgresql://kv:s3cr%2Ft@db/kv?sslmode=require", "postgresql://kv:***@db/kv?sslmode=require"),
    ("postgresql://db/kv?password=s3cret", "postgresql://db/kv?password=***"),
    ("postgresql://db/kv?sslmode=require&password=s3cr%2Ft&application_name=x",
     "postgresql://db/kv?sslmode=require&password=***&application_name=x"),
    ("postgresql+psycopg://?host=db&user=kv&password=s3cret&dbname=kv",
     "postgresql+psycopg://?host=db&user=kv&password=***&dbname=kv"),
    ("postgresql://kv@db/kv?sslpassword=s3cret", "postgresql://kv@db/kv?sslpassword=***"),
    ("postgresql://kv@db/kv?pass%77ord=s3cret", "postgresql://kv@db/kv?pass%77ord=***"),
    ("postgresql://kv:hunter2@db/kv?password=s3cret", "postgresql://kv:***@db/kv?password=***"),
    ("postgresql://kv@db/kv?dsn=host%3Ddb%20password%3Ds3cret", "postgresql://kv@db/kv?dsn=***"),
    ("host=db user=kv password=s3cret dbname=kv", "host=db user=kv password=*** dbname=kv"),
    ("host=db password = 's3 cr\\'et' user=kv", "host=db password = *** user=kv"),
    ("host=db sslpassword=s3cret", "host=db sslpassword=***"),
    ("cannot open postgresql://kv:s3cret@db/kv: refused", "cannot open postgresql://kv:***@db/kv: refused"),
    # Nothing to mask: left as it was.
    ("postgresql://kv@db/kv", "postgresql://kv@db/kv"),
    ("sqlite:////var/lib/kvpilot/tuner.db", "sqlite:////var/lib/kvpilot/tuner.db"),
    ("sqlite:////data/a@b:c.db", "sqlite:////data/a@b:c.db"),
    ("host=db user=kv dbname=kv", "host=db user=kv dbname=kv"),
]


@pytest.mark.parametrize(("text", "shown"), CASES, ids=[c[0] for c in CASES])
def test_every_form_of_password_is_masked(text: str, shown: str) -> None:
    assert redacted(text) == shown
    assert has_password(text) == (shown != text)
    assert "s3cr" not in redacted(text)


def test_what_sqlalchemy_and_libpq_read_as_the_password_is_never_shown() -> None:
    from sqlalchemy.engine import make_url

    conninfo = pytest.importorskip("psycopg.conninfo")
    for text, _ in CASES:
        masked = redacted(text)
        secrets: list[str] = []
        with contextlib.suppress(Exception):  # not a URL SQLAlchemy reads
            url = make_url(text)
            secrets += [url.password or ""] + [str(v) for k, v in url.query.items() if "pass" in k]
        with contextlib.suppress(Exception):  # not a string libpq reads
            secrets += [v for k, v in conninfo.conninfo_to_dict(text).items() if "password" in k]
        for secret in filter(None, secrets):
            assert secret not in masked, (text, secret, masked)


def _tune(tmp_path: Path, storage: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "kvpilot.cli", "tune", "--offline", "--model", "Llama-3.1-8B", "--gpu", "H100-80GB",
            "--trials", "1", "-q", "--workload", "prompt=256,output=32", "--probe-seconds", "10",
            "--report", str(tmp_path / "report.html")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVPILOT_TUNER_STORAGE": storage}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)


@pytest.mark.parametrize("query", [
    f"password={SECRET}",
    f"host=db&user=kv&password={SECRET}",
])
def test_tune_masks_a_query_password_on_stderr_and_in_the_report(tmp_path: Path, query: str) -> None:
    # SQLite ignores these parameters, so the study runs; what is shown of its URL is what is checked.
    proc = _tune(tmp_path, f"sqlite:///{tmp_path}/s.db?{query}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "password=***" in proc.stderr
    report = (tmp_path / "report.html").read_text()
    assert "password=***" in report
    for shown in (proc.stdout, proc.stderr, report):
        assert SECRET not in shown and "s3cr%2Ft" not in shown


@pytest.mark.parametrize("storage", [
    "postgresql://kv@db/kv?password=s3cret",
    "postgresql://kv:s3cr/t@db/kv",
    "postgresql://?host=db&user=kv&password=s3cret",
])
def test_the_tuner_refuses_a_password_in_any_form_on_its_command_line(tmp_path: Path, storage: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", "tuner", "--prometheus", "http://127.0.0.1:1",
                           "--storage", storage], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert "--storage carries a password" in proc.stderr
    assert "s3cr" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr
