"""The README's pictures of the reports (`docs/report*.png`), taken from the rendered pages (`browser`): each
page's top and its memory-against-length figure, at the width the pages are measured at.

    take({"report": "reports/cpu/index.html", "report-h200": "reports/recorded-h200/index.html"}, "docs")
    # docs/report.png, docs/report-memory.png, docs/report-h200.png, docs/report-h200-memory.png
"""

from __future__ import annotations

from pathlib import Path

from longstraw.report import browser, memory_vs_length
from longstraw.report.figures import SUMMARY

# {suffix of the file's name: (the element shown alone, None: the page's top; the picture's height in px)}
SHOTS = {"": (None, 1800), "-memory": (f"{SUMMARY}-{memory_vs_length.FIGURE}", 1000)}


def take(pages: dict, out_dir) -> list[Path]:
    """`pages`: {name: a rendered page}; writes `<out_dir>/<name><suffix>.png` for each of SHOTS and returns
    their paths."""
    out_dir = Path(out_dir)
    return [
        browser.screenshot(page, out_dir / f"{name}{suffix}.png", element, height=height)
        for name, page in pages.items()
        for suffix, (element, height) in SHOTS.items()
    ]
