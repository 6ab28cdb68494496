"""The README's Layout names what is there, and everything the package has."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _layout() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    return [line for line in block.splitlines() if line.strip()]


def test_every_name_in_the_layout_exists():
    missing = []
    for line in _layout():
        if line.startswith("  ") and not line.startswith("   "):  # an entry of longstraw/
            name = line.split()[0]
            if not (REPO / "longstraw" / name).exists():
                missing.append(f"longstraw/{name}")
        elif not line.startswith(" ") and line != "longstraw/":
            for name in re.split(r"[ ,]+", re.split(r"\s{3,}", line)[0].strip()):
                if name and not (REPO / name).exists():
                    missing.append(name)
    assert not missing, f"the README's Layout names what does not exist: {missing}"


def test_the_layout_lists_every_part_of_the_package():
    listed = {line.split()[0].rstrip("/") for line in _layout() if line.startswith("  ") and not line.startswith("   ")}
    parts = {
        p.name if p.is_dir() else p.name
        for p in (REPO / "longstraw").iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))
    }
    parts = {p[:-3] if p.endswith(".py") else p for p in parts}
    listed = {p[:-3] if p.endswith(".py") else p for p in listed}
    assert parts <= listed, f"not in the README's Layout: {sorted(parts - listed)}"
