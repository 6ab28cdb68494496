"""An agent's task over RULER's real-text haystacks, where both the long context and the turns matter: task
`ruler_lookup` (`longstraw.training.tasks`), played in environment `ruler_lookup`
(`longstraw.training.environments.RulerLookupEnvironment`).

    task = build_task({"name": "ruler_lookup", "tokenizer": CHECKPOINT, "length": 32768, "hops": 2}, vocab)
    example = task.make(seed)       # info: the chain of keys, the value, how a tool's answer is framed

The context is RULER's essay haystack (niah_multikey_1's) with one needle per key, in RULER's words ("One of the
special magic numbers for KEY is: VALUE."): the keys of a hidden chain k0 -> k1 -> ... -> k_h and `distractors`
more, each with its own 7-digit value. The question names k0 and the number of hops h; the chain is not in the
context: only the tool knows it (`lookup KEY` answers the key KEY links to), and the tool never says a value. The
answer, `answer VALUE`, is k_h's value, which only the context holds; every key of the chain has a needle, so
reading the start's value (or any other one's) is wrong. Neither the context alone nor the tool alone solves it.

An example is one seed: its keys, values, depths and haystack (the same at every length, as RULER's are), the
prompt fitted to exactly `length` tokens by RULER's assembly (`fit.assemble`), in the chat template when asked.
`turn_frame` is what the conversation puts around a tool's answer after the action's end (the chat template's
turn after an assistant reply, as a user turn, then the generation prompt), so the environment's observations
read as the next turn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from longstraw.training.ruler.fit import Needle, assemble, room
from longstraw.training.ruler.formats import DEPTH_GRID, NEEDLE, split_template
from longstraw.training.ruler.haystacks import DRAW, Essays
from longstraw.training.ruler.tokens import Counter, frame

TEMPLATE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the numbers afterwards.\n{context}\n"
    "Some of the keys above are linked in a chain that only a tool knows: reply `lookup KEY` and the tool answers "
    "the key that KEY links to. Start from the key {start} and follow {hops}; then reply `answer NUMBER`, where "
    "NUMBER is the special magic number for the key you reached, as the text above gives it. Reply with one action "
    "at a time. For example, to follow 2 links from red-fox: you reply `lookup red-fox`, the tool answers "
    "`blue-owl`; you reply `lookup blue-owl`, the tool answers `tan-cat`; you reply `answer 1234567` if the text "
    "says that the special magic number for tan-cat is 1234567."
)
PLAIN_FRAME = ("\n", "\n")  # around a tool's answer without a chat template


@dataclass
class LookupExample:
    prompt: str  # the counted string (chat template included when asked)
    chain: list[str]  # k0 .. k_h: lookup(k_i) = k_{i+1}
    value: str  # k_h's special magic number: the answer
    length: int  # the prompt's tokens
    depths: list[float]  # each needle's depth (the chain's keys first, then the distractors')


def _rng(seed: int, stream: str) -> random.Random:
    return random.Random(f"ruler_lookup/{seed}/{stream}")  # hashed: the same draws in every process


def _distinct(draw, count: int, rng: random.Random) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        value = draw(rng)
        if value not in out:
            out.append(value)
    return out


def _planned(tokenizer, seed: int, hops: int, distractors: int, depth, chat: bool, wheel):
    """(counter, frame, haystack, needles, before, after, chain, values) of one example before its context."""
    rng = _rng(seed, "needles")
    keys = _distinct(DRAW["words"], hops + 1 + distractors, rng)
    values = _distinct(DRAW["numbers"], len(keys), rng)
    depth_rng = _rng(seed, "depth")
    depths = depth_rng.sample(DEPTH_GRID, len(keys))
    if depth is not None:  # the answering needle's (k_h's)
        depths[hops] = float(depth)
    texts = [NEEDLE.format(type_needle_v="numbers", key=k, value=v) for k, v in zip(keys, values)]
    needles = [Needle(t, d) for t, d in zip(texts, depths)]
    counter = Counter(tokenizer)
    fr = frame(tokenizer, "chat" if chat else "text")
    hop_text = "one link" if hops == 1 else f"{hops} links"
    head, tail = split_template(TEMPLATE, start=keys[0], hops=hop_text)
    before, after = fr.wrap(head, tail, "")
    return counter, fr, Essays(counter, wheel), needles, before, after, keys[: hops + 1], values[hops]


def make_lookup_example(
    tokenizer, length: int, seed: int, *, hops: int = 2, distractors: int = 2, depth=None, chat: bool = True, wheel=None
) -> LookupExample:
    """One example whose prompt is exactly `length` tokens of `tokenizer` (module docstring); `depth`: the
    answering needle's depth in [0, 1] (None: drawn from RULER's depth grid with the others)."""
    counter, fr, hay, needles, before, after, chain, value = _planned(
        tokenizer, seed, hops, distractors, depth, chat, wheel
    )
    built = assemble(counter, hay, needles, before, after, length, fr.special_tokens)
    return LookupExample(built.text, chain, value, built.length, [n.depth for n in needles])


def check_lookup_length(tokenizer, length: int, *, hops: int, distractors: int, chat: bool, wheel=None) -> None:
    """Refuse (`fit.TooShort`) a length that cannot hold the template and the needles, without assembling."""
    counter, fr, hay, needles, before, after, _, _ = _planned(tokenizer, 0, hops, distractors, None, chat, wheel)
    room(counter, hay, needles, before, after, length, fr.special_tokens)


def turn_frame(tokenizer, chat: bool) -> tuple[str, str]:
    """(before, after) a tool's answer, as text following an action's last token (the tokenizer's EOS, which
    ends the action): the chat template's next user turn up to its content, then its end and the generation
    prompt; without a chat template, a line of its own."""
    if not chat:
        return PLAIN_FRAME
    action, answer = "\u2063ACTION\u2063", "\u2063ANSWER\u2063"
    turns = [("user", "q"), ("assistant", action), ("user", answer)]
    rendered = tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in turns], add_generation_prompt=True, tokenize=False
    )
    between, after = rendered.split(action, 1)[1].split(answer, 1)
    eos = tokenizer.eos_token or ""
    return (between[len(eos) :] if eos and between.startswith(eos) else between), after
