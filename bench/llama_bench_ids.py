"""Prints, as a JSON array, the prompt token ids llama-bench feeds its prompt test (`-p N`, one
process, `-r 1 --no-warmup`): it never seeds the C library's rand(), so the ids are glibc's
default rand() stream modulo the vocabulary size, after a BOS id when the vocabulary adds one
(llama-bench.cpp, test_prompt).
    python3 bench/llama_bench_ids.py --gguf MODEL.gguf --n 512 > ids.json
    python3 bench/llama_bench_ids.py --vocab 8192 --n 512 [--bos ID] > ids.json
Then `deltafin bench run --prompt-ids ids.json` runs on the very same prompt."""

import argparse
import ctypes
import json
import struct

# GGUF value types (gguf.h): scalar struct formats by type id; 8 = string, 9 = array.
SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_metadata(path):
    """The key/value metadata of a GGUF file (arrays of strings are returned as their length)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SystemExit(f"{path}: not a GGUF file")
        (version,) = struct.unpack("<I", f.read(4))
        if version < 2:
            raise SystemExit(f"{path}: GGUF version {version} is not supported")
        _, n_kv = struct.unpack("<QQ", f.read(16))

        def string():
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8", "replace")

        def value(t):
            if t in SCALAR:
                fmt = "<" + SCALAR[t]
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
            if t == 8:
                return string()
            if t == 9:
                (et,) = struct.unpack("<I", f.read(4))
                (n,) = struct.unpack("<Q", f.read(8))
                items = [value(et) for _ in range(n)]
                return len(items) if et == 8 else items
            raise SystemExit(f"{path}: unknown GGUF value type {t}")

        meta = {}
        for _ in range(n_kv):
            key = string()
            (t,) = struct.unpack("<I", f.read(4))
            meta[key] = value(t)
        return meta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", help="take the vocabulary size and BOS rule from this GGUF")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--bos", type=int, default=None, help="BOS id, when the GGUF's vocabulary adds one")
    a = ap.parse_args()
    if a.gguf:
        m = gguf_metadata(a.gguf)
        a.vocab = m["tokenizer.ggml.tokens"]
        # llama.cpp's default for BPE vocabularies like kimi-k2's is no BOS unless the file says so.
        if m.get("tokenizer.ggml.add_bos_token", m.get("tokenizer.ggml.model") in ("llama", "bert")):
            a.bos = m["tokenizer.ggml.bos_token_id"]
    if not a.vocab:
        ap.error("give --gguf or --vocab")
    libc = ctypes.CDLL("libc.so.6")
    libc.srand(1)  # glibc's state before any srand call
    ids = [a.bos if (i == 0 and a.bos is not None) else libc.rand() % a.vocab for i in range(a.n)]
    print(json.dumps(ids))


if __name__ == "__main__":
    main()
