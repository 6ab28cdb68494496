"""Training variants of kv_retrieval: multi-query associative recall (MQAR) and the marker curriculum.

    task = build_task({"name": "mqar", "length": 256, "num_needles": 8, "value_length": 2,
                       "num_queries": 4, "answer_marker": 0.5}, vocab_size)

The haystack is exactly `kv_retrieval`'s (needles `KEY k VAL v_1..v_m END` in filler, the same
token ranges). The prompt then ends with `num_queries` queries of distinct keys, each
`QUERY k ANSWER v_1..v_m`, the last one without its value: the example's answer. With
`num_queries=1, answer_marker=1` an example is token for token `kv_retrieval`'s for the same seed.
`info["supervised"]` lists the prompt positions whose next token is an earlier query's value token
(the pretraining loss covers them as well as the answer).

`answer_marker` is the probability that a query keeps its `ANSWER` token (otherwise it reads
`QUERY k v_1..v_m`, and one more filler token opens the haystack, so the length stays). Why: the
answer of `QUERY k ANSWER` depends on the token BEFORE the current one, so a small model must
compose two attention steps (copy k into the ANSWER position, then match it against the key written
into the value's position) before the loss moves; it sits on the "copy any needle's value" plateau
(loss ln(num_needles)) for thousands of steps. Without the marker the current token is the key,
which needs one composition fewer and is learned within a few hundred steps; the model then solves
the marked form by moving the answer it already retrieves at the key's position one token on.
Measured (2-needle toy, 3-layer llama, hidden 64): marked only, no progress in 2,000 steps; 500 steps
without the marker then the half-marked mix: 96-98% on the marked form 250 steps later.

Registered as "mqar" when this module is imported (`longstraw.training.pretrain` imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw.training.tasks import ANSWER, KEY, QUERY, VAL, Example, KeyValueRetrieval, register_task


@dataclass
class MultiQueryRetrieval(KeyValueRetrieval):
    num_queries: int = 1
    answer_marker: float = 1.0

    def __post_init__(self):
        if not 1 <= self.num_queries <= self.num_needles:
            raise ValueError(f"num_queries must be in [1, num_needles={self.num_needles}], got {self.num_queries}")
        if not 0 <= self.answer_marker <= 1:
            raise ValueError(f"answer_marker is a probability, got {self.answer_marker}")
        tail = (self.num_queries - 1) * (self.value_length + 3)
        # the haystack is a kv_retrieval prompt of length - tail (one token shorter when the last query drops
        # its marker; any other dropped marker frees one filler token too)
        # a needle is KEY k VAL v_1..v_m END: m + 4 tokens (kv_retrieval's own check counts m + 3)
        if self.length - tail - 1 < self.num_needles * (self.value_length + 4) + 3:
            raise ValueError(
                f"length {self.length} cannot hold {self.num_needles} needles and {self.num_queries} "
                f"queries of value length {self.value_length}"
            )
        self._base = KeyValueRetrieval(
            self.vocab_size, self.length - tail, self.num_needles, self.value_length, self.depths, self.partial
        )
        self.keys, self.values, self.filler = self._base.keys, self._base.values, self._base.filler

    def make(self, seed: int) -> Example:
        first = self._base.make(seed)
        body = first.prompt_ids.tolist()[:-3]  # the haystack
        if self.num_queries == 1 and self.answer_marker >= 1:
            return first  # kv_retrieval itself
        needles = {}  # key -> value tokens, read back from the haystack
        for p in range(len(body) - self.value_length - 2):
            if body[p] == KEY and body[p + 2] == VAL:
                needles[body[p + 1]] = tuple(body[p + 3 : p + 3 + self.value_length])
        rng = torch.Generator().manual_seed(seed ^ 0x3A5E)
        others = [k for k in needles if k != first.info["key"]]
        order = [first.info["key"]] + [others[i] for i in torch.randperm(len(others), generator=rng).tolist()]
        order = order[: self.num_queries]
        marked = (torch.rand(self.num_queries, generator=rng) < self.answer_marker).tolist()
        pad = [self.filler[int(i)] for i in torch.randint(len(self.filler), (marked.count(False),), generator=rng)]
        tokens, supervised = pad + body, []
        for i, k in enumerate(order):
            tokens += [QUERY, k] + ([ANSWER] if marked[i] else [])
            if i < len(order) - 1:
                supervised += range(len(tokens) - 1, len(tokens) - 1 + self.value_length)
                tokens += list(needles[k])
        return Example(
            torch.tensor(tokens), needles[order[-1]], {"key": order[-1], "supervised": supervised, "marked": marked[-1]}
        )


register_task("mqar", MultiQueryRetrieval)


@dataclass
class Periodic:
    """Local-structure warm-up data: random tokens repeating with a period p drawn from `periods`, so every
    token from the p-th on is the token p back (`info["supervised"]` lists those positions). Learning it
    takes one attention head that looks a fixed number of positions back: the "previous token" heads
    that retrieval composes with. Random filler teaches none, which is why kv_retrieval alone stalls.
    Tokens come from every free id (keys, values, filler alike); the answer is the next period token."""

    vocab_size: int
    length: int = 64
    periods: tuple[int, ...] = (2, 3)

    def __post_init__(self):
        from longstraw.training.tasks import FIRST_FREE

        self.ids = range(FIRST_FREE, self.vocab_size)
        if len(self.ids) < 2 or min(self.periods) < 1 or self.length <= max(self.periods):
            raise ValueError(
                f"periodic: need free ids, periods >= 1 and length > max period, got "
                f"{self.vocab_size}, {self.periods}, {self.length}"
            )

    def make(self, seed: int) -> Example:
        rng = torch.Generator().manual_seed(seed)
        p = self.periods[int(torch.randint(len(self.periods), (1,), generator=rng))]
        cycle = [self.ids[int(i)] for i in torch.randint(len(self.ids), (p,), generator=rng)]
        tokens = [cycle[i % p] for i in range(self.length + 1)]
        return Example(
            torch.tensor(tokens[:-1]), (tokens[-1],), {"period": p, "supervised": list(range(p - 1, self.length - 1))}
        )

    def reward(self, example: Example, response_ids) -> float:
        return float(int(response_ids[0]) == example.answer[0])


register_task("periodic", Periodic)
