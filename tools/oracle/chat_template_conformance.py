#!/usr/bin/env python3
"""keep's chat templates against transformers' on the publishers' own templates.

`keep serve` (and `keep chat-template`, which prints what it sends) renders a model's
`chat_template` with minijinja in Hugging Face's dialect. This checks, for the chat templates
the families keep runs are published with, that keep's rendering of a set of chats equals
transformers' `render_jinja_template` (what `apply_chat_template(add_generation_prompt=True)`
runs) character for character.

The templates are not committed: they are read from llama.cpp's copies of the publishers'
templates (`models/templates/`) as llama-cpp-python's source distribution on PyPI vendors
them, fetched once into tools/oracle/.cache and checked against the pinned SHA-256 of the
archive and of each template.

    tools/oracle/.venv/bin/python tools/oracle/chat_template_conformance.py [--keep target/release/keep]
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from transformers.utils.chat_template_utils import render_jinja_template

ROOT = Path(__file__).resolve().parents[2]
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_URL = ("https://files.pythonhosted.org/packages/ec/e9/"
             "e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
             f"llama_cpp_python-{SDIST_VERSION}.tar.gz")
TEMPLATE_DIR = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/models/templates/"

# template file -> (model, keep's family, bos_token, eos_token, SHA-256 of the template)
TEMPLATES = {
    "deepseek-ai-DeepSeek-V3.1.jinja": (
        "DeepSeek-V3.1", "deepseek_v3", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
        "d9f5f351b276cf9e81d009db08830db7d38e94927aecd09a7beb43e2aafee94e"),
    "moonshotai-Kimi-K2.jinja": (
        "Kimi-K2-Instruct", "deepseek_v3", "[BOS]", "[EOS]",
        "9fcc72b7c248a72020c81f70bb652f3094d18a750c93ca35dfcb3cf5fe23ff53"),
    "openai-gpt-oss-120b.jinja": (
        "gpt-oss-120b", "gpt_oss", "<|startoftext|>", "<|return|>",
        "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"),
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": (
        "DeepSeek-V4-Flash", "deepseek_v4", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
        "aec3d906bce80d43a9e6e89922c04e8e752c05f71f10040ba3f61b746ebacd6d"),
    "Qwen-Qwen3-0.6B.jinja": (
        "Qwen3", "qwen3_moe", None, "<|im_end|>",
        "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"),
}

CHATS = {
    "one user turn": [{"role": "user", "content": "Hello"}],
    "system and user": [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": "What is 2+2?"}],
    "multi-turn": [{"role": "system", "content": "You are terse."},
                   {"role": "user", "content": "Write a loop"},
                   {"role": "assistant", "content": "for i in range(3):\n    print(i)"},
                   {"role": "user", "content": "Now \"reverse\" it, ünïcödé ✓ {{ not jinja }}"}],
    "whitespace and an empty turn": [
        {"role": "user", "content": "  leading and trailing  \n"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "\n\nagain\t"}],
    "content parts": [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                                    {"type": "text", "text": "part two"}]}],
}

FAILED = []


def check(name, ok, detail=""):
    if not ok:
        FAILED.append(name)
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def sdist(cache):
    """The pinned archive: from KEEP_LCP_SDIST if set, else the cache, else PyPI."""
    given = os.environ.get("KEEP_LCP_SDIST")
    path = Path(given) if given else cache / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".part")
        print(f"fetching {SDIST_URL}", flush=True)
        with urllib.request.urlopen(SDIST_URL, timeout=300) as r, open(part, "wb") as f:
            while chunk := r.read(1 << 20):
                f.write(chunk)
        part.rename(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    if h.hexdigest() != SDIST_SHA256:
        sys.exit(f"{path}: SHA-256 {h.hexdigest()}, pinned {SDIST_SHA256}")
    return path


def templates(archive):
    out = {}
    with tarfile.open(archive) as t:
        for name in TEMPLATES:
            src = t.extractfile(TEMPLATE_DIR + name).read()
            digest = hashlib.sha256(src).hexdigest()
            if digest != TEMPLATES[name][4]:
                sys.exit(f"{name}: SHA-256 {digest}, pinned {TEMPLATES[name][4]}")
            out[name] = src.decode()
    return out


def flat(messages):
    """The messages as transformers' template sees a plain text chat (parts joined, as keep
    serve flattens them)."""
    out = []
    for m in messages:
        c = m["content"]
        if isinstance(c, list):
            c = "".join(p["text"] for p in c if p.get("type") == "text")
        out.append({"role": m["role"], "content": c})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", default=str(ROOT / "target/release/keep"))
    args = ap.parse_args()
    srcs = templates(sdist(ROOT / "tools/oracle/.cache"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, src in srcs.items():
            model, family, bos, eos, _ = TEMPLATES[name]
            d = tmp / name.removesuffix(".jinja")
            d.mkdir()
            (d / "chat_template.jinja").write_text(src)
            (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))
            for chat, messages in CHATS.items():
                want, _ = render_jinja_template(conversations=[flat(messages)], chat_template=src,
                                                add_generation_prompt=True,
                                                bos_token=bos, eos_token=eos)
                want = want[0]
                (d / "messages.json").write_text(json.dumps(messages))
                r = subprocess.run([args.keep, "chat-template", str(d), "--messages",
                                    str(d / "messages.json")], capture_output=True)
                got = r.stdout.decode()
                ok = r.returncode == 0 and got == want
                detail = ""
                if r.returncode != 0:
                    detail = r.stderr.decode().strip()
                elif not ok:
                    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                              min(len(got), len(want)))
                    detail = f"first difference at {at}: keep {got[at:at + 40]!r}, transformers {want[at:at + 40]!r}"
                check(f"{model} ({family}), {chat}: keep chat-template == transformers", ok, detail)
    print(f"{len(TEMPLATES) * len(CHATS) - len(FAILED)} passed, {len(FAILED)} failed")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
