"""The paper's synthetic experiment: one attention layer (FPA vs FoX vs softmax) on tasks whose targets are
subsets of keys "left alive by later dips".

Model: token embedding -> ONE `fpa_model.attention.Attention` layer -> linear readout, at every position.
All kinds get the same head count and head dimension; only the attention kind differs.

Tasks (vocabulary: BOS = 0, values 1..V, then the task's markers):

- `stack`: after BOS, PUSH v (a value token) and POP tokens, depth kept in [0, max_depth]. Target at every
  position: the SET of values on the stack (multi-hot, scored by exact match). Popped values are younger
  than the values still below them, so the alive set is not a recency window.
- `txn`: non-nested transactions over a bag of written values: WRITE v (a value token), BEGIN, COMMIT,
  ROLLBACK. Target: the set of values currently visible (committed writes, writes outside transactions
  and the open transaction's own writes); a ROLLBACK erases every write since its BEGIN, however many.
- `recency` (sanity control, FoX's home ground): values and FILL tokens; target at FILL positions: the
  most recent value (single label, cross-entropy).

Why one FPA head with a small constant head dimension solves the set tasks (`construct_fpa` builds it):
walk field, value tokens step 0 (txn) / +A (stack), POP -A, BEGIN +A, ROLLBACK -A, everything else 0.
Then a value's level phi_j is never undercut while it is alive (b_ij = 0), and the marker that removes it
dips the field below phi_j for good (b_ij <= -A, sticky). q.k only has to prefer value keys over marker
keys, and values carry one-hot-ish vectors, so the readout sees the uniform mixture of the alive values:
the multi-hot set is a threshold away. The construction uses one dimension per token type (V + markers
+ 1); it does not grow with the sequence length or with the number of erased keys (tests check T=128
with the same weights). Trained FPA heads find this solution: their learned steps are +A at pushes and
BEGIN, about -A at POP and ROLLBACK, about 0 elsewhere (recorded per run as `token_increments`).

Why FoX cannot: its bias phi_i - phi_j is monotone in age, so among keys of the same content an older key
is always decayed at least as much as a younger one; a popped (younger) value can never be suppressed
below an alive older one of the same kind. Softmax without positions sees a bag of tokens, and a bag does
not tell which values were popped. With RoPE, a single head only sees relative offsets, not the nesting.
In this one-layer model the values depend on the token alone, so a head's output lies in the span of
the vocabulary's value vectors: widening the head does not add information for FoX or softmax.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fpa_model.attention import Attention
from fpa_model.config import ATTENTION_IMPLS, AttentionConfig
from pipeline.atomic import atomic_write, atomic_write_text
from pipeline.trainer.schedule import warmup_cosine

BOS = 0

# ----------------------------------------------------------------------------------------------------
# Tasks


@dataclass
class Batch:
    tokens: Tensor  # (B, T) int64
    targets: Tensor  # (B, T) int64 class index (single label) or (B, T, V) float multi-hot (set tasks)
    mask: Tensor  # (B, T) bool: positions that are scored (queries with a non-trivial answer)


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    title: str  # short plot title
    multi_label: bool  # True: target is a set of values (multi-hot, exact-match accuracy)
    markers: tuple[str, ...]  # marker token names, ids V+1, V+2, ...
    generate: Callable[[np.random.Generator, int, int, int], Batch]  # (rng, batch, seq_len, n_values)

    def vocab_size(self, n_values: int) -> int:
        return 1 + n_values + len(self.markers)

    def token_names(self, n_values: int) -> list[str]:
        return ["BOS", *(f"v{i}" for i in range(n_values)), *self.markers]


def _gen_stack(
    rng: np.random.Generator, batch: int, seq_len: int, n_values: int, max_depth: int = 4
) -> Batch:
    """PUSH v / POP sequences; target = set of values on the stack after each token."""
    pop_tok = n_values + 1
    tokens = np.zeros((batch, seq_len), dtype=np.int64)
    targets = np.zeros((batch, seq_len, n_values), dtype=np.float32)
    stack = np.zeros((batch, max_depth), dtype=np.int64)
    depth = np.zeros(batch, dtype=np.int64)
    counts = np.zeros((batch, n_values), dtype=np.int64)
    rows = np.arange(batch)
    for t in range(1, seq_len):
        push = rng.random(batch) < 0.5
        push = np.where(depth == 0, True, np.where(depth == max_depth, False, push))
        vals = rng.integers(0, n_values, batch)
        pb = rows[push]
        stack[pb, depth[pb]] = vals[pb]
        counts[pb, vals[pb]] += 1
        depth[pb] += 1
        qb = rows[~push]
        depth[qb] -= 1
        counts[qb, stack[qb, depth[qb]]] -= 1
        tokens[:, t] = np.where(push, vals + 1, pop_tok)
        targets[:, t] = counts > 0
    mask = np.ones((batch, seq_len), dtype=bool)
    mask[:, 0] = False
    return Batch(torch.from_numpy(tokens), torch.from_numpy(targets), torch.from_numpy(mask))


def _gen_txn(rng: np.random.Generator, batch: int, seq_len: int, n_values: int) -> Batch:
    """WRITE v / BEGIN / COMMIT / ROLLBACK (no nesting); target = set of visible values."""
    begin, commit, rollback = n_values + 1, n_values + 2, n_values + 3
    tokens = np.zeros((batch, seq_len), dtype=np.int64)
    targets = np.zeros((batch, seq_len, n_values), dtype=np.float32)
    done = np.zeros((batch, n_values), dtype=np.int64)  # committed writes and writes outside transactions
    pending = np.zeros((batch, n_values), dtype=np.int64)  # the open transaction's writes
    in_txn = np.zeros(batch, dtype=bool)
    rows = np.arange(batch)
    for t in range(1, seq_len):
        r = rng.random(batch)
        vals = rng.integers(0, n_values, batch)
        # Outside: BEGIN 0.75, WRITE 0.25. Inside: WRITE 0.5, COMMIT 0.15, ROLLBACK 0.35 (rollbacks
        # dominate so the visible set stays small and the erased writes outnumber the kept ones).
        tok = np.where(
            in_txn,
            np.where(r < 0.5, vals + 1, np.where(r < 0.65, commit, rollback)),
            np.where(r < 0.75, begin, vals + 1),
        )
        # The last position never opens a transaction it cannot close meaningfully; harmless either way.
        w = tok <= n_values
        wo, wi = rows[w & ~in_txn], rows[w & in_txn]
        done[wo, vals[wo]] += 1
        pending[wi, vals[wi]] += 1
        c = rows[tok == commit]
        done[c] += pending[c]
        pending[c] = 0
        pending[rows[tok == rollback]] = 0
        in_txn = np.where(tok == begin, True, np.where((tok == commit) | (tok == rollback), False, in_txn))
        tokens[:, t] = tok
        targets[:, t] = (done + pending) > 0
    mask = np.ones((batch, seq_len), dtype=bool)
    mask[:, 0] = False
    return Batch(torch.from_numpy(tokens), torch.from_numpy(targets), torch.from_numpy(mask))


def _gen_recency(
    rng: np.random.Generator, batch: int, seq_len: int, n_values: int, p_value: float = 0.3
) -> Batch:
    """Values and FILL; target at FILL positions = the most recent value (the control task)."""
    fill = n_values + 1
    is_val = rng.random((batch, seq_len)) < p_value
    is_val[:, 1] = True  # every query has an answer
    is_val[:, 0] = False
    vals = rng.integers(0, n_values, (batch, seq_len))
    tokens = np.where(is_val, vals + 1, fill)
    tokens[:, 0] = BOS
    # Forward-fill the last value index.
    idx = np.where(is_val, np.arange(seq_len)[None, :], 0)
    last = np.maximum.accumulate(idx, axis=1)
    targets = np.take_along_axis(vals, last, axis=1)
    mask = ~is_val
    mask[:, :2] = False
    return Batch(torch.from_numpy(tokens), torch.from_numpy(targets.astype(np.int64)), torch.from_numpy(mask))


TASKS: dict[str, Task] = {
    "stack": Task(
        "stack",
        "set of values on a push/pop stack",
        "set on a push/pop stack",
        True,
        ("POP",),
        _gen_stack,
    ),
    "txn": Task(
        "txn",
        "set of visible values under BEGIN/COMMIT/ROLLBACK",
        "visible set, BEGIN/COMMIT/ROLLBACK",
        True,
        ("BEGIN", "COMMIT", "ROLLBACK"),
        _gen_txn,
    ),
    "recency": Task(
        "recency",
        "most recent value (control: FoX can do it)",
        "most recent value (control)",
        False,
        ("FILL",),
        _gen_recency,
    ),
}


# ----------------------------------------------------------------------------------------------------
# Model


@dataclass
class SynthConfig:
    n_values: int = 8  # distinct value tokens V
    seq_len: int = 32
    d_model: int = 16
    n_head: int = 1  # head dim = d_model / n_head, the same for every kind
    batch: int = 64
    steps: int = 800
    # 3e-2: FPA converges about twice as fast as at 1e-2; FoX / softmax plateau at the same accuracy for
    # lr in {3e-3, 3e-2} and up to 1500 steps (measured), so the common lr does not favour FPA.
    lr: float = 3e-2
    warmup: int = 30
    weight_decay: float = 0.0
    eval_every: int = 50
    eval_sequences: int = 512
    target_acc: float = 0.98  # "converged": final held-out accuracy at least this
    long_mult: int = 4  # the trained model is also scored on sequences this many times longer (0: skip)
    # fpa_attention implementation. naive, not auto (= chunked on CPU): at T=32, batch 64 one fwd+bwd takes
    # 4.4 ms naive vs 13.0 ms chunked for fpa (2.5 vs 5.8 for fox); they cross near T=128.
    impl: str = "naive"


# Kind labels of the experiment -> attention config. softmax gets no positions by default (a bag of
# tokens); softmax_rope is the usual positional baseline. fox = gate field with the phi_i - phi_j bias.
KINDS: dict[str, dict] = {
    "fpa": {"kind": "fpa", "field": "walk"},
    "fox": {"kind": "fox"},
    "softmax": {"kind": "softmax", "rope": False},
    "softmax_rope": {"kind": "softmax", "rope": True},
}


class OneLayer(nn.Module):
    """Token embedding -> one attention layer -> linear readout at every position."""

    def __init__(
        self,
        vocab_size: int,
        n_out: int,
        d_model: int,
        n_head: int,
        attn_cfg: AttentionConfig,
        max_seq_len: int,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.attn = Attention(d_model, n_head, attn_cfg, max_seq_len)
        self.readout = nn.Linear(d_model, n_out)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.readout(self.attn(self.embed(tokens)))


def attention_config(kind: str, impl: str = "auto") -> AttentionConfig:
    if kind not in KINDS:
        raise ValueError(f"unknown synthetic kind {kind!r}; expected one of {', '.join(KINDS)}")
    return AttentionConfig(impl=impl, **KINDS[kind])


def build_model(task: Task, kind: str, cfg: SynthConfig) -> OneLayer:
    return OneLayer(
        task.vocab_size(cfg.n_values),
        cfg.n_values,  # one output per value: a class (single label) or a set member (multi-hot)
        cfg.d_model,
        cfg.n_head,
        attention_config(kind, cfg.impl),
        cfg.seq_len,
    )


# ----------------------------------------------------------------------------------------------------
# Training and evaluation


def _loss_and_correct(task: Task, logits: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
    """Mean loss over scored positions and a per-position bool of exact correctness."""
    m = batch.mask
    if task.multi_label:
        lg, tg = logits[m], batch.targets[m]
        loss = F.binary_cross_entropy_with_logits(lg, tg)
        correct = ((lg > 0) == (tg > 0.5)).all(-1)
    else:
        lg, tg = logits[m], batch.targets[m]
        loss = F.cross_entropy(lg, tg)
        correct = lg.argmax(-1) == tg
    return loss, correct


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, batch: Batch) -> float:
    model.eval()
    _, correct = _loss_and_correct(task, model(batch.tokens), batch)
    model.train()
    return float(correct.float().mean())


EVAL_SEED = 20_261_202  # one held-out set per task (and config), shared by every kind and seed


def eval_batch_for(task: Task, cfg: SynthConfig, seq_len: int | None = None) -> Batch:
    """The held-out set: independent of the training seed, so every run of a task is scored on the same
    sequences (training streams use default_rng([seed, 1]) and never meet this one)."""
    t = cfg.seq_len if seq_len is None else seq_len
    return task.generate(np.random.default_rng([EVAL_SEED, 2, t]), cfg.eval_sequences, t, cfg.n_values)


def train_one(task: Task, kind: str, seed: int, cfg: SynthConfig) -> dict:
    """Train one model on fresh batches for cfg.steps steps; return its record (with the curve)."""
    torch.manual_seed(seed)
    model = build_model(task, kind, cfg)
    rng = np.random.default_rng([seed, 1])
    eval_batch = eval_batch_for(task, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    def lr_at(step: int) -> float:  # linear warmup, cosine to 10% (the trainer's schedule)
        return warmup_cosine(step, lr=cfg.lr, warmup=cfg.warmup, total=cfg.steps, min_ratio=0.1)

    curve: list[tuple[int, float]] = []
    first_hit: int | None = None
    t0 = time.perf_counter()
    loss_val = float("nan")
    diverged = False
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        batch = task.generate(rng, cfg.batch, cfg.seq_len, cfg.n_values)
        loss, _ = _loss_and_correct(task, model(batch.tokens), batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = float(loss.detach())
        if not math.isfinite(loss_val):  # record the run as failed instead of aborting the whole sweep
            diverged = True
            curve.append((step + 1, 0.0))
            break
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            acc = evaluate(model, task, eval_batch)
            curve.append((step + 1, acc))
            if first_hit is None and acc >= cfg.target_acc:
                first_hit = step + 1
    final = curve[-1][1]
    return {
        "task": task.name,
        "kind": kind,
        "seed": seed,
        "steps": cfg.steps,
        "final_acc": final,
        # Length generalization: the same weights on sequences long_mult times longer than in training.
        "long_acc": (
            evaluate(model, task, eval_batch_for(task, cfg, cfg.seq_len * cfg.long_mult))
            if cfg.long_mult > 0
            else None
        ),
        "best_acc": max(a for _, a in curve),
        "converged": final >= cfg.target_acc,
        "first_step_at_target": first_hit,
        "final_loss": loss_val,
        "diverged": diverged,
        "seconds": time.perf_counter() - t0,
        "curve": curve,
        "token_increments": token_increments(model, task, cfg.n_values),
    }


@torch.no_grad()
def token_increments(model: OneLayer, task: Task, n_values: int) -> dict[str, list[float]] | None:
    """The learned field increment u per token type and head (what the field does at each token), or
    None for softmax. For FPA on the set tasks the construction predicts +A at pushes / BEGIN, -A at
    POP / ROLLBACK and about 0 elsewhere; for FoX, log forget gates."""
    attn = model.attn
    if attn.field_proj is None:
        return None
    _, _, _, u = attn.project(model.embed.weight[None])  # (1, H, vocab): every token type once
    assert u is not None
    if attn.field_mode == "direct":
        return None
    names = task.token_names(n_values)
    return {name: [round(float(x), 4) for x in u[0, :, i]] for i, name in enumerate(names)}


# ----------------------------------------------------------------------------------------------------
# The construction: a hand-set FPA head that solves a set task exactly (expressibility, no training)


@torch.no_grad()
def construct_fpa(
    task_name: str, n_values: int, seq_len: int, *, dip: float = 30.0, gap: float = 80.0
) -> OneLayer:
    """One FPA head (walk field) with hand-set weights that solves `stack` or `txn` exactly.

    Embeddings are one-hot (values in dims 0..V-1, markers after them, BOS last), so d_model = V + markers
    + 1 and the head dimension is that number, whatever the sequence length. The field steps by +dip at
    tokens that open a level (a push, a BEGIN) and -dip at tokens that close it (POP, ROLLBACK): a closed
    level's keys get b <= -dip for good, while keys on or below the current level keep b = 0. q.k is +gap/4
    for value and BOS keys and -gap/4 for marker keys, so the head averages the alive values and the BOS
    sink (value 0). The readout thresholds each value's share at half of the smallest possible share.
    """
    if task_name not in ("stack", "txn"):
        raise ValueError(f"construct_fpa builds the set tasks 'stack' and 'txn'; got {task_name!r}")
    task = TASKS[task_name]
    vocab = task.vocab_size(n_values)
    d = vocab  # one dim per token id
    cfg = AttentionConfig(kind="fpa", field="walk", impl="auto")
    model = OneLayer(vocab, n_values, d, 1, cfg, seq_len)
    dim_of = torch.arange(vocab)
    dim_of[BOS] = vocab - 1  # BOS in the last dim, value v (token v+1) in dim v, markers after the values
    dim_of[1:] = torch.arange(vocab - 1)
    emb = torch.zeros(vocab, d)
    emb[torch.arange(vocab), dim_of] = 1.0
    model.embed.weight.copy_(emb)

    is_marker = torch.zeros(d)
    is_marker[n_values : vocab - 1] = 1.0
    wq = torch.zeros(d, d)
    wk = torch.zeros(d, d)
    wv = torch.zeros(d, d)
    # Every query token asks the same question; the op scales q.k by 1/sqrt(d), undone here so the
    # logit is exactly +gap/4 for value and BOS keys and -gap/4 for marker keys.
    wq[0, :] = gap / 4.0 * math.sqrt(d)
    wk[0, :] = 1.0 - 2.0 * is_marker
    wv[:n_values, :n_values] = torch.eye(n_values)  # values carry their one-hot; markers and BOS carry 0
    model.attn.qkv.weight.copy_(torch.cat([wq, wk, wv], 0))
    model.attn.out_proj.weight.copy_(torch.eye(d))

    step = torch.zeros(d)
    if task_name == "stack":
        step[:n_values] = dip  # a push opens a level
        step[n_values] = -dip  # POP closes it
    else:
        step[n_values] = dip  # BEGIN
        step[n_values + 2] = -dip  # ROLLBACK (COMMIT keeps the level: its writes stay alive)
    model.attn.field_proj.weight.copy_(step[None, :])
    model.attn.field_proj.bias.zero_()

    # Shares of the alive values are >= 1 / (alive keys + BOS) >= 1 / seq_len; threshold at half of that.
    thresh = 0.5 / seq_len
    sharp = 40.0 * seq_len
    readout = torch.zeros(n_values, d)
    readout[:, :n_values] = sharp * torch.eye(n_values)
    model.readout.weight.copy_(readout)
    model.readout.bias.fill_(-sharp * thresh)
    return model


# ----------------------------------------------------------------------------------------------------
# The experiment: task x kind x seed, written as markdown + CSV + JSON + PNG


def _chance(task: Task, cfg: SynthConfig) -> float:
    """Reference accuracy of an order-blind answer on the eval set: "every value that occurred so far" for
    the set tasks (what a bag of tokens suggests), 1/V chance for the single-label task."""
    if not task.multi_label:
        return 1.0 / cfg.n_values
    b = eval_batch_for(task, cfg)
    seen = torch.zeros_like(b.targets, dtype=torch.bool)
    for v in range(cfg.n_values):
        seen[..., v] = torch.cummax((b.tokens == v + 1).int(), dim=1).values.bool()
    return float(((seen == (b.targets > 0.5)).all(-1))[b.mask].float().mean())


def run_synthetic(
    out_dir: Path,
    *,
    tasks: Sequence[str] = tuple(TASKS),
    kinds: Sequence[str] = tuple(KINDS),
    seeds: Sequence[int] = (0, 1, 2),
    steps: int | None = None,
    quick: bool = False,
    cfg: SynthConfig | None = None,
    log: Callable[[str], None] | None = print,
) -> list[dict]:
    """Train every (task, kind, seed), write result.{md,csv,json} and synthetic.png into out_dir.

    quick: a short version (250 steps, 128 eval sequences) for smoke checks; steps overrides both.
    Returns one record per run (curve included).
    """
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown synthetic task {t!r}; expected one of {', '.join(TASKS)}")
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown synthetic kind {k!r}; expected one of {', '.join(KINDS)}")
    cfg = cfg or SynthConfig()
    if quick:
        cfg = SynthConfig(**{**asdict(cfg), "steps": 250, "eval_sequences": 128, "eval_every": 50})
    if steps is not None:
        cfg = SynthConfig(**{**asdict(cfg), "steps": steps})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    for task_name in tasks:
        task = TASKS[task_name]
        for kind in kinds:
            for seed in seeds:
                rec = train_one(task, kind, seed, cfg)
                records.append(rec)
                if log:
                    log(
                        f"{task_name:8s} {kind:12s} seed {seed}: acc {rec['final_acc']:.3f} "
                        f"({'converged' if rec['converged'] else 'not converged'}, {rec['seconds']:.1f}s)"
                    )
    constructed = {
        t: evaluate(
            construct_fpa(t, cfg.n_values, cfg.seq_len),
            TASKS[t],
            eval_batch_for(TASKS[t], cfg),
        )
        for t in tasks
        if t in ("stack", "txn")
    }
    chance = {t: _chance(TASKS[t], cfg) for t in tasks}
    _write_outputs(out_dir, records, cfg, constructed, chance)
    return records


_FIELDS = (
    "task",
    "kind",
    "seed",
    "steps",
    "final_acc",
    "best_acc",
    "long_acc",
    "converged",
    "first_step_at_target",
    "final_loss",
    "diverged",
    "seconds",
)


def _write_outputs(
    out_dir: Path, records: list[dict], cfg: SynthConfig, constructed: dict, chance: dict
) -> None:
    # Write to temp names, then rename: a crash never leaves a half-written table beside a good plot.
    def atomic(name: str, text: str) -> None:
        atomic_write_text(out_dir / name, text)

    rows = [{k: r[k] for k in _FIELDS} for r in records]
    from io import StringIO

    buf = StringIO()
    w = csv.DictWriter(buf, fieldnames=list(_FIELDS), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic("result.csv", buf.getvalue())
    atomic(
        "result.json",
        json.dumps(
            {
                "config": asdict(cfg),
                "constructed_fpa_acc": constructed,
                "bag_baseline_acc": chance,
                "runs": records,
            },
            indent=1,
        ),
    )
    atomic("result.md", format_markdown(records, cfg, constructed, chance))
    _plot(out_dir / "synthetic.png", records, cfg)


def format_markdown(records: list[dict], cfg: SynthConfig, constructed: dict, chance: dict) -> str:
    """A summary (task x kind: converged seeds, mean and min final accuracy) and the per-run table."""
    tasks = list(dict.fromkeys(r["task"] for r in records))
    kinds = list(dict.fromkeys(r["kind"] for r in records))
    lines = [
        "# Synthetic one-layer experiment",
        "",
        f"One attention layer, {cfg.n_head} head(s) of dim {cfg.d_model // cfg.n_head}, "
        f"V={cfg.n_values} values, "
        f"T={cfg.seq_len}, {cfg.steps} steps of batch {cfg.batch}, lr {cfg.lr}. Converged = final held-out "
        f"exact accuracy >= {cfg.target_acc} ({cfg.eval_sequences} sequences, every scored position).",
        "",
        "## Summary (converged seeds / seeds, mean final accuracy [min])",
        "",
        "| task | " + " | ".join(kinds) + " | all-seen-values answer (set) / chance | hand-set FPA head |",
        "|---" * (len(kinds) + 3) + "|",
    ]
    for t in tasks:
        cells = []
        for k in kinds:
            rs = [r for r in records if r["task"] == t and r["kind"] == k]
            if not rs:
                cells.append("-")
                continue
            accs = [r["final_acc"] for r in rs]
            conv = sum(r["converged"] for r in rs)
            cells.append(f"{conv}/{len(rs)}, {np.mean(accs):.3f} [{min(accs):.3f}]")
        built = f"{constructed[t]:.3f}" if t in constructed else "-"
        lines.append(f"| {t} | " + " | ".join(cells) + f" | {chance.get(t, float('nan')):.3f} | {built} |")
    if any(r.get("long_acc") is not None for r in records):
        lines += [
            "",
            f"## Length generalization: the same weights at T={cfg.seq_len * cfg.long_mult} "
            f"({cfg.long_mult}x training length), mean accuracy [min]",
            "",
            "| task | " + " | ".join(kinds) + " |",
            "|---" * (len(kinds) + 1) + "|",
        ]
        for t in tasks:
            cells = []
            for k in kinds:
                accs = [r["long_acc"] for r in records if r["task"] == t and r["kind"] == k]
                accs = [a for a in accs if a is not None]
                cells.append(f"{np.mean(accs):.3f} [{min(accs):.3f}]" if accs else "-")
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
    learned = [r for r in records if r["kind"] == "fpa" and r.get("token_increments")]
    if learned:
        lines += ["", "## Learned FPA field steps u per token (first seed of each task, per head)", ""]
        for t in tasks:
            r = next((r for r in learned if r["task"] == t), None)
            if r is not None:
                steps = ", ".join(
                    f"{k} {'/'.join(f'{x:+.2f}' for x in v)}" for k, v in r["token_increments"].items()
                )
                lines.append(f"- {t} (seed {r['seed']}): {steps}")
    lines += [
        "",
        "## Runs",
        "",
        f"| task | kind | seed | final acc | best acc | acc at {cfg.long_mult}x length | converged "
        "| step at target | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['task']} | {r['kind']} | {r['seed']} | {r['final_acc']:.3f} | {r['best_acc']:.3f} | "
            f"{'-' if r.get('long_acc') is None else format(r['long_acc'], '.3f')} | "
            f"{'yes' if r['converged'] else 'no'} | {r['first_step_at_target'] or '-'} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _plot(path: Path, records: list[dict], cfg: SynthConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in records))
    kinds = list(dict.fromkeys(r["kind"] for r in records))
    colors = dict(zip(kinds, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    styles = dict(zip(kinds, ["-", "--", "-.", ":"] * 4))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    for ax, t in zip(axes[0], tasks):
        for k in kinds:
            for i, r in enumerate(r for r in records if r["task"] == t and r["kind"] == k):
                xs, ys = zip(*r["curve"])
                # Distinct dashes per kind: curves that coincide (several kinds at 1.0) stay visible.
                ax.plot(
                    xs, ys, color=colors[k], ls=styles[k], alpha=0.85, lw=1.4, label=k if i == 0 else None
                )
        ax.axhline(cfg.target_acc, color="gray", ls=":", lw=1)
        ax.set_title(f"{t}: {TASKS[t].title}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out exact accuracy")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m experiments.synthetic [--quick] [--out DIR] [--tasks ..] [--kinds ..] [--seeds N]`."""
    p = argparse.ArgumentParser(prog="fpa synthetic", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/synthetic"), help="output directory")
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke version")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--seeds", type=int, default=None, help="number of seeds 0..N-1 (default 3; --quick: 1)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run")
    p.add_argument("--lr", type=float, default=SynthConfig.lr)
    p.add_argument("--seq-len", type=int, default=SynthConfig.seq_len)
    p.add_argument("--d-model", type=int, default=SynthConfig.d_model)
    p.add_argument("--n-head", type=int, default=SynthConfig.n_head)
    # Every impl but triton: these tiny runs are CPU-sized.
    impls = [i for i in ATTENTION_IMPLS if i != "triton"]
    p.add_argument("--impl", default=SynthConfig.impl, choices=impls)
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.seeds is None:
        a.seeds = 1 if a.quick else 3
    if a.seeds < 1:
        p.error(f"--seeds must be >= 1; got {a.seeds}")
    if a.d_model % a.n_head:
        p.error(f"--n-head ({a.n_head}) must divide --d-model ({a.d_model})")
    cfg = SynthConfig(lr=a.lr, seq_len=a.seq_len, d_model=a.d_model, n_head=a.n_head, impl=a.impl)
    records = run_synthetic(
        a.out, tasks=a.tasks, kinds=a.kinds, seeds=range(a.seeds), steps=a.steps, quick=a.quick, cfg=cfg
    )
    print((a.out / "result.md").read_text())
    return 0 if records else 1


if __name__ == "__main__":
    raise SystemExit(main())
