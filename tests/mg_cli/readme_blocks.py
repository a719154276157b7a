"""The shell lines of a README's code blocks, read the way the README tests read them."""

from __future__ import annotations

from pathlib import Path


def shell_lines(readme: Path) -> list[str]:
    """Every non-empty line of the README's plain or shell code blocks, continuation lines joined (the blocks
    also hold outputs and file listings; callers pick and split the lines they check)."""
    lines, block = [], None  # block: the language of the open fence ("" for plain, which holds commands)
    for line in readme.read_text().splitlines():
        if line.startswith("```"):
            block = line[3:].strip() if block is None else None
        elif block in ("", "sh", "bash"):
            lines.append(line)
    return [line for line in "\n".join(lines).replace("\\\n", " ").splitlines() if line.strip()]
