"""Starts two-rank `torchrun` jobs for the tests.

`--standalone` lets torchrun take a free rendezvous port each time (a fixed --master_port can be held by another
process on a shared host). A failure carries the ranks' own stderr. A launch that died on a socket or rendezvous
error, or on gloo's abort at process teardown, is tried again; a failure in the job's own code is not.

The teardown abort ("terminate called without an active exception", SIGABRT in one rank after every output was
written) is torch/gloo's: tests/fsdp_check.py hit it in 2 of 24 launches on a loaded 2-core host, and 1 of 24
with a barrier before destroy_process_group, so no teardown order in our code was found to remove it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what a launch prints when the network or the teardown, not the job, failed
TRANSIENT = re.compile(r"EADDRINUSE|Address already in use|Connection (reset|refused)|RendezvousConnectionError|"
                       r"RendezvousTimeoutError|DistNetworkError|Socket Timeout|"
                       r"terminate called without an active exception", re.I)


def child_env() -> dict:
    """One thread per process (two ranks share 2 cores), and no WORLD_SIZE leaked from a pytest run under torchrun."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return env


def torchrun(args: list[str], *, timeout: float, nproc: int = 2, tries: int = 3) -> subprocess.CompletedProcess:
    env = child_env()
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", str(nproc), *args]
    for attempt in range(1, tries + 1):
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or not TRANSIENT.search(proc.stderr) or attempt == tries:
            break
        print(f"torchrun launch {attempt} hit a network or teardown error, trying again:\n{proc.stderr[-1500:]}",
              file=sys.stderr)
    assert proc.returncode == 0, (f"torchrun exited {proc.returncode}: {' '.join(cmd)}\n"
                                  f"--- stderr (tail) ---\n{proc.stderr[-4000:]}\n--- stdout (tail) ---\n"
                                  f"{proc.stdout[-1000:]}")
    return proc
