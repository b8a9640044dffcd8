"""The local Ray cluster that `ditfleet run` starts without --address listens on loopback only,
and what it logs into a file carries no token warning and no colour.

A fresh Python process (so the cluster is its own, never the test session's) imports Ray first,
as any program that uses Ray before running a job does, then starts the cluster through
jobs/run.py's connect_ray, runs one task and one actor that prints (so worker processes exist
too), reports every TCP socket that it and its descendants (GCS, raylet, dashboard, dashboard
agent, runtime-env agent, workers) listen on, read from /proc without psutil, and waits for the
actor's line to be forwarded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

_CHILD = textwrap.dedent(
    """
    import json, os, re, time
    import ray  # before connect_ray: Ray reads its cluster switch when it is imported

    from ditfleet.jobs.run import connect_ray


    def descendants(pid):
        children = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    continue
                children.setdefault(ppid, []).append(int(entry))
        found, todo = [], [pid]
        while todo:
            p = todo.pop()
            for c in children.get(p, []):
                found.append(c)
                todo.append(c)
        return found


    def address(hex_addr, v6):
        raw = bytes.fromhex(hex_addr)
        if not v6:
            return ".".join(str(b) for b in raw[::-1])
        words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]  # each 32-bit word little-endian
        full = b"".join(words)
        if full[:12] == b"\\0" * 10 + b"\\xff\\xff":
            return "::ffff:" + ".".join(str(b) for b in full[12:])
        return ":".join(full[i : i + 2].hex() for i in range(0, 16, 2))


    def listening():
        by_inode = {}
        for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    if cols[3] == "0A":  # LISTEN
                        host, port = cols[1].split(":")
                        by_inode[cols[9]] = (address(host, v6), int(port, 16))
        out = []
        for pid in descendants(os.getpid()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    name = f.read().split(b"\\0")[0].decode(errors="replace")
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                m = re.fullmatch(r"socket:\\[(\\d+)\\]", link)
                if m and m.group(1) in by_inode:
                    out.append([name.rsplit("/", 1)[-1], *by_inode[m.group(1)]])
        return out


    @ray.remote
    class Talker:
        def say(self):
            print("a line from an actor")
            return 1


    connect_ray(None)
    ray.get(ray.remote(lambda: 1).remote())
    ray.get(Talker.remote().say.remote())
    print("LISTENING " + json.dumps(listening()), flush=True)
    time.sleep(2)  # Ray forwards actor output asynchronously
    ray.shutdown()
    """
)

_LOOPBACK = ("127.", "::ffff:127.", "0000:0000:0000:0000:0000:0000:0000:0001")


def test_a_local_run_listens_on_loopback_only_and_logs_no_token_warning_or_colour(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_USAGE_STATS_ENABLED="0", TMPDIR="/tmp")  # Ray's socket paths must stay short
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("LISTENING "))
    sockets = json.loads(line[len("LISTENING ") :])
    names = {name for name, _, _ in sockets}
    # The servers named in the issue, and a worker's, were seen (the check is not vacuous).
    # (The actor's worker is among the descendants checked below, under whichever title Ray has
    # given its process by then: not asserted by name.)
    assert {"gcs_server", "raylet", "ray::DashboardAgent", "ray::IDLE"} <= names, sockets
    wide = [s for s in sockets if not s[1].startswith(_LOOPBACK)]
    assert not wide, f"listening beyond loopback: {wide}"

    # Into a file (not a terminal): no token warning, no ANSI colour.
    logs = done.stdout + done.stderr
    assert "a line from an actor" in logs, "the check is not vacuous: a forwarded actor line"
    assert "Token authentication" not in logs, logs[-3000:]
    assert "\x1b[" not in logs, "ANSI colour in output that is not a terminal"
