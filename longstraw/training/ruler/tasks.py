"""One RULER example from one seed: the task's needles, question and answers (niah.py,
variable_tracking.py, qa.py), a haystack, and the prompt fitted to a length in tokens."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from numbers import Real

from longstraw.training.ruler.corpora import qa_corpus
from longstraw.training.ruler.fit import Needle, assemble, room
from longstraw.training.ruler.formats import (
    DEPTH_GRID,
    NEEDLE,
    QA_PREFIX,
    QA_TEMPLATE,
    TASKS,
    VT_NOISE,
    VT_PREFIX,
    VT_TEMPLATE,
    TaskSpec,
    join_query,
    niah_template,
    split_template,
)
from longstraw.training.ruler.haystacks import (
    DRAW,
    VT_SENTENCES,
    Distractors,
    Documents,
    Essays,
    Haystack,
    Repeat,
    vt_noise,
    vt_split_noise,
)
from longstraw.training.ruler.tokens import Counter, frame


@dataclass
class Example:
    task: str
    seed: int
    prompt: object  # a string, or one user message (messages format)
    answer: list[str]  # the references RULER's metric looks for
    length: int  # the prompt's tokens, measured as the trainer tokenizes it
    depths: list[float]  # each needle's depth (task order: the first is what the question asks first)
    text: str = field(repr=False)  # the string the length was measured on
    context: tuple[int, int] = (0, 0)  # where the context is in `text`
    needles: list[tuple[int, int]] = field(default_factory=list)  # where each needle is in `text`
    haystack_tokens: int = 0  # the haystack's tokens (needles left out), as planned
    answering: list[int] = field(default_factory=list)  # the needles that hold the answer
    # the prompt's token ids as `tokenizer(prompt)` gives them (special tokens added), kept from the measuring
    # tokenization where the prompt is the counted string with them (None: tokenize the prompt)
    ids: list[int] | None = field(default=None, repr=False)

    @property
    def depth(self) -> float:
        return self.depths[0]

    def row(self) -> dict:
        """The text trainer's dataset row (longstraw.training.text_tasks)."""
        return {
            "prompt": self.prompt,
            "answer": self.answer,
            "task": self.task,
            "length": self.length,
            "depth": self.depth,
            "depths": self.depths,
            "seed": self.seed,
        }


@dataclass
class Parts:
    """What a task builder gives the assembly."""

    head: str  # the task text before the context
    tail: str  # after it
    prefix: str  # the answer prefix
    hay: Haystack
    needles: list[Needle]
    answer: list[str]
    answering: list[int]  # the needles that hold the answer


def _rng(task: str, seed: int, stream: str) -> random.Random:
    # a string seed is hashed with SHA-512: the same draws in every process, and streams that do not
    # shift with each other (the same keys and depths at every length)
    return random.Random(f"ruler/{task}/{seed}/{stream}")


def _depths(depth, count: int, rng: random.Random, ordered: bool = False) -> list[float]:
    """None: drawn from RULER's depth grid without repeats; a number: the first needle's, the rest drawn;
    a sequence: one per needle."""
    if depth is None:
        drawn = rng.sample(DEPTH_GRID, count) if count <= len(DEPTH_GRID) else [rng.random() for _ in range(count)]
        return sorted(drawn) if ordered else drawn
    if isinstance(depth, Real):
        first = float(depth)
        if not 0.0 <= first <= 1.0:
            raise ValueError(f"depth {depth!r} is not in [0, 1]")
        if ordered:  # the rest of the chain after it
            return [first] + sorted(rng.uniform(first, 1.0) for _ in range(count - 1))
        rest = [g for g in DEPTH_GRID if g != first]
        return [first] + (
            rng.sample(rest, count - 1) if count - 1 <= len(rest) else [rng.random() for _ in range(count - 1)]
        )
    depths = [float(d) for d in depth]
    if len(depths) != count or not all(0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depth: expected one number in [0, 1] or {count} of them (one per needle), got {depth!r}")
    return depths


def _distinct(draw, count: int, rng: random.Random) -> list[str]:
    out, seen = [], set()
    while len(out) < count:
        value = draw(rng)
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out


def niah(spec: TaskSpec, seed: int, depth, counter: Counter, where) -> Parts:
    """niah.py: keys with values, one needle per value; the first num_needle_q keys are asked about."""
    a = spec.args
    rng = _rng(spec.name, seed, "needles")
    num_k, num_v, num_q = max(a["num_needle_k"], a["num_needle_q"]), a["num_needle_v"], a["num_needle_q"]
    type_v = a["type_needle_v"]
    keys = _distinct(DRAW[a["type_needle_k"]], num_k, rng)
    values = _distinct(DRAW[type_v], num_k * num_v, rng)
    values = [values[i * num_v : (i + 1) * num_v] for i in range(num_k)]
    texts = [NEEDLE.format(type_needle_v=type_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    depths = _depths(depth, len(texts), _rng(spec.name, seed, "depth"))
    template, prefix, named = niah_template(type_v, singular=num_q * num_v == 1)
    query = join_query(keys[:num_q])
    head, tail = split_template(template, type_needle_v=named, query=query)
    kind = a["type_haystack"]
    if kind == "essay":
        hay = Essays(counter, where)
    elif kind == "repeat":
        hay = Repeat(counter)
    elif kind == "needle":
        hay = Distractors(
            counter, DRAW[a["type_needle_k"]], DRAW[type_v], type_v, _rng(spec.name, seed, "haystack"), taken=set(keys)
        )
    else:
        raise ValueError(f"{spec.name}: unknown haystack {kind!r}")
    return Parts(
        head,
        tail,
        prefix.format(type_needle_v=named, query=query),
        hay,
        [Needle(t, d) for t, d in zip(texts, depths)],
        [v for vs in values[:num_q] for v in vs],
        list(range(num_q * num_v)),
    )


def _chains(rng: random.Random, num_chains: int, num_hops: int, letters: int):
    """variable_tracking.py's chains: `VAR A = 12345`, then `VAR B = VAR A ` (its trailing space kept) per
    hop; names distinct (RULER only tops the list up on a repeat), values distinct 5-digit numbers."""
    names = _distinct(lambda r: "".join(r.choices(string.ascii_uppercase, k=letters)), num_chains * (num_hops + 1), rng)
    values = _distinct(lambda r: str(r.randint(10000, 99998)), num_chains, rng)
    chains = []
    for c in range(num_chains):
        v = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        chains.append((v, [f"VAR {v[0]} = {values[c]}"] + [f"VAR {v[j + 1]} = VAR {v[j]} " for j in range(num_hops)]))
    return chains, values


def _vt_context(rng: random.Random, noises: int, chains) -> str:
    """variable_tracking.py's context for the one-shot example: the statements at random places among
    the noise lines (their sentences when there are no more lines than statements), in order."""
    split = noises <= len(chains[0][1])
    items = list(VT_SENTENCES) * noises if split else [VT_NOISE] * noises
    for _, statements in chains:
        places = sorted(rng.sample(range(len(items)), min(len(statements), len(items))))
        for j, (place, statement) in enumerate(zip(places, statements)):
            items.insert(place + j, statement)
    return " ".join(items)


def _vt_shot(counter: Counter, rng: random.Random, num_chains: int, num_hops: int) -> str:
    """variable_tracking.py's one-shot example: the whole task (3-letter names, at most 10 hops) with its
    answer, as many noise lines (a multiple of 5) as keep it with its answer list and 30 tokens to
    generate within 500 tokens."""
    hops = min(10, num_hops)
    chains, values = _chains(rng, num_chains, hops, letters=3)

    def shot(noises, context_rng):
        prompt = VT_TEMPLATE.format(
            context=_vt_context(context_rng, noises, chains), query=values[0]
        ) + VT_PREFIX.format(num_v=hops + 1, query=values[0])
        return prompt, f"{prompt} {chains[0][0]}"  # RULER measures it with the answer list's repr after it

    noises = 5
    while counter.count(shot(noises + 5, random.Random(0))[1]) + 30 <= 500:
        noises += 5
    prompt, _ = shot(noises, rng)
    return prompt + " " + " ".join(chains[0][0]) + "\n\n"


def vt(spec: TaskSpec, seed: int, depth, counter: Counter, where) -> Parts:
    """variable_tracking.py: chains of assignments hidden in noise; which variables hold the first
    chain's value. The one-shot example goes first, as RULER puts it ("base" template)."""
    num_chains, num_hops = spec.args["num_chains"], spec.args["num_hops"]
    rng = _rng(spec.name, seed, "needles")
    chains, values = _chains(rng, num_chains, num_hops, letters=5)
    shot = _vt_shot(counter, _rng(spec.name, seed, "shot"), num_chains, num_hops)
    depth_rng = _rng(spec.name, seed, "depth")
    per_chain = num_hops + 1
    if depth is not None and not isinstance(depth, Real):  # one depth per statement, chain after chain
        depths = _depths(depth, per_chain * num_chains, depth_rng)
        if any(depths[i] > depths[i + 1] for i in range(len(depths) - 1) if (i + 1) % per_chain):
            raise ValueError(
                f"{spec.name}: a chain's depths must not decrease (its statements come in order), got {depths}"
            )
    else:
        depths = _depths(depth, per_chain, depth_rng, ordered=True)
        for _ in chains[1:]:
            depths += _depths(None, per_chain, depth_rng, ordered=True)
    texts = [s for _, statements in chains for s in statements]
    head, tail = split_template(VT_TEMPLATE, query=values[0])
    prefix = VT_PREFIX.format(num_v=num_hops + 1, query=values[0])
    # variable_tracking.py puts the example before the task: " " + example + "\n\n"
    return Parts(
        " " + shot + "\n\n" + head,
        tail,
        prefix,
        vt_noise(counter),
        [Needle(t, d) for t, d in zip(texts, depths)],
        list(chains[0][0]),
        list(range(num_hops + 1)),
    )


def qa(spec: TaskSpec, seed: int, depth, counter: Counter, where) -> Parts:
    """qa.py: a question, its gold documents among others ("Document i:" each), at the depths; the
    documents RULER adds first (SQuAD: the rest of the article; HotpotQA: the question's distractor
    paragraphs) and then those of the whole corpus are the haystack (`haystacks.Documents`)."""
    dataset = spec.args["dataset"]
    corpus = qa_corpus(dataset, where)
    rng = _rng(spec.name, seed, "needles")
    question = corpus.questions[rng.randrange(len(corpus.questions))]
    depths = _depths(depth, len(question.gold), _rng(spec.name, seed, "depth"))
    needles = [Needle(corpus.documents[i], d) for i, d in zip(question.gold, depths)]
    head, tail = split_template(QA_TEMPLATE, query=question.query)
    hay = Documents(counter, corpus, dataset, _rng(spec.name, seed, "haystack"), question.gold, question.related)
    return Parts(head, tail, QA_PREFIX, hay, needles, list(question.outputs), list(range(len(needles))))


BUILDERS = {"niah": niah, "variable_tracking": vt, "qa": qa}


def _planned(task: str, tokenizer, length, seed: int, depth, mode: str, chat_template_kwargs, wheel):
    """(counter, frame, parts, the counted string before the context, after it): one example before its
    context is assembled."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r} (known: {', '.join(TASKS)})")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive number of tokens, got {length!r}")
    spec = TASKS[task]
    counter = Counter(tokenizer)
    fr = frame(tokenizer, mode, chat_template_kwargs)
    parts = BUILDERS[spec.kind](spec, seed, depth, counter, wheel)
    before, after = fr.wrap(parts.head, parts.tail, parts.prefix)
    if spec.kind == "variable_tracking":
        noise = counter.count(" " + VT_NOISE)
        left = (
            length
            - counter.count(before)
            - counter.count(after)
            - sum(counter.counts([" " + n.text for n in parts.needles]))
        )
        if left < noise * (len(parts.answering) + 1):  # RULER's rule: no more noise lines than statements
            parts.hay = vt_split_noise(counter)
    return counter, fr, parts, before, after


def check_length(task: str, tokenizer, length: int, seed: int = 0, *, chat: bool = False, wheel=None) -> None:
    """Refuse (`fit.TooShort`) a length too short for one example's template and needles, as `make_example` would,
    without assembling its context."""
    counter, fr, parts, before, after = _planned(
        task, tokenizer, length, seed, None, "chat" if chat else "text", None, wheel
    )
    room(counter, parts.hay, parts.needles, before, after, length, fr.special_tokens)


def make_example(
    task: str,
    tokenizer,
    length: int,
    seed: int,
    *,
    depth=None,
    chat: bool = False,
    messages: bool = False,
    chat_template_kwargs: dict | None = None,
    wheel=None,
) -> Example:
    """One example of `task` (a name of TASKS) whose prompt is exactly `length` tokens of `tokenizer`.

    seed: the example (its keys, values, question, depths and haystack; the same seed gives the same
    needles at every length). depth: None (drawn from RULER's 40-point depth grid), a number in [0, 1]
    (the first answering needle's; others drawn) or one number per needle. chat: the chat template around
    the task with the answer prefix after the generation prompt (a string prompt); messages: a list of
    one user message holding task and answer prefix (the trainer applies the chat template); neither:
    RULER's base template, task then answer prefix. chat_template_kwargs: as the trainer's
    `tokenizer.chat_template_kwargs`. wheel: where the RULER wheel is (`wheel.find_wheel`)."""
    counter, fr, parts, before, after = _planned(
        task,
        tokenizer,
        length,
        seed,
        depth,
        "messages" if messages else "chat" if chat else "text",
        chat_template_kwargs,
        wheel,
    )
    built = assemble(counter, parts.hay, parts.needles, before, after, length, fr.special_tokens)
    context = built.text[built.context[0] : built.context[1]]
    content = parts.head + context + parts.tail + (parts.prefix if fr.mode == "messages" else "")
    return Example(
        task,
        seed,
        fr.prompt(built.text, content),
        parts.answer,
        built.length,
        [n.depth for n in parts.needles],
        built.text,
        built.context,
        built.needles,
        built.haystack_tokens,
        parts.answering,
        built.ids if fr.mode != "messages" and fr.special_tokens else None,
    )
