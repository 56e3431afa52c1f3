"""Print what each hostile manifest of tests/fuzz/documents.py costs each command, as the corpus test
measures it (tests/fuzz/harness.py: a forked child, CPU-seconds and peak RSS above its start):

    python -m tests.fuzz.figures [CASE_ID_PART ...]

One line per case and command: id, exit status, CPU-s, MB, bytes of output.  With arguments, only the
cases whose id contains one of them.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys

from tests.fuzz.documents import CASES

COMMANDS = {
    "validate": ["validate", "-f", "{input}"],
    "render": ["render", "-f", "{input}"],
    "slo-rules": ["slo", "rules", "-f", "{input}"],
}


def main(parts: list[str]) -> int:
    cases = [c for c in CASES if not parts or any(p in c.id for p in parts)]
    jobs = [{"id": f"{command}/{case.id}", "argv": argv, "input": base64.b64encode(case.data).decode()}
            for case in cases for command, argv in COMMANDS.items() if command in case.commands]
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz.harness"], input=json.dumps(jobs),
                          capture_output=True, text=True, timeout=3600, check=True)
    print(f"{'command/case':<48} {'exit':>4} {'CPU-s':>7} {'MB':>7} {'output':>10}")
    for line in proc.stdout.splitlines():
        r = json.loads(line)
        print(f"{r['id']:<48} {r['returncode']:>4} {r['cpu_s']:>7.3f} {r['peak_rss_mb']:>7.1f} "
              f"{r['stdout_len'] + r['stderr_len']:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
