"""The training corpus.

1. CPython 3.11.7's standard library source (PSF license). It exists on every machine
   of this project at STDLIB. The committed manifest (corpus_manifest.tsv: split,
   sha256, bytes, path) fixes the file list, the hashes and the split. The split is by
   file: a file is held out iff sha256(path) mod 20 == 0 (about 5%).
2. The Python sources of widely used, permissively licensed projects, as published on
   PyPI (corpus_packages.tsv: split, project, version, licence, SHA-256 of the sdist).
   `--fetch` downloads each sdist into DATA and checks its hash. The split is by
   project: the `foreign` projects are never trained on, so the loss on them measures
   code from projects the model never saw. Every `*.py` member of an sdist is used
   except vendored copies of other projects (`_vendor`/`vendor`/`_vendored`
   directories), files that are not UTF-8, empty files and files over 256 KB
   (generated tables).

`load_split` refuses to run when any file differs from its recorded hash.
Splits: `train` (stdlib train files + the train projects), `heldout` (stdlib held-out
files), `foreign` (the foreign projects).
"""
import argparse
import hashlib
import os
import sys
from pathlib import Path

STDLIB = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")
HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "corpus_manifest.tsv"
PACKAGES = HERE / "corpus_packages.tsv"
DATA = HERE / "data"
MAX_FILE = 256 * 1024
VENDORED = {"_vendor", "vendor", "_vendored", "vendored"}


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


def read_packages():
    rows = []
    for line in PACKAGES.read_text().splitlines():
        if line.startswith("#"):
            continue
        split, name, version, licence, digest, fname = line.split("\t")
        rows.append((split, name, version, licence, digest, fname))
    return rows


def fetch_packages():
    """Download every sdist of corpus_packages.tsv into DATA (checked by SHA-256)."""
    import json
    import urllib.parse
    import urllib.request

    DATA.mkdir(parents=True, exist_ok=True)
    for _, name, version, _, digest, fname in read_packages():
        dest = DATA / fname
        if dest.exists() and hashlib.sha256(dest.read_bytes()).hexdigest() == digest:
            continue
        meta_url = f"https://pypi.org/pypi/{name}/{version}/json"
        meta = json.load(urllib.request.urlopen(meta_url))
        url = next(u["url"] for u in meta["urls"] if u["filename"] == fname)
        data = urllib.request.urlopen(urllib.parse.urljoin(meta_url, url)).read()
        if hashlib.sha256(data).hexdigest() != digest:
            sys.exit(f"corpus: {fname} does not match its recorded SHA-256; refusing")
        tmp = dest.with_suffix(".part")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
        print("fetched", fname, len(data), "bytes", flush=True)


def package_files(fname: str, digest: str) -> list[tuple[str, str]]:
    """[(member path, text)] of the usable Python files of one sdist."""
    import tarfile
    import zipfile

    path = DATA / fname
    if not path.exists():
        sys.exit(f"corpus: {path} is missing; run `corpus.py --fetch` first")
    if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
        sys.exit(f"corpus: {path} does not match its recorded SHA-256; refusing")
    members = []
    if fname.endswith(".zip"):
        with zipfile.ZipFile(path) as z:
            for n in sorted(z.namelist()):
                if n.endswith(".py"):
                    members.append((n, z.read(n)))
    else:
        with tarfile.open(path) as t:
            for m in sorted(t.getmembers(), key=lambda m: m.name):
                if m.isfile() and m.name.endswith(".py"):
                    members.append((m.name, t.extractfile(m).read()))
    out = []
    for n, data in members:
        if VENDORED & set(Path(n).parts) or len(data) > MAX_FILE or not data.strip():
            continue
        try:
            out.append((n, data.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return out


def load_split(split: str, packages: bool = True) -> list[tuple[str, str]]:
    """[(path, text)] of one split, after checking every file's hash; `packages=False`: the
    standard library's files only (the first stage's corpus)."""
    out = []
    for s, _, _, _, digest, fname in read_packages() if packages else []:
        if s == split:
            out.extend(package_files(fname, digest))
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
    ap.add_argument("--fetch", action="store_true", help="download the projects' sdists")
    args = ap.parse_args()
    if args.write_manifest:
        rows = write_manifest()
    if args.fetch:
        fetch_packages()
    rows = read_manifest()
    for split in ("train", "heldout", "foreign"):
        files = load_split(split)
        print(split, len(files), "files", sum(len(t.encode()) for _, t in files), "bytes")
