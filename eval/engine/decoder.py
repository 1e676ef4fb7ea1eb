"""The speculative decoding loop, shared by every drafter and by the AR baseline (docs/concepts.md#verification).

    prefill(prompt) -> root = the base's token after the prompt        (counted as a new token,
                                                                          not as a decode step)
    repeat:  tree   = drafter.propose(state)                             draft_time
             logits = backend.forward_tree(tree)                         verify_time (forward +
             path, bonus = accept(tree, logits); backend.commit(path)     acceptance + commit)
             emit the accepted drafts + bonus; the bonus is the next root

Acceptance length = tokens produced by decode steps / decode steps = mean(accepted drafts + 1). The
prefill's token is excluded from both (it costs the prefill forward, not a decode step), so plain AR
decoding is exactly 1.0. Step lengths are counted before EOS / max_new_tokens truncation, so they
measure the drafter, not where the sequence happened to stop.

`autoregressive_generate` is the same loop with a 1-node tree per step, so AR and speculative timings
come from the same code.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from eval.engine.acceptance import Accepted, greedy_accept, rejection_accept, typical_accept
from eval.engine.backends.backend import Backend
from eval.engine.drafters.drafter import DecodeState, Drafter, NoDrafter
from eval.engine.sampling import check_sampling_params, sample, warped_probs
from eval.engine.top2 import near_ties_rows, top2_rows
from eval.engine.tree import Tree

ACCEPTANCE_RULES = ("greedy", "typical", "rejection")


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens (prompt excluded; first = the prefill's token), cut after EOS / at max
    accepted_lengths: list[int]  # per decode step: accepted drafts + 1 (bonus), before truncation
    prompt_len: int = 0
    prefill_time: float = 0.0  # seconds (synchronised on CUDA)
    draft_time: float = 0.0  # all drafter.propose calls
    verify_time: float = 0.0  # all base tree forwards + acceptance + KV commit
    accept_counts: list[int] = field(default_factory=list)  # [k]: steps with >= k+1 accepted drafts
    proposed_counts: list[int] = field(default_factory=list)  # [k]: steps whose tree reached depth k+1
    tree_nodes: int = 0  # total nodes verified (root included) over all steps
    stop_reason: str = "length"  # "eos" | "length"
    # record_top2 only (eval/harness/lossless.py): per token in `tokens`, the base's top1 - top2 logit gap and its
    # rank-2 token in the logits row that chose it; computed outside the timed regions.
    top2_gaps: list[float] = field(default_factory=list)
    runner_up: list[int] = field(default_factory=list)
    near_ties: list[list] = field(default_factory=list)  # per token: [[token, top1 - its logit], ...] (top2.py)

    @property
    def base_steps(self) -> int:
        """Base forward passes in decode (prefill excluded)."""
        return len(self.accepted_lengths)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per decode step, bonus counted (AR = 1.0); nan when no decode step ran."""
        return sum(self.accepted_lengths) / self.base_steps if self.base_steps else float("nan")

    @property
    def decode_time(self) -> float:
        return self.draft_time + self.verify_time

    @property
    def accept_rate_per_position(self) -> list[float]:
        """[k]: fraction of steps (whose tree had depth k+1) in which the depth-(k+1) draft was accepted."""
        return [a / p if p else 0.0 for a, p in zip(self.accept_counts, self.proposed_counts)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_token(logits: torch.Tensor, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> int:
    """The base's own choice from one row of logits [V]: argmax at T == 0, else a warped sample."""
    if temperature == 0:
        return int(logits.argmax())
    return sample(warped_probs(logits, temperature, top_p), generator)


def speculative_generate(backend: Backend, drafter: Drafter, prompt_ids, *, max_new_tokens: int,
                         eos_ids: Iterable[int] | None = (), acceptance: str = "greedy",
                         temperature: float = 0.0, top_p: float = 1.0, typical_eps: float = 0.09,
                         typical_delta: float = 0.3, generator: torch.Generator | None = None,
                         record_top2: bool = False) -> GenerationResult:
    """Generate up to `max_new_tokens` after `prompt_ids` ([T] ints), verifying `drafter`'s trees.

    acceptance: "greedy" (T must be 0; lossless), "typical" (Medusa; equals greedy at T == 0) or
    "rejection" (lossless sampling for T > 0; at T == 0 it is greedy). Stops after the first token in
    `eos_ids` (kept in the output) or at max_new_tokens. record_top2: also keep, per emitted token, the
    top-2 logit gap and runner-up of the row that chose it (the tie-aware losslessness check's evidence).
    """
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {acceptance!r}")
    check_sampling_params(temperature, top_p)
    if acceptance == "greedy" and temperature > 0:
        raise ValueError("greedy acceptance needs temperature=0; use acceptance='rejection' (lossless) or "
                         "'typical' to sample")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).cpu()
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty; the base needs at least one token to predict from")
    eos = set(eos_ids or ())
    dev = backend.device
    rule = "greedy" if temperature == 0 and acceptance == "rejection" else acceptance

    def accept(tree: Tree, logits: torch.Tensor) -> Accepted:
        if rule == "greedy":
            return greedy_accept(tree, logits)
        if rule == "typical":
            return typical_accept(tree, logits, temperature=temperature, top_p=top_p, eps=typical_eps,
                                  delta=typical_delta, generator=generator)
        return rejection_accept(tree, logits, temperature=temperature, top_p=top_p, generator=generator)

    room = prompt.numel() + max_new_tokens + drafter.max_nodes
    ids = torch.empty(room, dtype=torch.long)  # committed tokens live in ids[:n_ids]
    ids[: prompt.numel()] = prompt
    n_ids = prompt.numel()
    backend.reset(room)
    drafter.reset()
    # EAGLE-3 reads aux base layers: have the backend capture them (and stop capturing for other drafters).
    aux_layers = tuple(getattr(drafter, "aux_layers", None) or ())
    if aux_layers or backend.aux_layers:
        backend.set_aux_layers(aux_layers)

    _sync(dev)
    t0 = time.perf_counter()
    logits, hidden = backend.prefill(prompt.to(dev))
    root = _first_token(logits[-1], temperature, top_p, generator)
    _sync(dev)
    result = GenerationResult(tokens=[root], accepted_lengths=[], prompt_len=prompt.numel(),
                              prefill_time=time.perf_counter() - t0)
    if record_top2:
        _record_top2(result, logits[-1:])
    new_hidden, new_ids = hidden, prompt
    new_aux = backend.last_aux if aux_layers else None
    stopped = root in eos or max_new_tokens <= 1
    if root in eos:
        result.stop_reason = "eos"

    while not stopped:
        state = DecodeState(ids=ids[:n_ids], root=root, new_hidden=new_hidden, new_ids=new_ids,
                            temperature=temperature, top_p=top_p, generator=generator, new_aux=new_aux)
        t0 = time.perf_counter()
        tree = drafter.propose(state)
        _sync(dev)
        t1 = time.perf_counter()
        _check_tree(tree, root, drafter)
        logits, hidden = backend.forward_tree(tree.tokens.to(dev), tree.depths.to(dev), tree.mask.to(dev))
        acc = accept(tree, logits)
        backend.commit(acc.path.to(dev))
        _sync(dev)
        result.draft_time += t1 - t0
        result.verify_time += time.perf_counter() - t1

        # Bookkeeping: acceptance per depth, then emit drafts + bonus with EOS / length truncation.
        n_acc = acc.num_accepted
        depth = tree.max_depth
        _grow(result.accept_counts, depth)
        _grow(result.proposed_counts, depth)
        for k in range(depth):
            result.proposed_counts[k] += 1
            result.accept_counts[k] += int(k < n_acc)
        result.accepted_lengths.append(n_acc + 1)
        result.tree_nodes += tree.num_nodes
        committed = tree.tokens[acc.path]  # [m] root + accepted drafts, now in the KV cache
        n_before = len(result.tokens)
        for tok in committed[1:].tolist() + [acc.bonus]:
            result.tokens.append(tok)
            if tok in eos:
                result.stop_reason, stopped = "eos", True
                break
            if len(result.tokens) >= max_new_tokens:
                stopped = True
                break
        if record_top2:  # row path[j] chose the token after node path[j] (accepted drafts, then the bonus)
            _record_top2(result, logits[acc.path.to(logits.device)][: len(result.tokens) - n_before])
        ids[n_ids : n_ids + committed.numel()] = committed
        n_ids += committed.numel()
        new_hidden, new_ids, root = hidden[acc.path.to(hidden.device)], committed, acc.bonus
        if aux_layers:
            new_aux = backend.last_aux[acc.path.to(backend.last_aux.device)]
    return result


def autoregressive_generate(backend: Backend, prompt_ids, *, max_new_tokens: int,
                            eos_ids: Iterable[int] | None = (), temperature: float = 0.0, top_p: float = 1.0,
                            generator: torch.Generator | None = None, record_top2: bool = False
                            ) -> GenerationResult:
    """Plain decoding on the same engine: a 1-node tree per step (greedy at T == 0, sampling otherwise).
    record_top2: keep each token's top-2 logit gap and runner-up (eval/harness/lossless.py), outside the timings."""
    return speculative_generate(backend, NoDrafter(), prompt_ids, max_new_tokens=max_new_tokens,
                                eos_ids=eos_ids, acceptance="greedy" if temperature == 0 else "rejection",
                                temperature=temperature, top_p=top_p, generator=generator, record_top2=record_top2)


def _record_top2(result: GenerationResult, rows: torch.Tensor) -> None:
    """Append (top1 - top2 gap, rank-2 token, near ties) of each logits row [n, V] to the result."""
    if rows.shape[0] == 0:
        return
    gaps, runner_up = top2_rows(rows)
    result.top2_gaps.extend(gaps)
    result.runner_up.extend(runner_up)
    result.near_ties.extend(near_ties_rows(rows))


def _check_tree(tree: Tree, root: int, drafter: Drafter) -> None:
    if int(tree.tokens[0]) != root:
        raise ValueError(f"{drafter.name}: the tree's node 0 is token {int(tree.tokens[0])} but the root "
                         f"(the base's next token) is {root}; build trees with the state's root as node 0")
    if tree.num_nodes > drafter.max_nodes:
        raise ValueError(f"{drafter.name}: proposed {tree.num_nodes} nodes but declares max_nodes="
                         f"{drafter.max_nodes}; raise max_nodes (the decoder reserves KV room for it)")


def _grow(counts: list[int], n: int) -> None:
    counts.extend([0] * (n - len(counts)))


def eos_ids(model, tokenizer) -> list[int]:
    ids = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
