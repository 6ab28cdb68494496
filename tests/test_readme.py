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


def test_the_readme_is_a_front_page_without_timings():
    """At most ~120 lines, and no measured durations in it: they live in docs/timings.md, written from logs."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 130
    assert not re.findall(r"\d+ min \d+ s", text), "a timing in the README: scripts/timings.py writes docs/timings.md"
    assert "docs/timings.md" in text


def test_timings_are_read_from_the_logs(tmp_path):
    """scripts/timings.py: bash's `real` line and each pytest summary, as a hand-written log says them."""
    from script_module import load_script

    timings = load_script("scripts/timings.py")
    log = (
        "....\n1205 passed, 134 skipped, 8 warnings in 539.53s (0:08:59)\nAll checks passed!\n"
        "531 passed, 84 skipped, 724 deselected, 1 warning in 157.55s (0:02:37)\n\nreal\t17m4.520s\nuser\t20m1s\n"
    )
    assert timings.real_seconds(log) == 17 * 60 + 4.52
    assert timings.pytest_runs(log) == [
        {"passed": 1205, "skipped": 134, "seconds": 539.53},
        {"passed": 531, "skipped": 84, "deselected": 724, "seconds": 157.55},
    ]
    try:
        timings.real_seconds("1205 passed in 539.53s")
    except ValueError as exc:
        assert "time" in str(exc)
    else:
        raise AssertionError("a log without bash's `real` line was read")
