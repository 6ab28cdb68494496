"""Haystacks: the streams of units a context is filled with, each unit's token count, and the ways
a haystack can end so that the prompt is exactly as long as asked.

A context is `sep.join(items)`: the haystack's first m units, then a filler, with the needles between
them. Fillers, in each haystack's order of preference: `words`, the next unit cut where a word or a
punctuation mark ends (prose: the essays, RULER's repeated lines and variable tracking's noise;
RULER's own essay haystack ends mid-sentence too); `chars`, cut inside a word, where the words'
tokens step over the length; `pick`, whole units of a pool chosen by their counts (distractor
needles and documents, which are cut only where no whole ones add up: prompts of a few hundred tokens).
"""

from __future__ import annotations

import random
import uuid
from itertools import accumulate

from longstraw.training.ruler.corpora import QACorpus, essay_sentences, key_words
from longstraw.training.ruler.formats import DOCUMENT, NEEDLE, REPEAT_HAYSTACK, VT_NOISE
from longstraw.training.ruler.tokens import Counter

_MARKS = set(".,;:!?")


class Haystack:
    sep = " "  # between items in the context
    lead = " "  # what stands before a unit or needle when it is counted (its separator, as in the context)
    fillers = ("words", "chars")
    size: int | None = None  # units there are (None: no end)
    item_cost = 0  # tokens each unit and needle is counted with beyond its text (documents: a header)

    def __init__(self, counter: Counter):
        self.counter = counter
        self._counts: list[int] = []

    def unit(self, i: int) -> str:
        raise NotImplementedError

    def overhead(self, items: int) -> int:
        """Tokens a context of this many items has beyond its items' counts."""
        return 0

    def decorate(self, items: list[str]) -> list[str]:
        """The items as the context writes them."""
        return items

    # ---- counts
    def _count_more(self, start: int, stop: int) -> list[int]:
        return self.counter.counts([self.lead + self.unit(i) for i in range(start, stop)])

    def counts(self, n: int) -> list[int]:
        if len(self._counts) < n:
            self._counts.extend(self._count_more(len(self._counts), n))
        return self._counts[:n]

    def cumulative(self, budget: int) -> list[int]:
        """cum[i] = tokens of the first i units, for as many units as pass `budget` (counted in a few
        batches, each sized from the mean count so far)."""
        n = 64
        while True:
            if self.size is not None:
                n = min(n, self.size)
            cum = [0, *accumulate(self.counts(n))]
            if cum[-1] > budget:
                return cum
            if n == self.size:
                raise ValueError(
                    f"{self.describe()} hold {cum[-1]:,} tokens of this tokenizer, fewer than the "
                    f"{budget:,} this prompt needs"
                )
            n += int((budget - cum[-1]) / max(cum[-1] / n, 1) * 1.05) + 16

    def describe(self) -> str:
        return f"the haystack's {self.size:,} units"

    # ---- fillers: (text, count) options that end the haystack after m whole units
    def prefixes(self, m: int, fine: bool = False) -> list[tuple[str, int]]:
        """Unit m cut short: where a word or a punctuation mark ends (the last one but one), or (`fine`)
        after any character."""
        text = self.unit(m)
        cuts = (
            range(1, len(text))
            if fine
            else [i for i in range(1, len(text)) if text[i] == " " or text[i] in _MARKS or text[i - 1] in _MARKS]
        )
        heads = [h for h in dict.fromkeys(text[:i].rstrip() for i in cuts) if h.strip()]
        return [(h, c + self.item_cost) for h, c in zip(heads, self.counter.counts([self.lead + h for h in heads]))]

    def pool(self, m: int) -> list[tuple[str, int]]:
        """Units that can end the haystack after m whole ones (`pick`)."""
        raise NotImplementedError


class Essays(Haystack):
    """The essays' sentences in order (niah.py's essay haystack starts at its first word), cycling past
    the end (RULER stops there: ~525K words)."""

    def __init__(self, counter, where=None):
        super().__init__(counter)
        self.sentences = essay_sentences(where)
        # counts are the same for every example: kept with the tokenizer
        self._counts = counter.cache.setdefault(("essays", len(self.sentences)), [])

    def unit(self, i):
        return self.sentences[i % len(self.sentences)]

    def _count_more(self, start, stop):
        n = len(self.sentences)
        new = super()._count_more(start, min(stop, n)) if start < n else []
        known = self._counts + new  # past the end, the counts of the first pass
        return new + [known[i % n] for i in range(max(start, n), stop)]


class Repeat(Haystack):
    """niah.py's 'repeat' haystack (one line, again and again) or variable tracking's noise."""

    def __init__(self, counter, text=REPEAT_HAYSTACK, sep="\n"):
        super().__init__(counter)
        self.text, self.sep, self.lead = text, sep, sep

    def unit(self, i):
        return self.text

    def _count_more(self, start, stop):
        return [self.counter.count(self.sep + self.text)] * (stop - start)


def vt_noise(counter) -> Repeat:
    return Repeat(counter, VT_NOISE, " ")


# variable_tracking.py with no more noise lines than statements cuts each line into its sentences, the
# period put back. RULER keeps the line's newline as an item of its own and then removes the space the
# join put before it (`.replace(". \\n", ".\\n")`); here it stays on the line's last sentence: the same text.
VT_SENTENCES = tuple(p + "." for p in VT_NOISE.split(".")[:-1])[:-1] + (VT_NOISE.split(".")[-2] + ".\n",)


def vt_split_noise(counter) -> Cycle:
    return Cycle(counter, VT_SENTENCES, " ")


class Cycle(Haystack):
    def __init__(self, counter, parts, sep):
        super().__init__(counter)
        self.parts, self.sep, self.lead = parts, sep, sep

    def unit(self, i):
        return self.parts[i % len(self.parts)]


class Distractors(Haystack):
    """niah.py's 'needle' haystack: needles of other random keys, one a line; drawn from `rng`, none with
    a key the question asks about (niah.py does not check; at a million tokens a clash is likely)."""

    sep = lead = "\n"
    fillers = ("pick", "words", "chars")

    def __init__(self, counter, draw_key, draw_value, type_needle_v: str, rng: random.Random, taken: set):
        super().__init__(counter)
        self.draw_key, self.draw_value, self.type_needle_v = draw_key, draw_value, type_needle_v
        self.rng, self.taken = rng, taken
        self._units: list[str] = []
        self._pool_rng = random.Random(rng.random())

    def _draw(self, rng) -> str:
        key = self.draw_key(rng)
        while key in self.taken:
            key = self.draw_key(rng)
        return NEEDLE.format(type_needle_v=self.type_needle_v, key=key, value=self.draw_value(rng))

    def unit(self, i):
        while len(self._units) <= i:
            self._units.append(self._draw(self.rng))
        return self._units[i]

    def pool(self, m):
        if not hasattr(self, "_pool"):
            texts = [self._draw(self._pool_rng) for _ in range(256)]
            self._pool = list(zip(texts, self.counter.counts([self.lead + t for t in texts])))
        return self._pool


class Documents(Haystack):
    """qa.py's documents ("Document i:\n..." numbered in order, a blank line between). First the
    question's related documents (qa.py adds them before any other), then the rest of the corpus in a
    seeded order, the question's own left out. RULER shuffles all it picked, so the related ones are
    spread at random over the haystack's expected length (a short one holds some of them only, as
    RULER's sample of them)."""

    sep = "\n\n"
    lead = ""  # a document is counted alone, with `item_cost` for its blank line and "Document j:" line
    fillers = ("pick", "words", "chars")

    def __init__(self, counter, corpus: QACorpus, dataset: str, rng: random.Random, gold, related):
        super().__init__(counter)
        self.docs, self.rng, self.dataset = corpus.documents, rng, dataset
        own = set(gold) | set(related)
        order = list(range(len(self.docs)))
        rng.shuffle(order)
        self.rest = [i for i in order if i not in own]
        self.related = list(related)
        rng.shuffle(self.related)
        self.order: list[int] = []  # set when the haystack's length is first known (`cumulative`)
        self.size = len(self.rest) + len(self.related)
        self._doc_counts = counter.cache.setdefault(("documents", dataset), {})
        self._headers = counter.cache.setdefault("document headers", [])  # running sums

    def doc_counts(self, ids: list[int]) -> list[int]:
        """Each document's tokens as it stands before the next one's header: a document that ends in a
        space (SQuAD has them) shares a token with the blank line after it."""
        missing = [i for i in dict.fromkeys(ids) if i not in self._doc_counts]
        follow = self.sep + "Document"
        base = self.counter.count(follow)
        for i, c in zip(missing, self.counter.counts([self.docs[i] + follow for i in missing])):
            self._doc_counts[i] = c - base
        return [self._doc_counts[i] for i in ids]

    def cumulative(self, budget):
        if not self.order:
            sample = self.rest[:64] + self.related
            mean = sum(self.doc_counts(sample)) / len(sample)
            expected = min(self.size, max(2, int(budget / (mean + 6))))
            sums = self._header_sums(expected)
            self.item_cost = sums[expected - 1] - sums[expected - 2]  # a header near the haystack's end
            if expected <= len(self.related):
                self.order = self.related + self.rest
            else:
                places = set(self.rng.sample(range(expected), len(self.related)))
                related, rest = iter(self.related), iter(self.rest)
                self.order = [next(related) if i in places else next(rest) for i in range(expected)]
                self.order += list(rest)
        return super().cumulative(budget)

    def describe(self) -> str:
        return f"{self.dataset}'s {len(self.docs):,} documents"

    def overhead(self, items: int) -> int:
        """The headers of documents 1 .. items (the first one's blank line too: the first item's count is
        corrected where the context is planned), less the `item_cost` each was counted with."""
        return (self._header_sums(items)[items - 1] if items else 0) - items * self.item_cost

    def _header_sums(self, items: int) -> list[int]:
        sums = self._headers  # sums[j - 1]: the first j documents' header lines
        if len(sums) < items:
            more = range(len(sums) + 1, max(items, 2 * len(sums)) + 1)
            total = sums[-1] if sums else 0
            for c in self.counter.counts([self.sep + DOCUMENT.format(i=j, document="") for j in more]):
                total += c
                sums.append(total)
        return sums

    def unit(self, i):
        return self.docs[self.order[i]]

    def _count_more(self, start, stop):
        return [c + self.item_cost for c in self.doc_counts(self.order[start : min(stop, len(self.order))])]

    def pool(self, m):
        ids = self.order[m : m + 128]  # unused while the haystack has m units (their counts vary widely)
        return [(self.docs[i], c + self.item_cost) for i, c in zip(ids, self.doc_counts(ids))]

    def decorate(self, items):
        return [DOCUMENT.format(i=j + 1, document=d) for j, d in enumerate(items)]


def draw_number(rng: random.Random) -> str:
    """niah.py: a 7-digit number."""
    return str(rng.randint(10**6, 10**7 - 1))


def draw_uuid(rng: random.Random) -> str:
    """niah.py: a version-4 UUID from 128 random bits."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def draw_word(rng: random.Random) -> str:
    """niah.py: an "adjective-noun" pair of wonderwords' lists."""
    adjectives, nouns = key_words()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


DRAW = {"numbers": draw_number, "uuids": draw_uuid, "words": draw_word}
