"""Evaluation prompts: a set of the eval-set registry (eval/harness/eval_sets.py: MT-bench, HumanEval, held-out
ShareGPT) or a JSONL file, rendered with the base chat template.

Every prompt becomes an `EvalPrompt` whose `input_ids` are the base tokenizer's chat template applied
to `messages` with `add_generation_prompt=True`, so the decoder starts generating the assistant turn.

Selection is deterministic: with `num_prompts=N` a seeded subset is drawn (round-robin over
categories, so 8 MT-bench prompts cover all 8 categories) and returned in file order. Prompts longer
than `max_prompt_tokens` are skipped, never truncated (a cut chat prompt no longer ends with the
generation prompt), and the next prompt in the seeded order takes their place.

MT-bench second turns. MT-bench's protocol asks turn 2 after the *model's own* turn-1 answer. There
is no reference answer for most questions, so the intended flow is two passes:

    first = load_eval_prompts("mtbench", tok, num_prompts=None)
    answers = [decode(p) for p in first]                       # the base's greedy turn-1 output
    second = second_turn_prompts(first, answers, tok)          # history: q1, answer, q2

`load_eval_prompts(..., both_turns=True)` is the model-free shortcut for smoke tests: it appends the
turn-2 prompts (after all turn-1 prompts) with the fixed `TURN1_PLACEHOLDER_ANSWER` as the assistant's
turn-1 answer. That context is off-distribution for the base, so acceptance measured on those
prompts is not comparable to the two-pass flow; use `second_turn_prompts` for real numbers.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from eval.harness.eval_sets import EVAL_SETS, Candidate, mtbench_line, read_jsonl

logger = logging.getLogger(__name__)

TURN1_PLACEHOLDER_ANSWER = "(The assistant's answer to the first question is omitted.)"
BUILTIN_DATASETS = tuple(EVAL_SETS)  # what `dataset=<name>` reads besides a JSONL path


@dataclass
class EvalPrompt:
    """One prompt for the decoder.

    id: stable name ("mtbench-81", "mtbench-81-turn2", "sharegpt-1234", "humaneval-HumanEval-0", "<file stem>-3").
    category: MT-bench category, "sharegpt", "humaneval", or the JSONL line's "category" (default "custom").
    messages: the chat so far, [{"role", "content"}], last one a user turn.
    input_ids: `messages` rendered with the base chat template, add_generation_prompt=True.
    turn: 1 or 2 (MT-bench second turns).
    followups: later user turns not yet asked (MT-bench turn 2), consumed by `second_turn_prompts`.
    """

    id: str
    category: str
    messages: list[dict]
    input_ids: list[int]
    turn: int = 1
    followups: tuple[str, ...] = field(default=())

    @property
    def text(self) -> str:
        """The last user message: what the report shows as the prompt."""
        return self.messages[-1]["content"]


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template, ending with the generation prompt.

    Rendered to text first and then encoded without extra special tokens: the template already
    contains them, and `apply_chat_template(tokenize=True)` returns a different type across
    transformers versions.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; eval prompts must be rendered the way the "
                         "base was trained to see chats. Load the base's own tokenizer (or set one).")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_eval_prompts(dataset: str, tokenizer, *, num_prompts: int | None, both_turns: bool = False,
                      seed: int = 0, sharegpt_source: str = "sharegpt", heldout_skip: int = 0,
                      max_prompt_tokens: int | None = None) -> list[EvalPrompt]:
    """Load, select and render evaluation prompts.

    dataset: a set of eval/harness/eval_sets.py: "mtbench" (80 questions, first turns), "humaneval" (164
      problems), "sharegpt" (held-out conversations of `sharegpt_source`: the first user turn, with any
      system turn before it, of conversations after the first `heldout_skip`; pass the training run's
      `max_records` there so no prompt was trained on); or a path to a JSONL file whose lines are
      {"prompt": str, ["id"], ["category"]} or MT-bench lines {"question_id", "category", "turns": [...]}.
    num_prompts: how many to keep (None = all). Fewer are returned, with a warning, if the source
      has fewer that fit `max_prompt_tokens`.
    both_turns: also return second-turn prompts (MT-bench-format sources only) after all first
      turns, with `TURN1_PLACEHOLDER_ANSWER` as the turn-1 answer; see the module docstring.
      `num_prompts` counts questions, so up to 2 * num_prompts prompts come back.
    seed: drives which subset is drawn; the same seed gives the same prompts.
    """
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts}: use a positive count, or None for every prompt")
    if heldout_skip < 0:
        raise ValueError(f"heldout_skip={heldout_skip} must be >= 0 (the training run's max_records)")
    if dataset in EVAL_SETS:
        candidates = EVAL_SETS[dataset].candidates(sharegpt_source, heldout_skip)
        name = dataset
    else:
        path = Path(dataset)
        if not path.is_file():
            raise FileNotFoundError(f"eval dataset {dataset!r} is neither one of {BUILTIN_DATASETS} nor an "
                                    f"existing JSONL file; pass {', '.join(map(repr, BUILTIN_DATASETS))}, or a "
                                    "path to a JSONL of {\"prompt\": ...} or MT-bench question lines")
        candidates = _jsonl_candidates(path)
        name = str(path)
    if not candidates:
        raise ValueError(f"eval dataset {name!r} has no usable prompts (no line/conversation with a "
                         "non-empty user turn); check the file or lower heldout_skip")
    if both_turns and not any(c.followups for c in candidates):
        raise ValueError(f"both_turns=True but {name!r} has no second turns; only MT-bench-format data "
                         "(\"turns\": [q1, q2]) has them")

    prompts = _select_and_render(candidates, tokenizer, num_prompts, seed, max_prompt_tokens, name)
    if both_turns:
        with_followups = [p for p in prompts if p.followups]
        answers = [TURN1_PLACEHOLDER_ANSWER] * len(with_followups)
        prompts = prompts + second_turn_prompts(with_followups, answers, tokenizer,
                                                max_prompt_tokens=max_prompt_tokens)
    return prompts


def second_turn_prompts(first_turn_prompts: Sequence[EvalPrompt],
                        first_answers: Sequence[str] | Mapping[str, str], tokenizer, *,
                        max_prompt_tokens: int | None = None) -> list[EvalPrompt]:
    """Turn-2 prompts: history = turn-1 messages + the assistant's `first_answers` + the next question.

    first_answers: one answer per prompt (same order), or a mapping prompt id -> answer; the caller
      passes the base model's own turn-1 output, as MT-bench prescribes.
    Prompts without a follow-up question are skipped; over-long ones (rendered length >
    `max_prompt_tokens`) are skipped with a warning. Ids get a "-turn2" suffix.
    """
    if isinstance(first_answers, Mapping):
        missing = [p.id for p in first_turn_prompts if p.followups and p.id not in first_answers]
        if missing:
            raise KeyError(f"first_answers has no answer for {missing[:5]} (of {len(missing)}); pass one "
                           "answer per turn-1 prompt id")
        answers = [first_answers.get(p.id, "") for p in first_turn_prompts]
    else:
        answers = list(first_answers)
        if len(answers) != len(first_turn_prompts):
            raise ValueError(f"got {len(answers)} answers for {len(first_turn_prompts)} turn-1 prompts; "
                             "pass them in the same order (or as a mapping id -> answer)")
    out, too_long = [], 0
    for prompt, answer in zip(first_turn_prompts, answers):
        if not prompt.followups:
            continue
        messages = [*prompt.messages, {"role": "assistant", "content": answer},
                    {"role": "user", "content": prompt.followups[0]}]
        ids = render_chat(tokenizer, messages)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        out.append(replace(prompt, id=f"{prompt.id}-turn2", messages=messages, input_ids=ids,
                           turn=prompt.turn + 1, followups=prompt.followups[1:]))
    if too_long:
        logger.warning("skipped %d second-turn prompts longer than max_prompt_tokens=%d",
                       too_long, max_prompt_tokens)
    return out


def _jsonl_candidates(path: Path) -> list[Candidate]:
    out = []
    for lineno, obj in read_jsonl(path):
        if "turns" in obj:
            cand = mtbench_line(obj, path, lineno)
            cand.id = f"{path.stem}-{obj.get('question_id', obj.get('id', lineno))}"
        elif isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
            cand = Candidate(id=f"{path.stem}-{obj.get('id', lineno)}",
                              category=str(obj.get("category", "custom")),
                              messages=[{"role": "user", "content": obj["prompt"]}])
        else:
            raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": non-empty string}} or an MT-bench "
                             f"line with \"turns\"; got keys {sorted(obj)}")
        out.append(cand)
    return out


def _seeded_order(candidates: list[Candidate], seed: int) -> list[int]:
    """Candidate indices in a seeded order that alternates categories (first-seen category first)."""
    rng = random.Random(seed)
    by_category: dict[str, list[int]] = {}
    for i, cand in enumerate(candidates):
        by_category.setdefault(cand.category, []).append(i)
    queues = list(by_category.values())
    for queue in queues:
        rng.shuffle(queue)
    order = []
    for rank in range(max(len(q) for q in queues)):
        order.extend(q[rank] for q in queues if rank < len(q))
    return order


def _select_and_render(candidates: list[Candidate], tokenizer, num_prompts: int | None, seed: int,
                       max_prompt_tokens: int | None, name: str) -> list[EvalPrompt]:
    want = len(candidates) if num_prompts is None else num_prompts
    chosen: list[tuple[int, EvalPrompt]] = []
    too_long = 0
    # Render lazily in seeded order: held-out ShareGPT has ~17k conversations, we need a few hundred.
    for i in _seeded_order(candidates, seed):
        if len(chosen) == want:
            break
        cand = candidates[i]
        ids = render_chat(tokenizer, cand.messages)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        chosen.append((i, EvalPrompt(id=cand.id, category=cand.category, messages=cand.messages,
                                     input_ids=ids, followups=cand.followups)))
    if not chosen:
        raise ValueError(f"no prompt of {name!r} fits max_prompt_tokens={max_prompt_tokens} "
                         f"({too_long} too long); raise max_prompt_tokens")
    if len(chosen) < want:
        logger.warning("%s: asked for %d prompts, only %d available (%d skipped as longer than "
                       "max_prompt_tokens=%s)", name, want, len(chosen), too_long, max_prompt_tokens)
    chosen.sort(key=lambda pair: pair[0])  # file order, so reports list prompts the way the source does
    return [prompt for _, prompt in chosen]


def config_prompts(cfg, tokenizer) -> list:
    """The eval config's prompt set, rendered with `tokenizer`'s chat template (one place, so the report,
    the prompt-lookup peer and the N-gram sweep always measure the same prompts)."""
    prompts = load_eval_prompts(cfg.dataset, tokenizer, num_prompts=cfg.num_prompts, both_turns=cfg.both_turns,
                                seed=cfg.seed, heldout_skip=cfg.heldout_skip or 0,
                                max_prompt_tokens=cfg.max_prompt_tokens)
    if not prompts:
        raise ValueError(f"no prompts left from dataset={cfg.dataset!r} (max_prompt_tokens={cfg.max_prompt_tokens})")
    return prompts
