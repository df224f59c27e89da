"""The training corpus: CPython 3.11.7's standard library source (PSF license).

It exists on every machine of this project at STDLIB. The committed manifest
(corpus_manifest.tsv: split, sha256, bytes, path) fixes the file list, the hashes
and the split; `load_split` refuses to run when any file differs.

The split is by file: a file is held out iff sha256(path) mod 20 == 0 (about 5%).
"""
import argparse
import hashlib
import os
import sys
from pathlib import Path

STDLIB = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")
HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "corpus_manifest.tsv"


def _candidates():
    for root, dirs, files in os.walk(STDLIB):
        rel_root = Path(root).relative_to(STDLIB)
        parts = rel_root.parts
        # No third-party code, no test suites (binary fixtures, odd encodings).
        dirs[:] = sorted(
            d for d in dirs
            if not (len(parts) == 0 and d in ("site-packages", "test"))
            and d not in ("tests", "__pycache__", "idle_test")
        )
        for f in sorted(files):
            if f.endswith(".py"):
                yield (rel_root / f).as_posix()


def split_of(path: str) -> str:
    h = int(hashlib.sha256(path.encode()).hexdigest(), 16)
    return "heldout" if h % 20 == 0 else "train"


def write_manifest():
    rows = []
    for rel in _candidates():
        data = (STDLIB / rel).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not data.strip():
            continue
        rows.append((split_of(rel), hashlib.sha256(data).hexdigest(), len(data), rel))
    with open(MANIFEST, "w") as f:
        f.write("# split\tsha256\tbytes\tpath (relative to %s)\n" % STDLIB)
        for r in rows:
            f.write("%s\t%s\t%d\t%s\n" % r)
    return rows


def read_manifest():
    rows = []
    for line in MANIFEST.read_text().splitlines():
        if line.startswith("#"):
            continue
        split, digest, size, rel = line.split("\t")
        rows.append((split, digest, int(size), rel))
    return rows


def load_split(split: str) -> list[tuple[str, str]]:
    """[(path, text)] of one split, after checking every file's hash."""
    out = []
    for s, digest, size, rel in read_manifest():
        if s != split:
            continue
        data = (STDLIB / rel).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            sys.exit(f"corpus: {STDLIB / rel} does not match the manifest hash; refusing")
        out.append((rel, data.decode("utf-8")))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--write-manifest", action="store_true")
    args = ap.parse_args()
    if args.write_manifest:
        rows = write_manifest()
    rows = read_manifest()
    for split in ("train", "heldout"):
        files = load_split(split)
        print(split, len(files), "files", sum(len(t.encode()) for _, t in files), "bytes")
