"""A rendered page as a reader's browser lays it out: Debian's headless Chromium, no driver or Python package.

`measure` loads a copy of the page with a script that, once the page has loaded, replaces the body with what it
measured (the page's height and width, the viewport's, each table's box, the section headings, each image's
source), and reads it back from `--dump-dom`. `screenshot` writes the window's picture of the page's top, or of
one element alone on it (the body's only child: a screenshot sees the window, not a scrolled page). The copy
carries a `<base>` so the page's relative links still resolve.

    facts = measure("reports/cpu/index.html")  # {"height", "width", "viewport", "tables", "h2", "images"}
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

WIDTH = 1400  # px: the window a reader measured the pages at
NAMES = ("chromium", "chromium-browser")
_MEASURE = """
window.addEventListener("load", () => {
  const page = document.documentElement;
  const facts = {
    height: page.scrollHeight, width: page.scrollWidth, viewport: page.clientWidth,
    tables: [...document.querySelectorAll("table")].map(t => {
      const box = t.getBoundingClientRect();
      return {id: t.id, left: box.left, right: box.right, rows: t.rows.length};
    }),
    h2: [...document.querySelectorAll("h2")].map(h => h.textContent.trim()),
    images: [...document.querySelectorAll("img")].map(i => ({src: i.getAttribute("src").slice(0, 64),
      loaded: i.complete && i.naturalWidth > 0, natural: i.naturalWidth, shown: i.getBoundingClientRect().width})),
  };
  document.body.textContent = JSON.stringify(facts);
});
"""
_ALONE = """
window.addEventListener("load", () => {
  const element = document.getElementById(%s);
  if (element) document.body.replaceChildren(element);
});
"""


def chromium() -> str | None:
    """The Chromium binary on PATH, or None."""
    return next((path for path in map(shutil.which, NAMES) if path), None)


def _run(page: Path, script: str, args: list[str], width: int, height: int) -> str:
    """Chromium headless on a copy of `page` with `script` run in it; its stdout."""
    binary = chromium()
    if binary is None:
        raise FileNotFoundError(f"no Chromium on PATH (looked for {', '.join(NAMES)})")
    page = Path(page).resolve()
    text = page.read_text(encoding="utf-8")
    text = text.replace("<head>", f'<head><base href="{page.parent.as_uri()}/">', 1)
    text = text.replace("</body>", f"<script>{script}</script></body>", 1)
    with tempfile.TemporaryDirectory(prefix="longstraw-browser-") as tmp:
        copy = Path(tmp) / page.name
        copy.write_text(text, encoding="utf-8")
        done = subprocess.run(
            [
                binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={Path(tmp) / 'profile'}",
                f"--window-size={width},{height}",
                "--virtual-time-budget=10000",  # the load event (every data: image decoded) before the output
                *args,
                copy.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
    if done.returncode != 0:
        raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def measure(page, width: int = WIDTH) -> dict:
    """What the page measures at `width` px: height and width of the whole page, the viewport's width, each
    table's {id, left, right, rows}, the h2 headings' text, each image's {src (its start), loaded, natural,
    shown} (widths in px)."""
    out = _run(Path(page), _MEASURE, ["--dump-dom"], width, 1000)
    body = re.search(r"<body[^>]*>(.*)</body>", out, re.S)
    if body is None:
        raise RuntimeError(f"chromium returned no page body: {out[:500]!r}")
    return json.loads(html.unescape(body.group(1)))


def screenshot(page, out, element: str | None = None, width: int = WIDTH, height: int = 1100) -> Path:
    """A `width` x `height` PNG of the page's top, or of the element with id `element` alone."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    script = _ALONE % json.dumps(element) if element else ""
    _run(Path(page), script, ["--hide-scrollbars", f"--screenshot={out}"], width, height)
    if not out.is_file():
        raise RuntimeError(f"chromium wrote no screenshot at {out}")
    return out
