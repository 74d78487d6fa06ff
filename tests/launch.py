"""Starts two-rank `torchrun` jobs for the tests.

`--standalone` lets torchrun take a free rendezvous port each time: a fixed --master_port can be held by another
process on a shared CI host, and the test then failed with nothing to read. A failure now carries the ranks'
own stderr, and a launch that died on a socket or rendezvous error (never on the job's code) is tried once more.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what a launch prints when the network, not the job, failed
TRANSIENT = re.compile(r"EADDRINUSE|Address already in use|Connection (reset|refused)|RendezvousConnectionError|"
                       r"RendezvousTimeoutError|DistNetworkError|Socket Timeout", re.I)


def child_env() -> dict:
    """One thread per process (two ranks share 2 cores), and no WORLD_SIZE leaked from a pytest run under torchrun."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return env


def torchrun(args: list[str], *, timeout: float, nproc: int = 2, tries: int = 2) -> subprocess.CompletedProcess:
    env = child_env()
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", str(nproc), *args]
    for attempt in range(1, tries + 1):
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or not TRANSIENT.search(proc.stderr) or attempt == tries:
            break
        print(f"torchrun launch {attempt} hit a network error, trying again:\n{proc.stderr[-1500:]}",
              file=sys.stderr)
    assert proc.returncode == 0, (f"torchrun exited {proc.returncode}: {' '.join(cmd)}\n"
                                  f"--- stderr (tail) ---\n{proc.stderr[-4000:]}\n--- stdout (tail) ---\n"
                                  f"{proc.stdout[-1000:]}")
    return proc
