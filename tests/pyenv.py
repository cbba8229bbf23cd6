"""The Python environment of the test oracles: finds or creates it and prints its interpreter.

    python3 tests/pyenv.py [TARGET_DIR]      # prints the path of a python that has tests/requirements.txt

Contract: on first use creates a venv in TARGET_DIR/py-venv (default: the repository's target/)
and pip-installs tests/requirements.txt from the package registry; later calls only check a stamp
(hash of the requirements and the base interpreter's version) and print the path. Where the base
Python has no `venv`/`ensurepip`, packages go to TARGET_DIR/py-deps with `pip install --target`
and the printed path is a small wrapper that sets PYTHONPATH; where it has no pip either (Debian's
python3 without python3-pip and python3-venv), pip's own wheel is fetched from PyPI (checked
against the sha256 PyPI lists) and run as a program to do that install. An exclusive lock
(TARGET_DIR/py-env.lock) serialises parallel callers, so test binaries started together do not
race. Only the standard library is used here. DELTAFIN_TEST_PYTHON, when set, is printed as is
(an environment the caller already prepared).
"""

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REQUIREMENTS = os.path.join(HERE, "requirements.txt")


def stamp_text():
    with open(REQUIREMENTS, "rb") as f:
        req = f.read()
    return hashlib.sha256(req + sys.version.encode()).hexdigest() + "\n"


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def run(cmd):
    # pip's own output goes to stderr so that stdout carries only the interpreter path.
    r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    if r.returncode != 0:
        sys.exit(f"pyenv: `{' '.join(cmd)}` failed with exit code {r.returncode}")


def pip_install(python, extra):
    run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input"]
        + extra + ["-r", REQUIREMENTS])


def has_pip(python):
    if not os.access(python, os.X_OK):
        return False
    r = subprocess.run([python, "-m", "pip", "--version"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return r.returncode == 0


def with_venv(target, stamp):
    venv = os.path.join(target, "py-venv")
    python = os.path.join(venv, "bin", "python")
    ok = os.path.join(venv, ".requirements-ok")
    if read(ok) == stamp and os.access(python, os.X_OK):
        return python
    if not has_pip(python):
        # A venv without pip (no ensurepip in this Python) is useless: rebuild it, or give up.
        r = subprocess.run([sys.executable, "-m", "venv", "--clear", venv], stdout=sys.stderr, stderr=sys.stderr)
        if r.returncode != 0 or not has_pip(python):
            shutil.rmtree(venv, ignore_errors=True)
            return None
    print(f"pyenv: installing {REQUIREMENTS} into {venv} (first use) ...", file=sys.stderr)
    pip_install(python, [])
    write(ok, stamp)
    return python


def pip_wheel(target):
    """pip's wheel from PyPI, for a Python without pip: a pip wheel runs as a program
    (`python pip-X.whl/pip install ...`), as pip's own documentation bootstraps it."""
    import hashlib
    import json
    import urllib.parse
    import urllib.request

    index = "https://pypi.org/pypi/pip/json"
    try:
        with urllib.request.urlopen(index, timeout=60) as r:
            meta = json.load(r)
        wheel = next(f for f in meta["urls"] if f["packagetype"] == "bdist_wheel")
        path = os.path.join(target, wheel["filename"])
        if not os.path.exists(path):
            # A mirror may list the file relative to the index page.
            with urllib.request.urlopen(urllib.parse.urljoin(index, wheel["url"]), timeout=120) as r:
                data = r.read()
            got, want = hashlib.sha256(data).hexdigest(), wheel["digests"]["sha256"]
            if got != want:
                sys.exit(f"pyenv: {wheel['url']}: sha256 {got}, PyPI lists {want}")
            tmp = f"{path}.tmp.{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
    except (OSError, ValueError, KeyError, StopIteration) as e:
        sys.exit(f"pyenv: this Python ({sys.executable}) has no pip and pip could not be fetched from {index}: {e}\n"
                 "  install pip (Debian/Ubuntu: apt-get install python3-pip python3-venv) or set\n"
                 "  DELTAFIN_TEST_PYTHON to a python that has tests/requirements.txt")
    return os.path.join(path, "pip")


def with_target(target, stamp):
    deps = os.path.join(target, "py-deps")
    wrapper = os.path.join(deps, "python")
    ok = os.path.join(deps, ".requirements-ok")
    if read(ok) == stamp and os.access(wrapper, os.X_OK):
        return wrapper
    os.makedirs(deps, exist_ok=True)
    print(f"pyenv: no venv module; installing {REQUIREMENTS} into {deps} ...", file=sys.stderr)
    extra = ["--upgrade", "--target", os.path.join(deps, "lib")]
    if has_pip(sys.executable):
        pip_install(sys.executable, extra)
    else:
        print("pyenv: no pip either; running pip from its wheel on PyPI ...", file=sys.stderr)
        run([sys.executable, pip_wheel(target), "install", "--quiet", "--disable-pip-version-check", "--no-input"]
            + extra + ["-r", REQUIREMENTS])
    write(wrapper, f'#!/bin/sh\nPYTHONPATH="{deps}/lib${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    os.chmod(wrapper, 0o755)
    write(ok, stamp)
    return wrapper


def write(path, text):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main():
    if os.environ.get("DELTAFIN_TEST_PYTHON"):
        print(os.environ["DELTAFIN_TEST_PYTHON"])
        return
    target = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "target"))
    os.makedirs(target, exist_ok=True)
    stamp = stamp_text()
    with open(os.path.join(target, "py-env.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = with_venv(target, stamp) or with_target(target, stamp)
    print(python)


if __name__ == "__main__":
    main()
