"""Write tasks/heldout-functions.json: a `keep eval --tasks` spec whose prompts are the
headers of real functions the model never trained on.

    .venv/bin/python heldout_tasks.py --out ../../tasks/heldout-functions.json

From the `heldout` (standard library files held out) and `foreign` (projects never trained on)
splits of corpus.py, every top-level function with a docstring whose header (the `def` line(s)
and the docstring) is at most 400 characters is a candidate; --per-split of each split are
picked with a seeded RNG (sorted by path and line first, so the pick is the same on every
machine). Each prompt is the header exactly as written in its file, and its check is that the
prompt plus the completion parses as Python. The completion is cut at the spec's stop strings
(the next top-level statement), so a model passes by writing a body that closes.
"""
import argparse
import ast
import json
import random
from pathlib import Path

from corpus import load_split

HERE = Path(__file__).resolve().parent
MAX_HEADER = 400


def candidates(split):
    out = []
    for path, text in load_split(split):
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.decorator_list:
                continue
            doc = node.body[0] if node.body else None
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)) or len(node.body) < 2:
                continue
            header = "".join(lines[node.lineno - 1:doc.end_lineno])
            if len(header) > MAX_HEADER or "\t" in header:
                continue
            out.append((path, node.lineno, node.name, header))
    return sorted(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE.parent.parent / "tasks" / "heldout-functions.json"))
    ap.add_argument("--per-split", type=int, default=6)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=20261207)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tasks = []
    for split in ("heldout", "foreign"):
        cands = candidates(split)
        for path, line, name, header in rng.sample(cands, args.per_split):
            tasks.append({"name": f"{split} {path}:{line} {name}", "prompt": header,
                          "check": {"kind": "parses"}})
        print(f"{split}: {len(cands)} candidates")
    spec = {"format": "keep-tasks", "version": 1, "samples": args.samples, "max_tokens": 128,
            "temperature": 0.6, "top_p": 0.95, "seed": 1,
            "stop": ["\n\n\n", "\ndef ", "\nclass ", "\nif __name__", "\n@"],
            "tasks": tasks}
    body = ",\n".join("    " + json.dumps(t, ensure_ascii=False) for t in tasks)
    text = json.dumps({k: v for k, v in spec.items() if k != "tasks"}, indent=2)[:-2]
    Path(args.out).write_text(text + ',\n  "tasks": [\n' + body + "\n  ]\n}\n")
    print("wrote", args.out, len(tasks), "tasks")


if __name__ == "__main__":
    main()
