"""RULER's task text, kept character for character so our prompts and RULER's read the same.

Sources (nvidia-long-context-eval 26.3, the packaged RULER; paths inside its wheel):
- templates and answer prefixes: long_context_eval/data/synthetic/constants.py (TASKS)
- the tasks' arguments: long_context_eval/synthetic.yaml
- needle sentence, repeat haystack, key/value types, the singular rewrite, the query join and the
  depth grid: long_context_eval/data/synthetic/niah.py
- variable tracking's noise, assignment statements and one-shot example: .../variable_tracking.py
- the document prompt and the two QA readers: .../qa.py
- the 'base' model template (the prompt is the task template, then the answer prefix): data/template.py
  and data/prepare.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
    "{type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT_HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
# "assgined" is RULER's spelling; kept so the prompts match
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assgined the value {query}, they are: "
)
VT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
    "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_PREFIX = " Answer:"
DOCUMENT = "Document {i}:\n{document}"

# niah.py's DEPTHS, round(linspace(0, 100, 40)) percent, as fractions: where RULER puts essay needles
DEPTH_GRID = tuple(round(100 * i / 39) / 100 for i in range(40))

TOKENS_TO_GENERATE = {"niah": 128, "variable_tracking": 30, "qa": 32}  # constants.py
METRICS = {"niah": "string_match_all", "variable_tracking": "string_match_all", "qa": "string_match_part"}


@dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: str  # niah | variable_tracking | qa (RULER's `task`)
    args: dict = field(default_factory=dict)

    @property
    def metric(self) -> str:
        return METRICS[self.kind]

    @property
    def tokens_to_generate(self) -> int:
        return TOKENS_TO_GENERATE[self.kind]


def _niah(haystack, k_type, v_type, k=1, v=1, q=1):
    return {
        "type_haystack": haystack,
        "type_needle_k": k_type,
        "type_needle_v": v_type,
        "num_needle_k": k,
        "num_needle_v": v,
        "num_needle_q": q,
    }


# synthetic.yaml, the tasks this module generates (cwe and fwe are not here)
TASKS = {
    spec.name: spec
    for spec in [
        TaskSpec("niah_single_1", "niah", _niah("repeat", "words", "numbers")),
        TaskSpec("niah_single_2", "niah", _niah("essay", "words", "numbers")),
        TaskSpec("niah_single_3", "niah", _niah("essay", "words", "uuids")),
        TaskSpec("niah_multikey_1", "niah", _niah("essay", "words", "numbers", k=4)),
        TaskSpec("niah_multikey_2", "niah", _niah("needle", "words", "numbers")),
        TaskSpec("niah_multikey_3", "niah", _niah("needle", "uuids", "uuids")),
        TaskSpec("niah_multivalue", "niah", _niah("essay", "words", "numbers", v=4)),
        TaskSpec("niah_multiquery", "niah", _niah("essay", "words", "numbers", q=4)),
        TaskSpec("vt", "variable_tracking", {"num_chains": 1, "num_hops": 4}),
        TaskSpec("qa_1", "qa", {"dataset": "squad"}),
        TaskSpec("qa_2", "qa", {"dataset": "hotpotqa"}),
    ]
}


def niah_template(type_needle_v: str, singular: bool) -> tuple[str, str, str]:
    """(template, answer prefix, the value type as the template names it). One queried value: niah.py
    rewrites the whole template (answer prefix included) to the singular, word for word as here."""
    template, prefix = NIAH_TEMPLATE, NIAH_PREFIX
    if singular:

        def rewrite(text):
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                text = text.replace(old, new)
            return text

        template, prefix, type_needle_v = rewrite(template), rewrite(prefix), type_needle_v[:-1]
    return template, prefix, type_needle_v


def join_query(keys: list[str]) -> str:
    """niah.py: "a", "a, and b", "a, b, and c"."""
    return ", ".join(keys[:-1]) + ", and " + keys[-1] if len(keys) > 1 else keys[0]


def split_template(template: str, **values) -> tuple[str, str]:
    """The text before and after {context}, the other fields filled."""
    before, after = template.split("{context}")
    return before.format(**values), after.format(**values)
