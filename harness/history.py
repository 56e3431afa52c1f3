"""A watch that outlives restarts of the API server and of etcd, for checks that replay every write.

harness.cluster.Watch gives up when its connection breaks; a chaos run breaks it on purpose. This one
watches again from the last resourceVersion it saw, so no write is missed as long as the store still
has it: the chaos control plane runs kube-apiserver with `--watch-cache=false` (a watch is served by
etcd from any revision, not by a cache that starts afresh at each restart) and without compaction.
Should history still be lost (410 Gone), the gap is recorded in `gaps` and the watch starts again from
a fresh list, so a check can say it was blind for a while instead of passing silently.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from harness.cluster import ADMIN_TOKEN, ControlPlane

RETRY_S = 0.5


class History:
    def __init__(self, cp: ControlPlane, path: str) -> None:
        self._cp, self._path = cp, path
        self._rv = str(cp.get(path)["metadata"]["resourceVersion"])
        # (time.monotonic() received, type, object), in the order of the writes.
        self.events: list[tuple[float, str, dict[str, Any]]] = []
        self.gaps: list[tuple[float, str]] = []
        self.reconnects = 0
        self._latest: dict[str, int] = {}  # name -> the newest resourceVersion received for it
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"history {path}")
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            params = {"watch": "1", "resourceVersion": self._rv, "timeoutSeconds": "5",
                      "allowWatchBookmarks": "true"}
            req = urllib.request.Request(f"{self._cp.url}{self._path}?{urllib.parse.urlencode(params)}",
                                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            try:
                with urllib.request.urlopen(req, timeout=30, context=self._cp._ssl) as resp:
                    for line in resp:
                        self._take(json.loads(line))
            except (OSError, ValueError, urllib.error.HTTPError):
                # Down (a restart in progress) or cut mid-stream: watch again from the last write seen.
                self.reconnects += 1
                self._stopping.wait(RETRY_S)

    def _take(self, event: dict[str, Any]) -> None:
        obj = event["object"]
        if event["type"] == "ERROR":
            if obj.get("code") == 410:
                self.gaps.append((time.monotonic(), str(obj.get("message"))))
                try:
                    self._rv = str(self._cp.get(self._path)["metadata"]["resourceVersion"])
                except Exception:  # noqa: BLE001 - down again: the next try lists again
                    self._rv = "0"
            raise ValueError(f"watch error: {obj.get('message')}")
        self._rv = obj["metadata"]["resourceVersion"]
        if event["type"] != "BOOKMARK":
            self._latest[obj["metadata"]["name"]] = int(self._rv)
            self.events.append((time.monotonic(), event["type"], obj))

    def wait_caught_up(self, timeout: float) -> None:
        """Return once every object listed now has reached `events` at its current version: a check
        that replays `events` then judges nothing by writes still on their way (a watch reconnecting
        after a restart runs behind). TimeoutError says which objects it still lacks."""
        wanted = {o["metadata"]["name"]: int(o["metadata"]["resourceVersion"])
                  for o in self._cp.get(self._path)["items"]}
        deadline = time.monotonic() + timeout
        while True:
            behind = sorted(n for n, rv in wanted.items() if self._latest.get(n, 0) < rv)
            if not behind:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the watch of {self._path} is {timeout:.0f} s behind for {behind}")
            self._stopping.wait(0.1)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(40)
