#!/usr/bin/env python3
"""Write the Engram token compression map of a tokenizer as a committed fixture.

The map is the published `CompressedTokenizer`'s (transcribed in engram_ref.py, run through
transformers' AutoTokenizer); keep-model's `engram_tokens` test compares its own map with it id
for id. Usage: engram_tokmap_fixture.py TOKENIZER_DIR OUT.json
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engram_ref import compressed_normalizer, load_compressed_token_map  # noqa: E402

# Texts that exercise every normaliser step beyond what a small English vocabulary reaches:
# compatibility forms, accents, non-Latin case, whitespace runs, the lone-space sentinel, and
# characters whose NFKC / case mapping changed across Unicode versions.
PROBES = [
    " Apple", "APPLE", "apple ", "École", "ÉCOLE\t\n", "naïve", "Ｈｅｌｌｏ", "ﬁne", "①②", "㎏",
    " ", "  ", "\n", "\t \r\n", " a  b ", "\u00a0", "\u3000x\u3000", "\u2028", "ΟΔΟΣ", "ς",
    "İstanbul", "ß", "ẞ", "Ǆ", "ǅ", "Å", "Å", "한국어", "ｶﾞ", "ｱｲｳ", "Ⅻ", "x²", "\u0301", "e\u0301",
    "\ue000", " \ue000 ", "\u1e9e", "ꭰ", "Ꭰ", "\U0001d400", "\U0001f600", "Ⓐ", "ℌ", "ǰ",
    "\u0130", "\u10a0", "\u1c90", "\ua7c0", "\U00010570", "\U0001e900", "ʼn", "\u0345",
    # Code points where other Unicode tables (the unicode-normalization crate's) disagree with the
    # published normaliser's.
    "\u0558", "\u058b", "\u05c8", "\u07fd", "\u0897", "\u08ca", "\u0cf3", "\u0d00",
    "a\u0897b", "\U00010780", "\U0001e4ec",
]


def main():
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    lookup, size = load_compressed_token_map(src)
    doc = {
        "source": "published CompressedTokenizer via tools/oracle/engram_ref.py",
        "tokenizer": src.name,
        "size": int(size),
        "map": [int(v) for v in lookup],
        "normalised": [[p, compressed_normalizer().normalize_str(p)] for p in PROBES],
    }
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    tmp.replace(out)
    print(f"{out}: {len(lookup)} ids -> {size} compressed ids")


if __name__ == "__main__":
    main()
