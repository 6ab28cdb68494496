"""A context assembled to an exact token length, with the needles at their depths.

The prompt is planned from token counts (the template, each needle, each haystack unit, cached in
`haystacks`; where the context meets the template the joins are counted as they stand), so it is never
re-tokenized as it grows; then the whole prompt is tokenized once. Counts add up exactly where the
tokenizer splits text at spaces and newlines before it merges (byte-level BPE: GPT-2, Llama 3, Qwen,
SmolLM2), and that one tokenization is the last. Where they do not (a SentencePiece-style tokenizer
that merges across a newline), only the end of the haystack is changed: the tokens before a point near
it are taken from that tokenization, the text after it is tokenized again for each end tried (first
by the counts, then cuts of the last unit found by bisection), and the whole prompt once more to check.
The length is exact, or within `TOLERANCE` tokens where no end reaches it (an error otherwise).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from longstraw.training.ruler.haystacks import Haystack
from longstraw.training.ruler.tokens import Counter

ROUNDS = 3
TOLERANCE = 2  # tokens; reached only where a tokenizer merges across every place the end can be cut
MAX_SCAN = 48  # cuts probed one by one where a bisection missed
SMALL = 4096  # below this many haystack tokens the whole context is re-tokenized (cheap) instead


class TooShort(ValueError):
    pass


@dataclass(frozen=True)
class Needle:
    text: str
    depth: float  # share of the haystack's tokens before it, in [0, 1]


@dataclass(frozen=True)
class Layout:
    m: int  # whole haystack units
    filler: tuple[str, ...] = ()  # what ends the haystack after them
    counts: tuple[int, ...] = ()  # their tokens

    @property
    def filler_count(self) -> int:
        return sum(self.counts)


@dataclass
class Assembled:
    text: str  # the string the prompt is counted as
    length: int  # its tokens, measured
    context: tuple[int, int]  # where the context is in `text`
    needles: list[tuple[int, int]]  # where each needle is (needle order)
    haystack_tokens: int  # planned tokens of the haystack (needles left out)
    ids: list[int] = field(default_factory=list, repr=False)  # `text` tokenized as it was measured


def _fillers(hay: Haystack, m: int, need: int, way: str):
    """Layouts of unit m's whole predecessors and a filler of exactly `need` tokens, best first."""
    if need == 0:
        yield Layout(m)
    if need <= 0:
        return
    if way == "pick":
        yield from _picks(hay.pool(m), need, m)
        return
    for text, count in hay.prefixes(m, fine=way == "chars"):
        if count == need:
            yield Layout(m, (text,), (count,))


def _picks(pool: list[tuple[str, int]], need: int, m: int, most: int = 20):
    """Sets of k <= `most` units of the pool whose counts add up to `need`: one or two looked up; more,
    the k nearest need / k, then one swap at a time towards the sum (counts close together, as distractor
    needles' are, reach every sum between k * min and k * max)."""
    counts = [c for _, c in pool]
    by_count: dict[int, list[int]] = {}
    for i, c in enumerate(counts):
        by_count.setdefault(c, []).append(i)
    for i in by_count.get(need, []):
        yield Layout(m, (pool[i][0],), (need,))
    for i, c in enumerate(counts):
        for j in by_count.get(need - c, []):
            if j > i:
                yield Layout(m, (pool[i][0], pool[j][0]), (c, counts[j]))
    low, high = min(counts), max(counts)
    for k in range(3, most + 1):
        if not k * low <= need <= k * high:
            continue
        chosen = set(sorted(range(len(pool)), key=lambda i: (abs(counts[i] - need / k), i))[:k])
        total = sum(counts[i] for i in chosen)
        for _ in range(4 * k):
            gap = need - total
            if gap == 0:
                break
            out_by = {counts[i]: i for i in sorted(chosen)}
            in_by = {counts[i]: i for i in range(len(pool)) if i not in chosen}
            change, o, i = min(
                ((ci - co, o, i) for co, o in out_by.items() for ci, i in in_by.items()),
                key=lambda t: (abs(gap - t[0]), t[1], t[2]),
            )
            if abs(gap - change) >= abs(gap):
                break
            chosen.remove(o)
            chosen.add(i)
            total += change
        if total == need:
            yield Layout(m, tuple(pool[i][0] for i in sorted(chosen)), tuple(counts[i] for i in sorted(chosen)))


def _closest_below(hay: Haystack, m: int, need: int) -> Layout:
    options = hay.pool(m) if "pick" in hay.fillers else hay.prefixes(m, fine=True)
    fits = [(c, t) for t, c in options if c <= need]
    if not fits:
        return Layout(m)
    count, text = max(fits)
    return Layout(m, (text,), (count,))


def solve(hay: Haystack, cum: list[int], want: int, lowest: int = 0, avoid=()) -> Layout:
    """Whole units then a filler with exactly `want` haystack tokens by the counts (the nearest below when
    no filler fits), at least `lowest` whole units, none of the layouts in `avoid` (tried already)."""
    m0 = max(lowest, min(bisect_right(cum, want) - 1, len(cum) - 2))
    for way in hay.fillers:  # in the haystack's order of preference
        back = 16 if way == "pick" else 6  # picks of nearly equal counts may need to replace a few units
        near = sorted(range(max(lowest, m0 - back), min(m0 + 2, len(cum) - 2) + 1), key=lambda m: (abs(m - m0), -m))
        for m in near:
            for found in _fillers(hay, m, want - cum[m], way):
                if found not in avoid:
                    return found
    return _closest_below(hay, m0, want - cum[m0])


def place(needles: list[Needle], cum: list[int], layout: Layout) -> list[int]:
    """Each needle's slot: the haystack item it goes before (the item count: the end), the boundary
    whose share of the haystack's tokens is nearest its depth."""
    bounds = cum[: layout.m + 1]
    for c in layout.counts:
        bounds.append(bounds[-1] + c)
    total = bounds[-1]
    slots = []
    for n in needles:
        goal = n.depth * total
        i = bisect_left(bounds, goal)
        if i == len(bounds) or (i > 0 and goal - bounds[i - 1] <= bounds[i] - goal):
            i -= 1
        slots.append(i)
    return slots


def render(hay: Haystack, layout: Layout, needles: list[Needle], slots: list[int], before: str, after: str):
    """(text, context span, needle spans, char where the separator before each haystack item starts,
    the context's first item)."""
    units = [hay.unit(i) for i in range(layout.m)] + list(layout.filler)
    end = len(units)
    at: dict[int, list[int]] = {}
    for j, s in enumerate(slots):
        at.setdefault(min(s, end), []).append(j)
    items, kinds = [], []  # kinds: ("hay", i) or ("needle", j)
    for p in range(end + 1):
        for j in sorted(at.get(p, []), key=lambda j: (needles[j].depth, j)):
            items.append(needles[j].text)
            kinds.append(("needle", j))
        if p < end:
            items.append(units[p])
            kinds.append(("hay", p))
    items = hay.decorate(items)
    pos, starts = len(before), []
    for k, item in enumerate(items):
        starts.append(pos + (len(hay.sep) if k else 0))
        pos = starts[-1] + len(item)
    context = hay.sep.join(items)
    text = before + context + after
    spans, hay_starts = [None] * len(needles), {}
    for k, ((kind, i), start, item) in enumerate(zip(kinds, starts, items)):
        if kind == "needle":
            spans[i] = (start, start + len(item))
        else:
            hay_starts[i] = start - (len(hay.sep) if k else 0)
    return text, (len(before), len(before) + len(context)), spans, hay_starts, items[:1] + items[-1:]


def _edges(counter: Counter, sep: str, before: str, after: str, first: list[str]) -> int:
    """What the plan's counts miss where the context meets the template: an item is counted as it stands
    after a separator, and the template's text beside it can merge with it (a blank line before the
    first item, a space before the question)."""
    if not first:
        return 0
    if len(first) == 1:
        item = first[0]
        return (
            counter.count(before + item + after)
            - counter.count(before)
            - counter.count(after)
            - counter.count(sep + item)
        )
    head, last = first
    return (
        counter.count(before + head)
        - counter.count(before)
        - counter.count(sep + head)
        + counter.count(sep + last + after)
        - counter.count(sep + last)
        - counter.count(after)
    )


def _refit(
    counter, hay, cum, layout, needles, slots, before, after, target, text, measured, starts, span, special_tokens
):
    """(a layout whose prompt has `target` tokens, the counts), after a whole-prompt tokenization that
    disagreed with the plan. Only the end of the haystack changes: the tokens before a point near it are
    the tokenization's, the text after it is tokenized again for each layout tried (a probe). First
    layouts by the counts; where none probes right, unit m cut short where a bisection of probes says."""
    error = target - measured.length
    haystack = cum[layout.m] + layout.filler_count
    z = 0 if haystack < SMALL else min(layout.m, max(0, bisect_left(cum, cum[layout.m] - abs(error)) - 8))
    cut = starts.get(z, span[0]) if z else span[0]
    split = measured.split(cut)
    if split is None:  # a slow tokenizer: count what comes before once more
        k = counter.measure(text[:cut], special_tokens).length - (counter.special_after if special_tokens else 0)
        split = (k, cut)
    k, char = split
    bias = measured.length - k - counter.count(text[char:])  # what the tail alone misses (special tokens ...)

    def probe(lay: Layout) -> int:
        return k + bias + counter.count(render(hay, lay, needles, slots, before, after)[0][char:])

    length, best, tried = measured.length, (abs(error), layout), {layout}
    for _ in range(12):
        if length == target:
            return layout, cum
        want = cum[layout.m] + layout.filler_count + (target - length)
        if want >= cum[-1]:
            cum = hay.cumulative(want)
        layout = solve(hay, cum, want, lowest=z, avoid=tried)
        if layout in tried:
            break
        tried.add(layout)
        length = probe(layout)
        if abs(target - length) < best[0]:
            best = (abs(target - length), layout)
    for m in sorted({best[1].m - 1, best[1].m, best[1].m + 1}, key=lambda m: abs(m - best[1].m)):
        if z <= m < len(cum) - 1:
            found = _cut_search(hay, m, probe, target)
            if found is not None:
                return found, cum
    return best[1], cum


def _cut_search(hay: Haystack, m: int, probe, target: int):
    """m whole units and unit m cut after the character a bisection of probes finds, or None."""
    options = [Layout(m, (text,), (count,)) for text, count in hay.prefixes(m, fine=True)]
    seen = {}
    lo, hi = 0, len(options) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        seen[mid] = probe(options[mid])
        if seen[mid] == target:
            return options[mid]
        lo, hi = (mid + 1, hi) if seen[mid] < target else (lo, mid - 1)
    # a tokenizer that merges across the cut (SentencePiece's ".\nWhat") can step over the target:
    # the cuts next to where the bisection ended
    for i in sorted(range(len(options)), key=lambda i: abs(i - lo))[:MAX_SCAN]:
        if i not in seen and probe(options[i]) == target:
            return options[i]
    return None


def room(
    counter: Counter, hay: Haystack, needles: list[Needle], before: str, after: str, target: int, special_tokens: bool
) -> tuple[int, int, list[int], int]:
    """(the template's tokens, the needles', the haystack's cumulative counts up to what `target` leaves, the
    least a prompt takes); `TooShort` when that least is more than `target`."""
    fixed = counter.count(before) + counter.count(after)
    if special_tokens:
        fixed += counter.special_before + counter.special_after
    needle_tokens = sum(counter.counts([hay.lead + n.text for n in needles]))
    cum = hay.cumulative(max(target - fixed - needle_tokens, 0))
    needle_tokens += len(needles) * hay.item_cost
    least = fixed + needle_tokens + hay.overhead(len(needles))
    if least > target:
        raise TooShort(f"{target:,} tokens is too short: the template and needles alone take {least:,}")
    return fixed, needle_tokens, cum, least


def assemble(
    counter: Counter, hay: Haystack, needles: list[Needle], before: str, after: str, target: int, special_tokens: bool
) -> Assembled:
    """The counted string before + context + after with exactly `target` tokens (see the module)."""
    fixed, needle_tokens, cum, least = room(counter, hay, needles, before, after, target, special_tokens)
    want, tried, best = target - least, set(), None
    for _ in range(8):  # plan again with what the last plan got wrong (the joins, the number of items)
        layout = solve(hay, cum, want, avoid=tried)
        tried.add(layout)
        slots = place(needles, cum, layout)
        _, _, _, _, ends = rendered = render(hay, layout, needles, slots, before, after)
        items = layout.m + len(layout.filler) + len(needles)
        planned = fixed + needle_tokens + cum[layout.m] + layout.filler_count + hay.overhead(items)
        planned += _edges(counter, hay.sep, before, after, ends)
        if best is None or abs(planned - target) < best[0]:
            best = (abs(planned - target), layout, slots, rendered)
        if planned == target:
            break
        want = cum[layout.m] + layout.filler_count + target - planned
    _, layout, slots, (text, span, needle_spans, starts, _) = best
    measured = counter.measure(text, special_tokens)
    for _ in range(ROUNDS):
        if measured.length == target:
            break
        refit, cum = _refit(
            counter,
            hay,
            cum,
            layout,
            needles,
            slots,
            before,
            after,
            target,
            text,
            measured,
            starts,
            span,
            special_tokens,
        )
        if refit == layout:  # nothing nearer: the prompt stays as measured
            break
        layout = refit
        text, span, needle_spans, starts, _ = render(hay, layout, needles, slots, before, after)
        measured = counter.measure(text, special_tokens)
    if abs(measured.length - target) > TOLERANCE:
        raise ValueError(f"could not fit the prompt to {target:,} tokens (got {measured.length:,})")
    return Assembled(text, measured.length, span, needle_spans, cum[layout.m] + layout.filler_count, measured.ids)
