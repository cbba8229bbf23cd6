# What SASS the NVIDIA Vulkan driver made of each pipeline in its shader cache (a development aid
# for the lent H200): the cache's zstd frames hold "NVuc" objects whose code ends with EXIT; each
# is disassembled with `nvdisasm -b SM90` from the earliest start that decodes (the code starts a
# few hundred bytes into the object: 344 and 376 on driver 580, so only the first 2 KiB are
# tried), and summarised (instructions, highest register, instruction classes).
#   python3 dump.py CACHE_DIR [OUT.txt] [--min-hadd2 N]
import collections
import glob
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

ZSTD = os.environ.get("ZSTD", "zstd")


def frames(path):
    d = open(path, "rb").read()
    at = d.find(b"\x28\xb5\x2f\xfd")
    while at >= 0:
        nxt = d.find(b"\x28\xb5\x2f\xfd", at + 4)
        blob = d[at:nxt if nxt > 0 else len(d)]
        r = subprocess.run([ZSTD, "-d", "-c", "-q"], input=blob, capture_output=True)
        if r.stdout.startswith(b"NVDANVVM"):
            yield r.stdout
        at = nxt


def disasm(d, s, e):
    fd, name = tempfile.mkstemp()
    os.write(fd, d[s:e + 48])
    os.close(fd)
    r = subprocess.run(["nvdisasm", "-b", "SM90", name], capture_output=True, text=True)
    os.unlink(name)
    return r.returncode == 0 and "fatal" not in r.stderr, r.stdout


def one(d):
    exits = [i for i in range(len(d) - 8) if d[i:i + 8] == bytes.fromhex("4d79000000000000")]
    out = []
    for e in exits[-1:]:
        for s in range(e % 16, min(e, 2048), 16):
            ok, text = disasm(d, s, e)
            if ok:
                out.append(text)
                break
    return "\n".join(out)


def summary(text):
    ops = collections.Counter()
    for l in text.split("\n"):
        m = re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", l)
        if m:
            ops[m.group(2)] += 1
    regs = [int(x) for x in re.findall(r"\bR(\d+)\b", text)]
    return sum(ops.values()), max(regs, default=0), ops


if __name__ == "__main__":
    cache = sys.argv[1]
    dest = sys.argv[2] if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else None
    min_h = int(sys.argv[sys.argv.index("--min-hadd2") + 1]) if "--min-hadd2" in sys.argv else 0
    blobs = [b for f in glob.glob(os.path.join(cache, "**", "*.bin"), recursive=True) for b in frames(f)]
    with multiprocessing.Pool(16) as p:
        texts = p.map(one, blobs)
    full = []
    for t in texts:
        n, reg, ops = summary(t)
        if ops["HADD2"] < min_h:
            continue
        print(f"instrs {n} maxreg R{reg} HADD2 {ops['HADD2']} FFMA {ops['FFMA']} FMUL {ops['FMUL']} LOP3 {ops['LOP3']} "
              f"SHF {ops['SHF']} LDG {ops['LDG']} LDS {ops['LDS']} STS {ops['STS']} BAR {ops['BAR']} BRA {ops['BRA']}")
        full.append(t)
    if dest:
        open(dest, "w").write("\n#####\n".join(full))
