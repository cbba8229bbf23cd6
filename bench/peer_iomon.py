#!/usr/bin/env python3
"""Runs a command and samples the storage reads of its process tree from /proc/PID/io.

    peer_iomon.py TRACE.json STDOUT_FILE EXE -- CMD [ARGS...]

Every INTERVAL seconds (env PEER_IO_INTERVAL, default 0.1) it reads read_bytes (bytes the kernel
read from storage for the process: page-cache misses of mmap and read, and O_DIRECT reads) and
rchar of the processes in the command's tree whose executable is EXE (the benchmark runs as a
grandchild of bench/in_cgroup.sh). Only those: a parent's /proc/PID/io takes in a child's counts
once it reaps it, so summing the whole tree would count the benchmark twice at its exit. Each stdout line is stamped with the time it appeared, so a benchmark that
prints a result right after a timed phase (llama-bench -o jsonl) marks where that phase ended.
/proc/PID/io includes the process's exited threads (io_uring workers among them). Exits with the
command's status; the trace is written either way.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time


def tree(root: int) -> list[int]:
    """root and its live descendants."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name may hold spaces: the ppid is the 2nd field after the closing paren
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def io_of(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}
    except (OSError, ValueError):
        return None


def main() -> int:
    if len(sys.argv) < 6 or sys.argv[4] != "--":
        sys.exit("usage: peer_iomon.py TRACE.json STDOUT_FILE EXE -- CMD [ARGS...]")
    trace_path, out_path, cmd = sys.argv[1], sys.argv[2], sys.argv[5:]
    exe = os.path.realpath(sys.argv[3])
    interval = float(os.environ.get("PEER_IO_INTERVAL", "0.1"))
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
    lines: list[list] = []

    def pump() -> None:
        assert proc.stdout is not None
        with open(out_path, "w") as out:
            for line in proc.stdout:
                lines.append([time.time() - t0, line.rstrip("\n")])
                out.write(line)
                out.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    # Per pid, the last counters seen: a process that exits keeps its last sample in the sum.
    last: dict[int, dict[str, int]] = {}
    samples: list[list] = []
    while True:
        done = proc.poll() is not None
        for pid in tree(proc.pid):
            try:
                if os.path.realpath(f"/proc/{pid}/exe") != exe:
                    continue
            except OSError:
                continue
            io = io_of(pid)
            if io is not None:
                last[pid] = io
        samples.append([
            time.time() - t0,
            sum(v.get("read_bytes", 0) for v in last.values()),
            sum(v.get("rchar", 0) for v in last.values()),
        ])
        if done:
            break
        time.sleep(interval)
    reader.join(timeout=10)
    with open(trace_path, "w") as f:
        json.dump({"cmd": cmd, "rc": proc.returncode, "interval_s": interval, "t0_unix": t0,
                   "wall_s": time.time() - t0, "samples": samples, "lines": lines}, f)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
