"""Write a small JSONL corpus of this machine's Python standard-library sources (no download).

    python examples/make_corpus.py corpus.jsonl             # about 1 MB: the README's quick path
    python examples/make_corpus.py corpus.jsonl --mb 50     # more text for a longer run

One ``{"text": ...}`` line per source file, in sorted path order, so the same Python installation
always gives the same file. Test packages and site-packages are left out. Only the standard library
is imported.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path


def write_corpus(out: Path, max_bytes: int) -> tuple[int, int]:
    """Write the standard library's ``.py`` files to ``out`` as JSONL until ``max_bytes`` of UTF-8 text.

    Returns:
        ``(documents, bytes)`` written.

    Raises:
        OSError: ``out`` cannot be written.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = total = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for path in sorted(root.rglob("*.py")):
            if total >= max_bytes:
                break
            if "test" in path.parts or "tests" in path.parts or "site-packages" in path.parts:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            if not text.strip():
                continue
            f.write(json.dumps({"text": text}) + "\n")
            docs += 1
            total += len(text.encode())
    return docs, total


def main() -> None:
    """Command line: ``make_corpus.py OUT [--mb MB]``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path, help="JSONL file to write")
    parser.add_argument("--mb", type=float, default=1.0, help="stop after this many MB of text (default: 1)")
    args = parser.parse_args()
    if args.mb <= 0:
        parser.error(f"--mb must be positive, got {args.mb}")
    try:
        docs, total = write_corpus(args.output, int(args.mb * 1e6))
    except OSError as e:
        sys.exit(f"Error: cannot write {args.output}: {e.strerror or e}")
    print(f"{args.output}: {docs} documents, {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
