"""The end-to-end demo behind `make demo`: runs every stage that exists so far."""

from __future__ import annotations

import subprocess
import sys


def main() -> None:
    subprocess.run([sys.executable, "-m", "mg_cli.main", "--help"], check=True)


if __name__ == "__main__":
    main()
