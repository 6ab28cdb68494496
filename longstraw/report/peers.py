"""The report's Peers section: the peers (`longstraw.peers`: TRL's GRPO loss path, PrefixGrouper) beside our
modes on the models a peer ran on, from every experiment's tables.

- Step rows (`step_rows`): each step point's memory and time, in the experiments that ran a peer's steps.
  Memory is the step's own: on CUDA the peak allocated over the step's phases, weights included, the same
  for every system (a step that ran out: the peak it reached then); on CPU the process peak RSS minus the
  RSS after the weights and a peer's setup (its imports and trainer), the capacity search's measure, so a
  peer's import footprint is not read as step memory (`peak_memory_bytes` keeps the whole process peak).
  Time: the step's phase seconds, the first step of the process (`cold_step_seconds`: cuDNN plans and Triton
  autotuning inside it) and, for a point of several cycles, the median of the others (`warm_step_seconds`).
- Capacity rows (`capacity_rows`): each capacity search's largest fitting prompt, grouped with the searches of
  other systems under the same ceiling, model, G and response length.
- Sentences (`sentences`): per peer, what it does differently (its `Peer.difference`), then what was measured
  against its replay point (the point named as its own with "replay" for the peer: the same settings), derived
  from the rows: the range of its memory and time
  over replay's, and every point where it is lighter or faster than replay (or than all of our modes).
- Not applicable: a peer that has no row on a model it does not apply to (`peers.not_applicable`).
"""

from __future__ import annotations

import textwrap

from longstraw.config.point import OUR_MODES
from longstraw.peers import PEER_MODES, not_applicable, peer
from longstraw.plotting.formatting import format_bytes
from longstraw.report.aggregate import records
from longstraw.report.store import Tables
from longstraw.results import number

FIGURES = "peers-section"  # the figures' manifest key (not an experiment's name)
CAPTIONS = {
    "peers_memory": "Step memory per system against prompt length at the largest G measured (left) and against G "
    "at the longest prompt (right), one panel row per model. CUDA: peak allocated over the step; "
    "CPU: process peak RSS above the RSS after the weights and a peer's setup. Crosses: out of "
    "memory. Dashed: the device ceiling; dotted: a capacity search's own (on CPU an emulated one).",
    "peers_time": "Step time per system (the step's phases: capture, scoring, replay or the peers' forward and "
    "backward, optimizer step; process start, model load and a peer's setup left out) against prompt "
    "length at the largest G (left) and against G at the longest prompt (right).",
}
STEP_COLUMNS = [
    "model",
    "system",
    "prompt_length",
    "G",
    "response_length",
    "status",
    "step_bytes",
    "peak_memory_bytes",
    "setup_rss_bytes",
    "step_seconds",
    "warm_step_seconds",
    "memory_over_replay_ratio",
    "time_over_replay_ratio",
    "warm_time_over_replay_ratio",
    "experiment",
    "point",
]
CAPACITY_COLUMNS = [
    "model",
    "system",
    "G",
    "response_length",
    "ceiling_bytes",
    "memory_measure",
    "largest_fitting",
    "smallest_oom",
    "search_stopped_on_time_limit",
    "experiment",
    "point",
]


def _frame_rows(tables: Tables, name: str) -> list[dict]:
    return records(tables.frame(name)) if name in tables.names else []


def _all_rows(tables: Tables):
    for experiment in tables.manifest["experiments"]:
        for row in _frame_rows(tables, experiment):
            yield experiment, row


def _systems() -> tuple[str, ...]:
    """Our modes, then the registered peers."""
    return OUR_MODES + tuple(PEER_MODES)


def _label(system: str) -> str:
    """A system's name in the sentences and legends: a peer's label, our mode's name."""
    return peer(system).shown if system in PEER_MODES else system


def peer_models(tables: Tables) -> list[str]:
    """The models a peer point ran on, in the order they first appear."""
    return list(
        dict.fromkeys(
            row.get("model")
            for _, row in _all_rows(tables)
            if row.get("mode") in PEER_MODES and row.get("kind") in ("step", "capacity")
        )
    )


def step_rows(tables: Tables) -> list[dict]:
    """Every single-process step point of the systems in the experiments where a peer's step ran (see the
    module doc): the side-by-side points, one objective and response length per experiment."""
    compared = {
        experiment
        for experiment, row in _all_rows(tables)
        if row.get("kind") == "step" and row.get("mode") in PEER_MODES
    }
    out = []
    for experiment, row in _all_rows(tables):
        if (
            experiment not in compared
            or row.get("kind") != "step"
            or row.get("mode") not in _systems()
            or (number(row.get("cp_size")) or 1) > 1
            or row.get("source", "seeded") != "seeded"
        ):
            continue
        # "peak_allocated_bytes", or "... at OOM" for a step that ran out (aggregate.point_row)
        cuda = str(row.get("peak_memory_measure") or "").startswith("peak_allocated_bytes")
        setup = number(row.get("peer_setup_peak_rss_bytes")) or number(row.get("weights_peak_rss_bytes"))
        peak = number(row.get("peak_memory_bytes"))
        out.append(
            {
                "experiment": experiment,
                "point": row.get("point"),
                "model": row.get("model"),
                "model_type": row.get("model_type"),
                "system": row["mode"],
                "status": row.get("status"),
                "prompt_length": number(row.get("prompt_length")),
                "G": number(row.get("G")),
                "response_length": number(row.get("response_length")),
                "cuda": cuda,
                "peak_memory_bytes": peak,
                "setup_rss_bytes": None if cuda else setup,
                "step_bytes": peak if cuda else (peak - setup if peak is not None and setup is not None else None),
                "step_seconds": number(row.get("cold_step_seconds")),
                "warm_step_seconds": number(row.get("warm_step_seconds")),
            }
        )
    _add_ratios(out)
    return out


def _cell(row: dict) -> tuple:
    return row["model"], row["prompt_length"], row["G"], row["response_length"]


def _add_ratios(rows: list[dict]) -> None:
    """Each ok row's memory and time over its replay point's (`_replay_twin`); None for replay's own rows."""
    replay = [r for r in rows if r["system"] == "replay" and r["status"] == "ok"]
    for row in rows:
        base = _replay_twin(row, replay) if row["system"] != "replay" else None
        ok = row["status"] == "ok" and base is not None
        row["memory_over_replay_ratio"] = _ratio(row["step_bytes"], base["step_bytes"]) if ok else None
        row["time_over_replay_ratio"] = _ratio(row["step_seconds"], base["step_seconds"]) if ok else None
        row["warm_time_over_replay_ratio"] = (
            _ratio(row.get("warm_step_seconds"), base.get("warm_step_seconds")) if ok else None
        )


def _replay_twin(row: dict, replay: list[dict]) -> dict | None:
    """The replay point a row is compared with: the point of its experiment named as it is with its system
    replaced by "replay" (`..._mode-prefix_grouper_length-8192` -> `..._mode-replay_length-8192`: the same
    settings otherwise), else the one replay point at its model, prompt, G and response length (None when
    there are several: which of them a ratio would mean is not known)."""
    named = str(row["point"]).replace(row["system"], "replay")
    twin = [r for r in replay if r["experiment"] == row["experiment"] and r["point"] == named]
    same_cell = [r for r in replay if _cell(r) == _cell(row)]
    return twin[0] if twin else (same_cell[0] if len(same_cell) == 1 else None)


def _ratio(a, b):
    return a / b if a is not None and b else None


def capacity_rows(tables: Tables) -> list[dict]:
    """Every capacity search of the systems on the peers' models, with what it was searched under."""
    models = peer_models(tables)
    return [
        {
            "experiment": experiment,
            "point": row.get("point"),
            "model": row.get("model"),
            "system": row["mode"],
            "status": row.get("status"),
            "G": number(row.get("G")),
            "response_length": number(row.get("response_length")),
            "ceiling_bytes": number(row.get("ceiling_bytes")) or number(row.get("device_memory_bytes")),
            "memory_measure": row.get("memory_measure"),
            "largest_fitting": number(row.get("largest_fitting")),
            "smallest_oom": number(row.get("smallest_oom")),
            "search_stopped_on_time_limit": row.get("search_stopped_on_time_limit"),
        }
        for experiment, row in _all_rows(tables)
        if row.get("kind") == "capacity" and row.get("model") in models and row.get("mode") in _systems()
    ]


def not_applicable_rows(tables: Tables) -> list[dict]:
    """{model, system, reason} for each peer without a row on a model it does not apply to."""
    ran = {(r.get("model"), r.get("mode")) for _, r in _all_rows(tables)}
    types = {r.get("model"): r.get("model_type") for _, r in _all_rows(tables) if r.get("model_type")}
    return [
        {"model": model, "system": name, "reason": reason}
        for model in peer_models(tables)
        for name in PEER_MODES
        if (model, name) not in ran and (reason := not_applicable(name, str(types.get(model))))
    ]


def _where(row: dict) -> str:
    return f"P={int(row['prompt_length']):,} G={int(row['G'])}"


def _points(n: int) -> str:
    return f"{n} point" if n == 1 else f"{n} points"


def _span(values) -> str:
    low, high = min(values), max(values)
    return f"{low:.2f}x" if abs(high - low) < 0.005 else f"{low:.2f}-{high:.2f}x"


def peer_sentences(name: str, rows: list[dict]) -> list[str]:
    """What was measured for peer `name` against our modes, per model, from the step rows."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows if r["system"] == name):
        mine = [r for r in rows if r["model"] == model]
        theirs = [r for r in mine if r["system"] == name]
        ours = _ours_by_cell(mine)
        paired = [r for r in theirs if r["memory_over_replay_ratio"] is not None]
        if paired:
            out.append(_against_replay(model, name, paired, ours))
        failed = [r for r in theirs if r["status"] != "ok"]
        if failed:
            out.append(_not_completed(model, name, failed, ours))
    return out


def _ours_by_cell(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Our modes' completed rows, by model, prompt, G and response length."""
    ours = {}
    for r in rows:
        if r["system"] in OUR_MODES and r["status"] == "ok":
            ours.setdefault(_cell(r), []).append(r)
    return ours


def _against_replay(model: str, name: str, paired: list[dict], ours: dict) -> str:
    """The span of the peer's memory and time over replay's, then where it is lighter and where faster."""
    memory = [r["memory_over_replay_ratio"] for r in paired]
    time = [r["time_over_replay_ratio"] for r in paired if r["time_over_replay_ratio"] is not None]
    warm = [r["warm_time_over_replay_ratio"] for r in paired if r["warm_time_over_replay_ratio"] is not None]
    text = (
        f"On {model}, against replay at the same prompt and G ({_points(len(paired))}): {_label(name)}'s step "
        f"memory is {_span(memory)} replay's"
        + (f" and its step time {_span(time)}" if time else "")
        + (f"; its warm step (the median after the first, {_points(len(warm))}) {_span(warm)}" if warm else "")
        + "."
    )
    for ratio, key, word in (
        ("memory_over_replay_ratio", "step_bytes", "lighter"),
        ("time_over_replay_ratio", "step_seconds", "faster"),
    ):
        text += " " + _where_better(paired, ours, ratio, key, word)
    return text


def _where_better(paired: list[dict], ours: dict, ratio: str, key: str, word: str) -> str:
    """Where the peer's `ratio` over replay is below 1, and where it beats every one of our modes too."""
    better = [r for r in paired if r[ratio] is not None and r[ratio] < 1]
    if not better:
        return f"It is {word} than replay at none of them."
    best = [r for r in better if all(o[key] is not None and r[key] < o[key] for o in ours[_cell(r)])]
    return (
        f"It is {word} than replay at {', '.join(_where(r) for r in better)}"
        + (
            f", {word} than every one of our modes measured there at {', '.join(_where(r) for r in best)}"
            if best
            else ""
        )
        + "."
    )


def _not_completed(model: str, name: str, failed: list[dict], ours: dict) -> str:
    """Where the peer's step did not complete, and where replay's did there."""
    fits = [r for r in failed if _replay(ours, r)]
    return (
        f"On {model}, {_label(name)} did not complete at {', '.join(_where(r) for r in failed)} "
        f"({', '.join(sorted({str(r['status']) for r in failed}))})"
        + (f", where replay did at {', '.join(_where(r) for r in fits)}" if fits else "")
        + "."
    )


def _replay(ours: dict, row: dict) -> dict | None:
    return next((o for o in ours.get(_cell(row), []) if o["system"] == "replay"), None)


def capacity_sentences(rows: list[dict]) -> list[str]:
    """Per group of searches under one ceiling, model, G and response length: each system's largest prompt
    (a system searched more than once there, e.g. by whole steps and by one member per probe: each search
    named by its point)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["status"] == "ok":
            groups.setdefault((row["model"], row["ceiling_bytes"], row["G"], row["response_length"]), []).append(row)
    out = []
    for (model, ceiling, g, length), members in groups.items():
        if not any(r["system"] in PEER_MODES for r in members):
            continue
        searches = [r["system"] for r in members]  # a system searched twice is told apart by its point
        reach = [
            _label(r["system"])
            + (f" ({r['experiment']}/{r['point']})" if searches.count(r["system"]) > 1 else "")
            + f" {_reach(r)}"
            for r in sorted(members, key=lambda r: _systems().index(r["system"]))
        ]
        out.append(
            f"Largest prompt whose G={int(g)} step fits under {format_bytes(ceiling)} on {model} "
            f"(responses of {int(length)} tokens): " + "; ".join(reach) + "."
        )
    return out


def _reach(row: dict) -> str:
    largest = row["largest_fitting"]
    if largest is None:
        return "none of the probed lengths" + (
            f" (the shortest, {int(row['smallest_oom']):,}, ran out)" if row["smallest_oom"] else ""
        )
    limit = " (its search stopped on its time limit there)" if row["search_stopped_on_time_limit"] else ""
    return f"{int(largest):,} positions{limit}"


def sentences(steps: list[dict], capacity: list[dict], skipped: list[dict]) -> dict[str, list[str]]:
    """{peer: [what it does differently, then what was measured]}, for each peer with a row or a reason."""
    out = {}
    for name in PEER_MODES:
        measured = peer_sentences(name, steps)
        reasons = [f"Not applicable to {r['model']}: {r['reason']}." for r in skipped if r["system"] == name]
        if measured or reasons or any(r["system"] == name for r in capacity):
            out[name] = [peer(name).difference] + measured + reasons
    return out


# ------------------------------------------------------------------------------------------ figures


def _longest(rows, key):
    values = [r[key] for r in rows if r[key] is not None]
    return max(values) if values else None


def figures(tables: Tables, ceiling: dict):
    """(name, figure) for the section's two figures; none without a peer row."""
    rows = step_rows(tables)
    if not any(r["system"] in PEER_MODES for r in rows):
        return
    searched = {}  # model -> the configured ceilings its capacity searches ran under (CPU: emulated ones)
    for r in capacity_rows(tables):
        if r["ceiling_bytes"] and r["memory_measure"] and not str(r["memory_measure"]).startswith("peak_allocated"):
            searched.setdefault(r["model"], set()).add(r["ceiling_bytes"])
    yield "peers_memory", _plot(rows, "step_bytes", ceiling, searched)
    yield "peers_time", _plot(rows, "step_seconds", None, {})


def _plot(rows: list[dict], key: str, ceiling: dict | None, searched: dict):
    """One panel row per model: `key` against prompt length at its largest G, and against G at its longest prompt."""
    from longstraw.plotting import draw

    models = list(dict.fromkeys(r["model"] for r in rows))
    # the page's width at 1,400 px (12 inches at 110 dpi): shown at the size drawn
    fig, axes = draw.plt.subplots(len(models), 2, figsize=(12, 0.5 + 3.3 * len(models)), squeeze=False)
    memory = key == "step_bytes"
    device = (ceiling or {}).get("bytes") if memory else None
    values = [r[key] for r in rows] + ([device] if device else []) + [v for s in searched.values() for v in s]
    axis = draw.memory_axis(values) if memory else None
    for line, model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model]
        for ax, x_key, fixed_key in ((line[0], "prompt_length", "G"), (line[1], "G", "prompt_length")):
            fixed = _longest(mine, fixed_key)
            cut = [r for r in mine if r[fixed_key] == fixed]
            scale = axis.scale if axis else 1.0
            _draw_systems(ax, cut, x_key, key, scale, memory)
            if device:
                label = textwrap.fill(f"ceiling: {ceiling['label']}", 44)
                ax.axhline(device / scale, color="black", linestyle="--", linewidth=1, label=label)
            for value in sorted(searched.get(model, ())):
                label = f"capacity search ceiling {format_bytes(value)}"
                ax.axhline(value / scale, color="black", linestyle=":", linewidth=1, label=label)
            _finish_panel(ax, cut, x_key, axis)
            fixed_text = f"G={int(fixed)}" if fixed_key == "G" else f"P={int(fixed):,}"
            ax.set_title(f"{model}, {fixed_text}", fontsize=9)
    draw.legend_outside(axes[0][1], *draw.shared_legend(list(axes.flat)))
    fig.suptitle("Peers: step memory" if memory else "Peers: step time", fontsize=10)
    return fig


def _draw_systems(ax, cut: list[dict], x_key: str, key: str, scale: float, memory: bool) -> None:
    """One line per system over its completed rows (a peer's dashed), and a marker at each row that did not."""
    from longstraw.plotting import draw

    for system in _systems():
        ok = sorted(
            (r for r in cut if r["system"] == system and r["status"] == "ok" and r[key] is not None),
            key=lambda r: r[x_key],
        )
        if ok:
            ax.plot(
                [r[x_key] for r in ok],
                [r[key] / scale for r in ok],
                marker="o",
                label=_label(system),
                color=draw.MODE_COLORS.get(system),
                linestyle="--" if system in PEER_MODES else "-",
            )
    for r in cut:
        if r["status"] != "ok":
            draw.mark_failed(ax, r[x_key], r, scale, value_key=key if memory else None)


def _finish_panel(ax, cut: list[dict], x_key: str, axis) -> None:
    """A log-2 x axis ticked at the measured values; the memory axis's units, or step seconds from zero."""
    ax.set_xscale("log", base=2)
    xs = sorted({r[x_key] for r in cut if r[x_key] is not None})
    ax.set_xticks(xs, [f"{int(x):,}" for x in xs])
    ax.set_xlabel("prompt length (positions)" if x_key == "prompt_length" else "G (responses per prompt)")
    if axis:
        axis.finish(ax)
    else:
        ax.set_ylim(bottom=0)
        ax.set_ylabel("step seconds (s)")


# ------------------------------------------------------------------------------------------- page


def view(tables: Tables) -> dict | None:
    """What the page's Peers section shows (None: no peer ran)."""
    steps = step_rows(tables)
    capacity = capacity_rows(tables)
    if not any(r["system"] in PEER_MODES for r in steps + capacity):
        return None
    skipped = not_applicable_rows(tables)
    order = {s: i for i, s in enumerate(_systems())}
    steps.sort(key=lambda r: (str(r["model"]), r["G"] or 0, r["prompt_length"] or 0, order[r["system"]]))
    return {
        "sentences": sentences(steps, capacity, skipped),
        "capacity_sentences": capacity_sentences(capacity),
        "steps": steps,
        "capacity": capacity,
        "not_applicable": skipped,
    }
