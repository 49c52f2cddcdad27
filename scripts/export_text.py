"""Writes data/docstrings.txt: the documentation strings of a fixed list of Python standard-library modules,
the text the GPT examples (examples/*/train_gpt) learn to continue.

    python3 scripts/export_text.py [--out data/docstrings.txt]

Nothing is downloaded: the text comes from the running interpreter (inspect.getdoc of each module and of
its public classes, functions and methods, in name order), kept to printable ASCII so that one byte is
one token. The same Python version writes the same file.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import pathlib
import string

logger = logging.getLogger("torchpar.data")
REPO = pathlib.Path(__file__).resolve().parent.parent
MODULES = ["argparse", "bisect", "builtins", "collections", "contextlib", "csv", "dataclasses", "datetime",
           "decimal", "difflib", "enum", "fractions", "functools", "heapq", "inspect", "io", "itertools",
           "json", "logging", "math", "os", "pathlib", "pickle", "queue", "random", "re", "shutil", "socket",
           "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest",
           "urllib.parse", "zipfile"]
PRINTABLE = set(string.printable) - set("\x0b\x0c\r")


def documented(module_name: str) -> list[str]:
    """The module's docstring, then its public members' and their methods' (name order)."""
    module = importlib.import_module(module_name)
    texts = [inspect.getdoc(module) or ""]
    for name, member in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isclass(member) or inspect.isroutine(member)):
            continue
        texts.append(inspect.getdoc(member) or "")
        if inspect.isclass(member):
            for method_name, method in sorted(vars(member).items()):
                if not method_name.startswith("_") and inspect.isroutine(method):
                    texts.append(inspect.getdoc(method) or "")
    return texts


def corpus() -> str:
    seen, kept = set(), []
    for module_name in MODULES:
        for text in documented(module_name):
            text = "".join(c for c in text if c in PRINTABLE).strip()
            if len(text) >= 40 and text not in seen:  # inherited docstrings appear once
                seen.add(text)
                kept.append(text)
    return "\n\n".join(kept) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "data" / "docstrings.txt")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text = corpus()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="ascii")
    logger.info("wrote %s: %d KB of docstrings from %d modules", args.out, len(text) // 1024, len(MODULES))


if __name__ == "__main__":
    main()
