"""Shared pieces of deltafin's tokenizer scripts: K3's split pattern, the special tokens, and a
pure-Python encoder with tiktoken's exact semantics (used by the trainer and by check.py)."""

import base64
import json
from pathlib import Path

import regex

HERE = Path(__file__).resolve().parent
TRAIN = HERE.parent
DATA = TRAIN / "data"
OUT = HERE / "out"
REPO = TRAIN.parent

# Kimi's pat_str (tokenization_kimi.py), the same string as KIMI_PATTERN in src/model/tokenizer.rs.
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# `regex` needs V1 for the `&&` class intersections; tiktoken (Rust regex / fancy-regex) reads them natively.
SPLIT = regex.compile(KIMI_PATTERN, regex.V1)

NUM_SPECIALS = 256
# (offset after the base vocabulary, name): K3_SPECIALS in src/model/tokenizer.rs.
K3_SPECIALS = [
    (0, "[BOS]"),
    (1, "[EOS]"),
    (2, "<|end_of_msg|>"),
    (3, "<|open|>"),
    (4, "<|sep|>"),
    (5, "<|close|>"),
    (6, "<|kimi_image_placeholder|>"),
    (253, "[MASK]"),
    (255, "[PAD]"),
]


def special_names(n_base):
    """All 256 specials by id, named as K3 names them (unnamed: <|reserved_token_{id}|>)."""
    names = {n_base + i: f"<|reserved_token_{n_base + i}|>" for i in range(NUM_SPECIALS)}
    for off, name in K3_SPECIALS:
        names[n_base + off] = name
    return names


def tokenizer_config(n_base):
    """k3_tokenizer_config(n_base) of src/model/tokenizer.rs, keys in its (preserve_order) order."""
    dec = {}
    for off, name in K3_SPECIALS:
        dec[str(n_base + off)] = {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    return {
        "added_tokens_decoder": dec,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "model_max_length": 1048576,
    }


def read_ranks(path):
    """tiktoken.model -> {token bytes: rank}."""
    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            b64, rank = line.split()
            ranks[base64.b64decode(b64)] = int(rank)
    return ranks


def tiktoken_encoding(out_dir=OUT):
    import tiktoken

    ranks = read_ranks(Path(out_dir) / "tiktoken.model")
    n_base = len(ranks)
    cfg = json.loads((Path(out_dir) / "tokenizer_config.json").read_text())
    specials = {name: i for i, name in special_names(n_base).items()}
    for id_, entry in cfg["added_tokens_decoder"].items():
        assert specials[entry["content"]] == int(id_), (id_, entry)
    enc = tiktoken.Encoding("deltafin-k3-small", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    return enc, ranks


def settle(parts, ranks):
    """tiktoken's byte-pair merge, continued from `parts`: repeatedly merge the adjacent pair whose
    concatenation has the lowest rank (leftmost on ties) until no adjacent pair is a token."""
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def encode_piece(piece, ranks):
    """One pre-tokenized piece (bytes) -> token bytes, exactly as tiktoken encodes it (a piece that
    is itself a token is taken whole)."""
    if piece in ranks:
        return [piece]
    return settle([bytes([b]) for b in piece], ranks)


def encode(text, ranks, cache=None):
    """Text -> ranks, the pure-Python twin of tiktoken's encode_ordinary."""
    out = []
    for piece in SPLIT.findall(text):
        pb = piece.encode("utf-8")
        toks = cache.get(pb) if cache is not None else None
        if toks is None:
            toks = [ranks[t] for t in encode_piece(pb, ranks)]
            if cache is not None:
                cache[pb] = toks
        out.extend(toks)
    return out
