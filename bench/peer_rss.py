#!/usr/bin/env python3
"""Runs a command and writes its peak resident set size (the largest of the processes it waited
for, getrusage RUSAGE_CHILDREN ru_maxrss) to a file as `peak_rss_kb N`; what /usr/bin/time -f %M
reports, without needing the `time` package on the machine.

    peer_rss.py OUT_FILE CMD [ARGS...]

Exits with the command's status (128 + signal when a signal ended it)."""
import resource
import subprocess
import sys

if len(sys.argv) < 3:
    sys.exit(__doc__)
rc = subprocess.call(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    f.write(f"peak_rss_kb {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\n")
sys.exit(128 - rc if rc < 0 else rc)
