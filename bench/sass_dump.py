# What SASS the NVIDIA Vulkan driver made of each pipeline in its shader cache (a development aid
# for the lent H200). The cache's .bin files hold zstd frames; those that decompress to an object
# starting "NVDANVVM" (it carries "NVuc" after) hold a pipeline whose code ends with EXIT. Each is
# disassembled with `nvdisasm -b SM90` from the earliest start that decodes (the code starts a
# few hundred bytes into the object: 344 and 376 on driver 580, so only the first 2 KiB are
# tried; the chosen offset is printed, since header bytes that happen to decode would count), and
# summarised: instructions, highest register, instruction classes.
#   python3 dump.py CACHE_DIR [--out FILE] [--min-hadd2 N] [--hashes-out FILE] [--exclude FILE]
# --hashes-out writes one hash per pipeline's code; --exclude skips the pipelines listed in such
# a file (a baseline run's), so that a variant's run reports only the variant.
import argparse
import collections
import glob
import hashlib
import multiprocessing
import os
import re
import subprocess
import tempfile

ZSTD = os.environ.get("ZSTD", "zstd")
MAGIC = b"\x28\xb5\x2f\xfd"
EXIT = bytes.fromhex("4d79000000000000")


def frames(path):
    """The decompressed pipeline objects of one cache file, each frame cut at the next magic (zstd
    then stops at the entry header that follows the frame and says so on stderr; its output is
    still the whole frame)."""
    d = open(path, "rb").read()
    starts = []
    at = d.find(MAGIC)
    while at >= 0:
        starts.append(at)
        at = d.find(MAGIC, at + 4)
    for a, b in zip(starts, starts[1:] + [len(d)]):
        r = subprocess.run([ZSTD, "-d", "-c", "-q"], input=d[a:b], capture_output=True)
        if r.stdout.startswith(b"NVDANVVM"):
            yield f"{os.path.basename(path)}@{a}", r.stdout


def disasm(d, s, e):
    fd, name = tempfile.mkstemp()
    os.write(fd, d[s:e + 48])
    os.close(fd)
    r = subprocess.run(["nvdisasm", "-b", "SM90", name], capture_output=True, text=True)
    os.unlink(name)
    return r.returncode == 0 and "fatal" not in r.stderr, r.stdout


def one(item):
    """(where, start offset or None, text): the code before the object's last 16-byte-aligned EXIT."""
    where, d = item
    exits = [i for i in range(0, len(d) - 8) if d[i:i + 8] == EXIT]
    for e in reversed(exits):
        for s in range(e % 16, min(e, 2048), 16):
            ok, text = disasm(d, s, e)
            if ok:
                return where, s, text
    return where, None, ""


def summary(text):
    ops = collections.Counter()
    for line in text.split("\n"):
        m = re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(2)] += 1
    regs = [int(x) for x in re.findall(r"\bR(\d+)\b", text)]
    return sum(ops.values()), max(regs, default=0), ops


def code_hash(text):
    body = "\n".join(re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in text.split("\n"))
    return hashlib.sha1(body.encode()).hexdigest()[:16]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("cache")
    ap.add_argument("--out")
    ap.add_argument("--min-hadd2", type=int, default=0)
    ap.add_argument("--hashes-out")
    ap.add_argument("--exclude")
    a = ap.parse_args()
    skip = set(open(a.exclude).read().split()) if a.exclude else set()
    items = [it for f in sorted(glob.glob(os.path.join(a.cache, "**", "*.bin"), recursive=True)) for it in frames(f)]
    with multiprocessing.Pool(16) as p:
        done = p.map(one, items)
    full, hashes = [], []
    for where, start, text in done:
        if start is None:
            print(f"{where}: no code found in the first 2 KiB")
            continue
        h = code_hash(text)
        hashes.append(h)
        n, reg, ops = summary(text)
        if h in skip or ops["HADD2"] < a.min_hadd2:
            continue
        print(f"{where} code at {start} hash {h}: instrs {n} maxreg R{reg} HADD2 {ops['HADD2']} FFMA {ops['FFMA']} "
              f"FMUL {ops['FMUL']} LOP3 {ops['LOP3']} SHF {ops['SHF']} ISETP {ops['ISETP']} LDG {ops['LDG']} "
              f"LDS {ops['LDS']} STS {ops['STS']} BAR {ops['BAR']} BRA {ops['BRA']}")
        full.append(f"##### {where} code at {start} hash {h}\n{text}")
    if a.out:
        open(a.out, "w").write("\n".join(full))
    if a.hashes_out:
        open(a.hashes_out, "w").write("\n".join(hashes) + "\n")
