#!/usr/bin/env python3
"""Which crates `cargo test --release` compiles after `cargo build --release` (the README's two
commands) in the checkout DIR (default: the repo root), from cargo's own build plans: the unit
graphs of both commands (`cargo +nightly ... --unit-graph -Z unstable-options`, needs a nightly
toolchain; nothing is built). A unit of the test command is reused only when the build command has
the same unit (package, features, profile, target, mode) with the same dependencies, recursively;
every other unit is compiled by the test command. Prints one JSON record.

    python3 bench/shared_build.py [DIR]
"""
import functools
import json
import os
import platform
import subprocess
import sys
import time


def graph(d, args):
    out = subprocess.run(["cargo", "+nightly"] + args + ["--release", "--unit-graph", "-Z", "unstable-options"],
                         cwd=d, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"cargo {' '.join(args)} --unit-graph failed:\n{out.stderr}")
    units = json.loads(out.stdout)["units"]

    @functools.lru_cache(None)
    def key(i):
        u = units[i]
        deps = tuple(sorted(key(x["index"]) for x in u["dependencies"]))
        return (u["pkg_id"], tuple(u["features"]), json.dumps(u["profile"], sort_keys=True), u["target"]["name"],
                tuple(u["target"]["kind"]), u["mode"], deps)

    return {key(i): units[i] for i in range(len(units))}


def main():
    d = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    build, test = graph(d, ["build"]), graph(d, ["test", "--no-run"])
    again = [test[k] for k in test if k not in build]
    name = lambda u: u["pkg_id"].split("#")[-1] if not u["pkg_id"].startswith("path+") else u["target"]["name"]
    crates = sorted({name(u).split("@")[0] for u in again if not u["pkg_id"].startswith("path+")})
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=d, capture_output=True, text=True).stdout.strip()
    print(json.dumps({
        "bench": "shared_build", "date": time.strftime("%Y-%m-%d"), "git": git,
        "machine": {"os": platform.platform(), "cores": os.cpu_count()},
        "command": "python3 bench/shared_build.py " + " ".join(sys.argv[1:]),
        "units_build": len(build), "units_test": len(test), "units_compiled_by_test": len(again),
        # `cargo test` prints one `Compiling` line per crate: these, and deltafin itself.
        "crates_compiled_by_test": len(crates) + 1, "other_crates": crates,
    }))


if __name__ == "__main__":
    main()
