"""Run configuration: OmegaConf YAML files + CLI dotlist overrides merged into typed dataclasses.

Every YAML file and every override is merged one at a time onto the typed schema, so an unknown key, a
wrong type or a bad value is reported with the key, where it came from, and a did-you-mean hint.
Derived values (global batch, tokens per step) are computed and checked in one place: `derive()`.
A YAML file may name files to merge before itself with `base: [relative/path.yaml, ...]`.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from data_prep.config import COMMON_SOURCE_KEYS, SOURCE_KEYS, DataConfig, SourceConfig, kept_source_keys
from fpa_model.config import SP_LAYOUTS, SP_MODES, ModelConfig

log = logging.getLogger("fpa")


class ConfigError(Exception):
    """A configuration problem, reported to the user as one line."""


def _check_number(
    key: str, value: float | None, *, low: float, high: float = math.inf, open_low: bool
) -> None:
    """value in [low, high] (or (low, high] with open_low); also refuses NaN and infinities."""
    if value is None:
        return
    ok = math.isfinite(value) and (value > low if open_low else value >= low) and value <= high
    if not ok:
        bound = f"> {low}" if open_low else f">= {low}"
        if high != math.inf:
            bound = f"in {'(' if open_low else '['}{low}, {high}]"
        raise ValueError(f"{key} must be {bound}; got {value}")


@dataclass
class CheckpointConfig:
    every: int = 100  # steps between checkpoints (0: only at the end)
    keep_last: int = 3  # 0: keep all
    resume: str = "auto"  # auto (latest good checkpoint in the run dir) | none | <path to a checkpoint dir>

    def __post_init__(self) -> None:
        for key in ("every", "keep_last"):
            if getattr(self, key) < 0:
                raise ValueError(f"train.checkpoint.{key} must be >= 0; got {getattr(self, key)}")


@dataclass
class ProfileConfig:
    """train.profile: a window of steps traced with torch.profiler (pipeline.trainer.profiling)."""

    start: int = 0  # the first traced step (1-based, as logged); 0: off
    steps: int = 3  # steps traced from start
    ranks: list[int] = field(default_factory=lambda: [0])  # global ranks that trace
    memory: bool = True  # also the memory: CUDA's allocator snapshot, on CPU the profiler's per-op memory

    def __post_init__(self) -> None:
        if self.start < 0 or self.steps < 1:
            raise ValueError(f"train.profile needs start >= 0 and steps >= 1; got {self.start}, {self.steps}")
        if any(r < 0 for r in self.ranks):
            raise ValueError(f"train.profile.ranks must be ranks >= 0; got {list(self.ranks)}")


@dataclass
class PasskeyTrainConfig:
    """A passkey phase at the end of training: in each of the last `steps` optimizer steps, every micro
    step adds `batch` whole passkey prompts (data_prep.passkey.answer_rows) whose loss is on the answer
    alone, weighted by `weight`, to its language-model loss.

    At a tiny scale, passkey documents in the corpus (data.passkey_mix) teach the answer format but not the
    copy (the key is a few tokens among thousands of predictable ones), and training on passkey rows alone
    wrecks the language model; measured in the README ("Passkey retrieval at the tiny scale").
    """

    steps: int = 0  # 0: off; else the last `steps` of train.max_steps (all of them if steps >= max_steps)
    batch: int | None = None  # passkey rows per micro step; None: train.micro_batch
    weight: float = 1.0  # loss = language-model loss + weight * answer-only passkey loss
    digits: int = 5  # digits of the training keys (eval.passkey.digits is what the grid asks for)
    min_len: int = 64  # prompt length per step: uniform over the multiples of 16 in [min_len, max_len]
    max_len: int | None = None  # None: data.seq_len
    # Short prompts first: over the phase's first ramp_steps steps the longest prompt grows linearly from
    # min_len to max_len (0: the full range from the start). A needle a few dozen tokens back is still
    # visible through a freshly initialized field's decay, so the copy is found sooner; the long prompts
    # that follow teach it at the training length (and hence beyond).
    ramp_steps: int = 0
    # The prompts' task (data_prep/long_context.py): passkey, or multikey-K, multivalue-N, overwrite-N,
    # vartrack-N, with the same answer-only loss and ramp; the eval report says which task was taught.
    task: str = "passkey"

    def __post_init__(self) -> None:
        from data_prep.long_context import parse_task

        parse_task(self.task, "train.passkey.task")
        if self.ramp_steps < 0:
            raise ValueError(f"train.passkey.ramp_steps must be >= 0; got {self.ramp_steps}")
        if self.steps < 0:
            raise ValueError(f"train.passkey.steps must be >= 0; got {self.steps}")
        if self.batch is not None and self.batch < 1:
            raise ValueError(f"train.passkey.batch must be >= 1; got {self.batch}")
        if self.weight <= 0:
            raise ValueError(f"train.passkey.weight must be > 0; got {self.weight}")
        if self.digits < 1:
            raise ValueError(f"train.passkey.digits must be >= 1; got {self.digits}")
        if self.min_len < 1 or (self.max_len is not None and self.max_len < self.min_len):
            raise ValueError(
                f"train.passkey needs 1 <= min_len <= max_len; got {self.min_len}, {self.max_len}"
            )


@dataclass
class SpikeGuardConfig:
    """Loss spikes: a step whose loss exceeds factor x the median of the last `window` accepted step losses
    is skipped like a non-finite one (no update, counted) or stops training. Judged once `window` losses
    are in; the window is part of the checkpoint, so a resumed run judges exactly as an uninterrupted one."""

    factor: float = 0.0  # 0: off; else > 1 (e.g. 3.0)
    window: int = 50  # accepted steps the running median is taken over
    action: str = "skip"  # skip (drop the step, record it) | stop

    def __post_init__(self) -> None:
        if self.factor != 0:
            _check_number("train.spike_guard.factor", self.factor, low=1, open_low=True)
        if self.window < 1:
            raise ValueError(f"train.spike_guard.window must be >= 1; got {self.window}")
        if self.action not in ("skip", "stop"):
            raise ValueError(f"train.spike_guard.action must be skip or stop; got {self.action!r}")


@dataclass
class TrainConfig:
    micro_batch: int = 8  # sequences per rank per micro step
    grad_accum: int = 1
    # Sequences per optimizer step whatever the world size (a recipe's batch): grad_accum then follows,
    # global_batch / (micro_batch x data-parallel ranks), which must divide exactly. None: micro_batch x
    # grad_accum x data-parallel ranks.
    global_batch: int | None = None
    max_steps: int = 200
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay; pipeline.trainer.schedule)
    decay_fraction: float = 0.2  # wsd: the last fraction of max_steps decays
    decay_shape: str = "sqrt"  # wsd: linear | cosine | sqrt (1 - sqrt(progress))
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    zero_stage: int = 0
    # auto: bf16 on CUDA, fp32 on CPU (resolve_precision; load_config records the result). bf16 at ZeRO 1-3
    # is DeepSpeed's bf16 mode (fp32 master weights and gradient accumulation); at ZeRO-0, torch autocast
    # over fp32 weights and gradients (pipeline.trainer.step.autocast).
    precision: str = "auto"  # auto | fp32 | bf16
    nan_policy: str = "skip"  # skip (drop the step, record it) | stop
    max_skipped_steps: int = 10  # stop once this many steps were skipped for non-finite loss (or spikes)
    spike_guard: SpikeGuardConfig = field(default_factory=SpikeGuardConfig)
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    # torch.compile each block (inductor); the attention op is a custom op (fpa_model.ops.fpa.library), so
    # a block compiles to one graph. The same losses as eager to float tolerance.
    compile: bool = False
    # LM head + cross-entropy over chunks of this many tokens, never all fp32 logits at once (0: off)
    loss_chunk_tokens: int = 0
    adam_eps: float = 1e-8
    # MFU denominator per rank in FLOP/s (e.g. 989e12 for H100 bf16); None: a measured matmul peak.
    peak_flops_per_rank: float | None = None
    log_every: int = 10
    val_every: int = 50
    val_batches: int = 8
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    passkey: PasskeyTrainConfig = field(default_factory=PasskeyTrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"train.zero_stage must be 0, 1, 2 or 3; got {self.zero_stage}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"train.precision must be auto, fp32 or bf16; got {self.precision!r}")
        if self.nan_policy not in ("skip", "stop"):
            raise ValueError(f"train.nan_policy must be skip or stop; got {self.nan_policy!r}")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"train.schedule must be cosine or wsd; got {self.schedule!r}")
        if self.decay_shape not in ("linear", "cosine", "sqrt"):
            raise ValueError(f"train.decay_shape must be linear, cosine or sqrt; got {self.decay_shape!r}")
        _check_number("train.decay_fraction", self.decay_fraction, low=0, high=1, open_low=True)
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"train.loss_chunk_tokens must be >= 0; got {self.loss_chunk_tokens}")
        if self.loss_chunk_tokens and self.zero_stage == 3:
            raise ValueError(
                "train.loss_chunk_tokens needs train.zero_stage <= 2 (ZeRO-3 gathers the LM head's weight "
                "only inside the head's own forward); set train.loss_chunk_tokens=0 or a lower stage"
            )
        for key in ("micro_batch", "grad_accum", "max_steps", "log_every", "val_batches"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be >= 1; got {getattr(self, key)}")
        last = self.profile.start + self.profile.steps - 1
        if self.profile.start and last > self.max_steps:
            raise ValueError(
                f"train.profile traces steps {self.profile.start}-{last}, past train.max_steps="
                f"{self.max_steps}: lower train.profile.start or train.profile.steps"
            )
        if self.global_batch is not None and self.global_batch < 1:
            raise ValueError(f"train.global_batch must be >= 1 or null; got {self.global_batch}")
        for key in ("warmup_steps", "val_every", "max_skipped_steps"):  # val_every 0: no validation
            if getattr(self, key) < 0:
                raise ValueError(f"train.{key} must be >= 0; got {getattr(self, key)}")
        # A negative lr or ratio ascends the loss; a negative eps or weight decay makes AdamW diverge.
        _check_number("train.lr", self.lr, low=0, open_low=True)
        _check_number("train.min_lr_ratio", self.min_lr_ratio, low=0, high=1, open_low=False)
        _check_number("train.weight_decay", self.weight_decay, low=0, open_low=False)
        _check_number("train.adam_eps", self.adam_eps, low=0, open_low=True)
        _check_number("train.grad_clip", self.grad_clip, low=0, open_low=False)  # 0: no clipping
        _check_number("train.peak_flops_per_rank", self.peak_flops_per_rank, low=0, open_low=True)
        if len(self.betas) != 2 or not all(math.isfinite(b) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"train.betas must be two values in [0, 1); got {list(self.betas)}")


def _cuda_available() -> bool:
    import torch  # here, not at module level: loading a config should not need torch otherwise

    return bool(torch.cuda.is_available())


def resolve_precision(train: TrainConfig, cuda: bool | None = None) -> str:
    """The precision `train.precision` stands for: auto is bf16 on CUDA (every ZeRO stage) and fp32 on the
    CPU; fp32 and bf16 are kept. cuda=None asks torch."""
    if train.precision != "auto":
        return train.precision
    return "bf16" if (_cuda_available() if cuda is None else cuda) else "fp32"


@dataclass
class ParallelConfig:
    sequence: int = 1  # sequence-parallel degree (ranks sharing one sequence)
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    # ring: K/V/phi passed around the sp ranks (fpa_model.sequence_parallel); ulysses: all-to-all over heads
    sequence_mode: str = "ring"
    # zigzag: rank r holds chunks r and 2W-1-r of 2W (balanced causal work); contiguous: chunk r of W
    sequence_layout: str = "zigzag"

    def __post_init__(self) -> None:
        if self.sequence < 1:
            raise ValueError(f"parallel.sequence must be >= 1; got {self.sequence}")
        if self.sequence_mode not in SP_MODES:
            modes = " or ".join(SP_MODES)
            raise ValueError(f"parallel.sequence_mode must be {modes}; got {self.sequence_mode!r}")
        if self.sequence_layout not in SP_LAYOUTS:
            raise ValueError(
                f"parallel.sequence_layout must be {' or '.join(SP_LAYOUTS)}; got {self.sequence_layout!r}"
            )


@dataclass
class PasskeyConfig:
    enabled: bool = True  # false: skip the passkey grid (perplexity and report still run)
    length_multipliers: list[float] = field(default_factory=lambda: [1, 2, 4, 8])  # x data.seq_len tokens
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])  # needle depth in [0, 1]
    trials: int = 5  # prompts (random keys) per (length, depth) cell, decoded as one batch
    digits: int = 5  # digits of the pass key
    seed: int = 0  # key sampling seed: the same grid of keys for every run that shares it

    def __post_init__(self) -> None:
        if self.trials < 1 or self.digits < 1:
            raise ValueError(f"eval.passkey.trials and digits must be >= 1; got {self.trials}, {self.digits}")
        if not self.length_multipliers or any(m <= 0 for m in self.length_multipliers):
            raise ValueError(
                f"eval.passkey.length_multipliers must be > 0; got {list(self.length_multipliers)}"
            )
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"eval.passkey.depths must lie in [0, 1]; got {list(self.depths)}")


@dataclass
class CacheConfig:
    evict: bool = True  # also run the passkey grid with FPA/FoX key eviction (softmax never evicts)
    delta: float | None = None  # None: the sound bound per key (fpa_model/cache.py); a number: fixed
    margin: float = 2.0  # evicted keys together carry < exp(-margin) of any later query's softmax mass
    # Future |q|, |k| are assumed to stay below norm_slack x the largest seen so far (the bound's max|q|).
    norm_slack: float = 1.25
    prefill_chunk: int = 128  # prompt tokens per prefill step; keys are evicted between steps

    def __post_init__(self) -> None:
        if self.norm_slack < 1.0:
            raise ValueError(f"eval.cache.norm_slack must be >= 1; got {self.norm_slack}")
        if self.prefill_chunk < 1:
            raise ValueError(f"eval.cache.prefill_chunk must be >= 1; got {self.prefill_chunk}")


@dataclass
class HarnessConfig:
    """lm-evaluation-harness on the exported model (pipeline/evaluation/harness.py); no tasks: not run."""

    tasks: list[str] = field(default_factory=list)  # lm-eval task names, e.g. [lambada_openai, hellaswag]
    num_fewshot: int | None = None  # None: each task's default
    limit: float | None = None  # documents per task (>= 1) or a fraction of them (< 1); None: all
    batch_size: int = 1
    include_path: str | None = None  # a folder of extra task YAMLs (local tasks, run offline)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"eval.harness.batch_size must be >= 1; got {self.batch_size}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"eval.harness.limit must be > 0; got {self.limit}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"eval.harness.num_fewshot must be >= 0; got {self.num_fewshot}")


@dataclass
class LongContextConfig:
    """Long-context tasks beyond one passkey (data_prep/long_context.py), each a grid like the passkey's:
    lengths x needle depths, full and evicting cache (pipeline/evaluation/long_context.py). No tasks: off."""

    # passkey, multikey-K, multivalue-N, overwrite-N, vartrack-N (a bare name takes the default size)
    tasks: list[str] = field(default_factory=list)
    length_multipliers: list[float] | None = None  # x data.seq_len; None: eval.passkey.length_multipliers
    depths: list[float] | None = None  # target needle depth in [0, 1]; None: eval.passkey.depths
    trials: int | None = None  # prompts per cell; None: eval.passkey.trials
    digits: int | None = None  # digits of every value; None: eval.passkey.digits
    seed: int = 0  # prompt sampling seed: the same prompts for every run that shares it

    def __post_init__(self) -> None:
        from data_prep.long_context import parse_task

        ids = [parse_task(t, "eval.long_context.tasks").id for t in self.tasks]
        if len(set(ids)) < len(ids):
            raise ValueError(f"eval.long_context.tasks names a task twice: {list(self.tasks)}")
        for key in ("trials", "digits"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"eval.long_context.{key} must be >= 1; got {getattr(self, key)}")
        m = self.length_multipliers
        if m is not None and (not m or any(x <= 0 for x in m)):
            raise ValueError(f"eval.long_context.length_multipliers must be > 0; got {list(m)}")
        if self.depths is not None and (not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths)):
            raise ValueError(f"eval.long_context.depths must lie in [0, 1]; got {list(self.depths)}")


@dataclass
class EvalConfig:
    checkpoint: str | None = None  # None: the run's export (<run_dir>/export), else an export dir
    passkey: PasskeyConfig = field(default_factory=PasskeyConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    ppl_length_multipliers: list[float] = field(default_factory=lambda: [1, 2, 4])  # x data.seq_len
    ppl_bucket: int = 64  # positions per bucket of the loss-by-position curve
    ppl_sequences: int = 32  # windows per length (consecutive held-out sequences joined end to end)
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    long_context: LongContextConfig = field(default_factory=LongContextConfig)

    def __post_init__(self) -> None:
        if self.ppl_bucket < 1 or self.ppl_sequences < 1:
            raise ValueError(
                "eval.ppl_bucket and eval.ppl_sequences must be >= 1; "
                f"got {self.ppl_bucket}, {self.ppl_sequences}"
            )
        if any(m <= 0 for m in self.ppl_length_multipliers):
            raise ValueError(
                f"eval.ppl_length_multipliers must be > 0; got {list(self.ppl_length_multipliers)}"
            )


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"  # offline | online | disabled
    project: str = "fpa-pretrain"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    progress: bool = True  # console progress bars
    # W&B without console capture, system-stats thread or git probing (tests, quick CPU runs).
    quiet_wandb: bool = False

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(
                f"logging.wandb_mode must be offline, online or disabled; got {self.wandb_mode!r}"
            )


@dataclass
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    nodes: int = 1
    # torchrun agents per node, each starting gpus_per_node (or nproc_per_node) workers. 1 with GPUs;
    # more on CPU makes one machine act as several torchrun "nodes" (tests the rendezvous).
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    nproc_per_node: int = 1  # workers per node when gpus_per_node == 0 (CPU runs)
    cpus_per_task: int = 2
    mem: str | None = None
    time: str = "01:00:00"  # H:MM:SS or D-HH:MM:SS (YAML turns 12:00:00 into seconds; read back as such)
    signal_seconds: int = 120  # --signal=USR1@N: time to checkpoint before the limit
    extra_sbatch: list[str] = field(default_factory=list)  # more "#SBATCH" options, as "--key=value"
    env_setup: str = ""  # shell lines run before training (module load, venv activate)
    prepare_time: str = "01:00:00"  # time limit of the single-process prepare job
    eval_time: str = "01:00:00"  # time limit of the single-process eval job
    rdzv_port: int = 0  # torchrun c10d port on the first node; 0: derived from job id and restart
    rdzv_timeout: int = 900  # seconds the torchrun agents wait for each other at start (init timeout)
    python: str | None = None  # interpreter on the compute nodes; None: the submitter's sys.executable
    local_tmp: str = "/tmp"  # node-local scratch: TRITON_CACHE_DIR is <local_tmp>/<user>/triton-<job id>
    # Exported in every job (one place for NCCL settings); add cluster specifics like NCCL_SOCKET_IFNAME.
    env: dict[str, str] = field(
        default_factory=lambda: {
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed collective raises instead of hanging
            "NCCL_DEBUG": "WARN",
            "PYTHONUNBUFFERED": "1",  # logs reach the .out file as they happen
        }
    )

    def __post_init__(self) -> None:
        for key in ("time", "prepare_time", "eval_time"):
            setattr(self, key, _slurm_time(f"slurm.{key}", getattr(self, key)))
        for key in ("nodes", "tasks_per_node", "nproc_per_node", "cpus_per_task"):
            if getattr(self, key) < 1:
                raise ValueError(f"slurm.{key} must be >= 1; got {getattr(self, key)}")
        if self.gpus_per_node < 0 or self.signal_seconds < 0:
            raise ValueError("slurm.gpus_per_node and slurm.signal_seconds must be >= 0")
        if self.gpus_per_node and self.tasks_per_node != 1:
            raise ValueError(
                f"slurm.tasks_per_node must be 1 with GPUs (one torchrun per node starts one worker "
                f"per GPU); got {self.tasks_per_node}"
            )
        if not 0 <= self.rdzv_port < 65536:
            raise ValueError(f"slurm.rdzv_port must be in [0, 65535]; got {self.rdzv_port}")
        bad = [o for o in self.extra_sbatch if not o.startswith("--") or "\n" in o]
        if bad:
            raise ValueError(f"slurm.extra_sbatch entries must be single '--key=value' options: {bad[0]!r}")
        bad = [k for k in self.env if not (k.isascii() and k.replace("_", "a").isalnum()) or k[0].isdigit()]
        if bad:
            raise ValueError(f"slurm.env has a name that is not a shell variable name: {bad[0]!r}")
        # pipeline.train.REQUEUE_ENV: an argv written like a shell line, split by shlex, never run by a shell.
        requeue = self.env.get("FPA_REQUEUE_CMD")
        if requeue is not None:
            try:
                argv = shlex.split(requeue)
            except ValueError as e:
                raise ValueError(f"slurm.env.FPA_REQUEUE_CMD cannot be split into arguments: {e}") from None
            if not argv:
                raise ValueError("slurm.env.FPA_REQUEUE_CMD is empty")


def _slurm_time(key: str, value: str) -> str:
    """A Slurm time limit. YAML 1.1 reads 12:00:00 as the number 43200 (seconds), so a bare number is
    taken as seconds and written back as H:MM:SS; strings keep the forms sbatch accepts."""
    value = str(value).strip()
    if value.isdigit():
        h, rest = divmod(int(value), 3600)
        return f"{h}:{rest // 60:02d}:{rest % 60:02d}"
    if value.upper() in ("UNLIMITED", "INFINITE") or re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", value):
        return value
    raise ValueError(f"{key} must be H:MM:SS, D-HH:MM:SS or UNLIMITED; got {value!r}")


@dataclass
class RunConfig:
    name: str = "default"
    seed: int = 1234
    runs_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self) -> None:
        # The run dir is <runs_dir>/<name>: a separator, '..', '.' or an absolute name would put it (and
        # everything a stage writes or deletes there) somewhere else.
        n = self.name
        if n in ("", ".", "..") or "/" in n or "\\" in n or not n.isprintable() or len(n.encode()) > 255:
            raise ValueError(
                "name must be one path component (the run dir is <runs_dir>/<name>): no '/' or '\\', not "
                f"'.' or '..', printable, at most 255 bytes; got {n!r}"
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name

    @property
    def data_dir(self) -> Path:
        return Path(self.data.out_dir) if self.data.out_dir else self.run_dir / "data"


@dataclass(frozen=True)
class Derived:
    """Values that follow from the config and the world size, computed once here."""

    world_size: int
    sequence_parallel: int
    data_parallel: int
    micro_batch: int
    grad_accum: int
    global_batch: int  # sequences per optimizer step
    seq_len: int
    tokens_per_step: int
    passkey_lengths: tuple[int, int, int] = (0, 0, 16)  # train.passkey prompt lengths: min, max, multiple
    precision: str = "fp32"  # train.precision resolved (auto -> fp32 | bf16): what the engine runs


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def describe_derived(cfg: RunConfig, world_size: int = 1, tokens_per_second: float | None = None) -> str:
    """What a run of this config does on world_size ranks, as comment lines (`fpa print-config
    --derived`): the batch and how it is split, tokens per step, steps and tokens in all, and with
    tokens_per_second (per rank) the wall time at that throughput."""
    d = derive(cfg, world_size)
    t = cfg.train
    lines = [
        f"derived for world size {world_size} ({d.data_parallel} data-parallel x {d.sequence_parallel} "
        "sequence-parallel)",
        f"  global_batch={d.global_batch} sequences per step = micro_batch {d.micro_batch} x grad_accum "
        f"{d.grad_accum} x {d.data_parallel} data-parallel ranks",
        f"  tokens_per_step={d.tokens_per_step} ({d.global_batch} x seq_len {d.seq_len})",
        f"  max_steps={t.max_steps} (warmup {t.warmup_steps}): {_count(t.max_steps * d.tokens_per_step)} "
        f"tokens in all (warmup {_count(t.warmup_steps * d.tokens_per_step)})",
        f"  precision={d.precision}",
    ]
    if tokens_per_second is not None:
        seconds = t.max_steps * d.tokens_per_step / (tokens_per_second * world_size)
        lines.append(
            f"  at {_count(tokens_per_second)} tokens/s per rank: {seconds / 3600:.3g} h of training "
            f"({seconds / t.max_steps:.3g} s per step)"
        )
    return "\n".join(f"# {line}" for line in lines)


def derive(cfg: RunConfig, world_size: int = 1) -> Derived:
    sp = cfg.parallel.sequence
    if world_size % sp:
        raise ConfigError(f"world size {world_size} is not divisible by parallel.sequence={sp}")
    dp = world_size // sp
    # The zigzag layout cuts the sequence into 2 * sp chunks.
    n_chunks = 2 * sp if cfg.parallel.sequence_layout == "zigzag" else sp
    if sp > 1 and cfg.data.seq_len % n_chunks:
        zz = f" x 2 (parallel.sequence_layout=zigzag cuts {n_chunks} chunks)" if n_chunks != sp else ""
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} is not divisible by parallel.sequence={sp}{zz}")
    if cfg.train.compile and sp > 1:
        raise ConfigError(
            f"train.compile does not serve sequence parallelism (parallel.sequence={sp}: its collectives "
            "run inside the attention layers); set train.compile=false or parallel.sequence=1"
        )
    if cfg.train.compile and cfg.train.zero_stage == 3:
        raise ConfigError(
            "train.compile does not serve train.zero_stage=3 (ZeRO-3 gathers each block's parameters in "
            "hooks the compiled graph skips); use train.zero_stage=2 or train.compile=false"
        )
    grad_accum = cfg.train.grad_accum
    if cfg.train.global_batch is not None:
        per_micro = cfg.train.micro_batch * dp
        if cfg.train.global_batch % per_micro:
            fits = [m for m in range(cfg.train.micro_batch, 0, -1) if cfg.train.global_batch % (m * dp) == 0]
            fix = f"set train.micro_batch={fits[0]}" if fits else "use a world size that divides it"
            raise ConfigError(
                f"train.global_batch={cfg.train.global_batch} is not divisible by train.micro_batch="
                f"{cfg.train.micro_batch} x {dp} data-parallel ranks (world size {world_size}): {fix}"
            )
        need = cfg.train.global_batch // per_micro
        if grad_accum not in (1, need):
            raise ConfigError(
                f"train.grad_accum={grad_accum} contradicts train.global_batch={cfg.train.global_batch} "
                f"(micro_batch {cfg.train.micro_batch} x {dp} ranks needs {need}): leave train.grad_accum "
                "at 1 (it follows)"
            )
        grad_accum = need
    global_batch = cfg.train.micro_batch * grad_accum * dp
    pk = cfg.train.passkey
    pk_max = cfg.data.seq_len if pk.max_len is None else pk.max_len
    if pk.steps and pk.min_len > pk_max:
        raise ConfigError(
            f"train.passkey.min_len={pk.min_len} exceeds its max_len ({pk_max}; default data.seq_len)"
        )
    # Prompt lengths are multiples of 16 whatever the world size, so a run draws the same prompts on any
    # sequence-parallel degree up to 8 (zigzag needs lengths divisible by 2 x degree).
    pk_multiple = max(16, n_chunks)
    if pk.steps and pk_max // pk_multiple * pk_multiple < pk.min_len:
        raise ConfigError(
            f"train.passkey: no prompt length in [min_len={pk.min_len}, max_len={pk_max}] is a multiple of "
            f"{pk_multiple} (prompt lengths are multiples of 16, or of the sequence-parallel chunk count)"
        )
    return Derived(
        world_size=world_size,
        sequence_parallel=sp,
        data_parallel=dp,
        micro_batch=cfg.train.micro_batch,
        grad_accum=grad_accum,
        global_batch=global_batch,
        seq_len=cfg.data.seq_len,
        tokens_per_step=global_batch * cfg.data.seq_len,
        passkey_lengths=(pk.min_len, pk_max, pk_multiple),
        # Already concrete for configs from load_config; a config built in code may still say auto.
        precision=resolve_precision(cfg.train),
    )


# ----------------------------------------------------------------------------------------------------
# Loading


def _schema_keys(schema: Any, dotted: str) -> list[str]:
    """The valid keys at the parent of a dotted key, for did-you-mean hints."""
    node: Any = RunConfig
    for part in dotted.split(".")[:-1]:
        if not dataclasses.is_dataclass(node):
            return []
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return []
        node = _field_type(node, part)
    if not dataclasses.is_dataclass(node):
        return []
    return [f.name for f in dataclasses.fields(node)]


def _field_type(cls: Any, name: str) -> Any:
    import typing

    hints = typing.get_type_hints(cls)
    tp = hints[name]
    for arg in typing.get_args(tp) or (tp,):  # Optional[X] -> X
        if dataclasses.is_dataclass(arg):
            return arg
    return tp


def _hint(key: str) -> str:
    leaf = key.split(".")[-1]
    close = difflib.get_close_matches(leaf, _schema_keys(RunConfig, key), n=1)
    if close:
        parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
        return f" (did you mean '{parent}{close[0]}'?)"
    return ""


def _describe(err: OmegaConfBaseException, origin: str) -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    if isinstance(err, ConfigKeyError | ConfigAttributeError):
        return ConfigError(f"unknown config key '{key}' in {origin}{_hint(key)}")
    if isinstance(err, MissingMandatoryValue):
        return ConfigError(f"missing required value '{key}' in {origin}")
    if isinstance(err, ValidationError):
        msg = str(err).splitlines()[0]
        return ConfigError(f"bad value for '{key}' in {origin}: {msg}")
    return ConfigError(f"{origin}: {str(err).splitlines()[0]}")


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[DictConfig, str]]:
    """A YAML file and the files it names under `base:`, in merge order, each with its origin."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise ConfigError(f"config file {path} includes itself through 'base:'")
    try:
        node = OmegaConf.load(path)
    except Exception as e:  # yaml errors carry multi-line context; keep the first line
        raise ConfigError(f"cannot parse {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path} must hold a mapping at the top level")
    out: list[tuple[DictConfig, str]] = []
    bases = node.pop("base", None)
    if bases is not None:
        bases = [bases] if isinstance(bases, str) else bases
        if not isinstance(bases, ListConfig) or not all(isinstance(b, str) and b for b in bases):
            raise ConfigError(f"'base' in {path} must be a file name or a list of file names; got {bases}")
        for b in bases:
            out += _read_yaml(path.parent / b, (*seen, path.resolve()))
    out.append((node, str(path)))
    return out


def load_config(
    paths: list[str | Path] | tuple[str | Path, ...] = (), overrides: list[str] = ()
) -> RunConfig:
    """Merge YAML files then `key=value` overrides onto the typed schema; return the typed config."""
    merged = OmegaConf.structured(RunConfig)
    layers: list[tuple[Any, str]] = []
    for p in paths:
        layers += _read_yaml(Path(p))
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not of the form key=value")
        try:
            layers.append((OmegaConf.from_dotlist([ov]), f"override '{ov}'"))
        except OmegaConfBaseException as e:
            raise ConfigError(f"cannot parse override {ov!r}: {str(e).splitlines()[0]}") from None
    # '???' (OmegaConf's "missing") merged onto a default keeps the default: a file saying `lr: ???` would
    # silently train with the default lr. Here it means "a later file or override must set this".
    required: dict[tuple[Any, ...], str] = {}
    for i, (node, origin) in enumerate(layers):
        _replace_sources(merged, node, origin, layers[:i])
        try:
            merged = OmegaConf.merge(merged, node)
        except OmegaConfBaseException as e:
            raise _describe(e, origin) from None
        required = {k: o for k, o in required.items() if not _sets_value(node, k)}
        required |= dict.fromkeys(_missing_paths(node), origin)
    if required:
        path, origin = next(iter(required.items()))
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        raise ConfigError(
            f"missing required value '{key}' in {origin}: '???' must be given by a later file or override"
        )
    _check_sources(merged, layers)
    try:
        cfg = OmegaConf.to_object(merged)
    except MissingMandatoryValue as e:
        raise _describe(e, "the merged config") from None
    except InterpolationResolutionError as e:
        key = getattr(e, "full_key", "") or "?"
        raise ConfigError(
            f"cannot resolve '{key}'{_origin_of(key, layers, False)}: {str(e).splitlines()[0]}"
        ) from None
    except (OmegaConfBaseException, ValueError) as e:
        # __post_init__ checks raise ValueError (OmegaConf may wrap it); they start with the dotted key
        # (or key=value).
        msg = str(e.__cause__ or e).splitlines()[0]
        raise ConfigError(msg + _origin_of(msg.split(" ")[0].split("=")[0], layers)) from None
    assert isinstance(cfg, RunConfig)
    # auto depends on the merged train.zero_stage and the device, so it is resolved here, once every layer
    # is in; config.yaml, the train manifest's fingerprint, checkpoints and exports then record what ran.
    cfg.train.precision = resolve_precision(cfg.train)
    return cfg


# ----------------------------------------------------------------------------------------------------
# Data sources: a source's `type` decides which of its keys mean something


def _child(node: Any, key: str) -> DictConfig | None:
    """node[key] when it is a mapping given as such (not an interpolation), else None."""
    if not isinstance(node, DictConfig) or key not in node or OmegaConf.is_interpolation(node, key):
        return None
    value = node[key]
    return value if isinstance(value, DictConfig) else None


def _sources(node: Any) -> Iterator[tuple[str, DictConfig]]:
    """(dotted path, node) of every data source a config layer (or the merged config) holds."""
    data = _child(node, "data")
    for key in ("train", "validation"):
        src = _child(data, key)
        if src is not None:
            yield f"data.{key}", src
    for group in ("extra_validation", "mixture"):
        sources = _child(data, group)
        for name in sources or ():
            src = _child(sources, str(name))
            if src is not None:
                yield f"data.{group}.{name}", src


def _given(node: DictConfig, key: str) -> Any:
    """A layer's plain value for key (None when absent, '???' or an interpolation)."""
    if key not in node or OmegaConf.is_interpolation(node, key) or OmegaConf.is_missing(node, key):
        return None
    return node[key]


_SOURCE_DEFAULTS = {f.name: f for f in dataclasses.fields(SourceConfig)}


def _source_default(key: str) -> Any:
    f = _SOURCE_DEFAULTS[key]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _replace_sources(merged: DictConfig, node: Any, origin: str, before: list[tuple[Any, str]]) -> None:
    """Before a layer is merged: a source whose type it changes drops the keys the new type does not read
    (a text corpus put over the packaged KJV does not keep its book list); an empty mapping given for
    data.extra_validation or data.mixture empties it; a train source that becomes the user's own (not
    packaged) drops a packaged validation split of earlier layers, so the held-out split is the last
    data.val_fraction of the user's documents unless the layer gives one."""
    data = _child(node, "data")
    for group in ("extra_validation", "mixture"):
        given = _child(data, group)
        if given is not None and len(given) == 0 and _child(merged.data, group):
            merged.data[group] = {}
    for path, src in _sources(node):
        new = _given(src, "type")
        holder = _child(merged.data, path.split(".")[1])
        current = holder if path.count(".") == 1 else _child(holder, path.split(".", 2)[2])
        if current is None or new not in SOURCE_KEYS or current.type == new:
            continue
        old, keep = current.type, kept_source_keys(current.type, new)
        for key in list(current.keys()):
            if key in COMMON_SOURCE_KEYS or key in keep or key in src:
                continue
            # hf reads `name` as a datasets builder or hub dataset: the packaged corpus name is no default
            current[key] = "???" if (key, new) == ("name", "hf") else _source_default(key)
        val = _child(merged.data, "validation")
        own = path == "data.train" and old == "packaged" and "validation" not in (data or {})
        if own and val is not None and val.type == "packaged":
            corpus = val.name
            merged.data.validation = None
            log.info(
                "data.validation: the packaged %s split%s is dropped with data.train set to your own "
                "%s data in %s: the last data.val_fraction of its documents is held out instead",
                corpus,
                _origin_of("data.validation.type", before),
                new,
                origin,
            )


def _type_origin(path: str, layers: list[tuple[Any, str]]) -> str:
    """' (its type set in <file or override>)' for the source at path."""
    return _origin_of(f"{path}.type", layers).replace("(set in", "(its type set in")


def _check_sources(merged: DictConfig, layers: list[tuple[Any, str]]) -> None:
    """A key its source's type does not read is an error naming it, where it was set and how to clear it
    (a value that is silently ignored, or the KJV's book list on another corpus)."""
    for path, src in _sources(merged):
        kind = _given(src, "type")
        if kind not in SOURCE_KEYS:
            continue  # SourceConfig reports the bad type
        if kind == "hf" and OmegaConf.is_missing(src, "name"):
            raise ConfigError(
                f"{path}.name is required for a source of type hf: a datasets builder (json, parquet, text, "
                f"with {path}.paths as its data_files) or a hub dataset name"
                f"{_type_origin(path, layers)}"
            )
        if kind in ("text", "jsonl", "parquet") and not _given(src, "paths"):
            raise ConfigError(
                f"{path}.paths is empty: a source of type {kind} reads files, folders or globs; give them "
                f'with "{path}.paths=[...]"{_type_origin(path, layers)}'
            )
        name = _given(src, "name")
        for key in _SOURCE_DEFAULTS:
            if key in COMMON_SOURCE_KEYS or key not in src or OmegaConf.is_interpolation(src, key):
                continue
            value = src[key]
            value = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
            default = _source_default(key)
            if value == default or (key == "exclude_books" and value is None):
                continue
            if key in SOURCE_KEYS[kind] and (key not in ("books", "exclude_books") or name == "kjv"):
                continue
            cleared = "[]" if isinstance(default, list) else "null" if default is None else default
            clear, where = f"{path}.{key}={cleared}", _origin_of(f"{path}.{key}", layers)
            if key in ("books", "exclude_books") and kind == "packaged":
                why = f"selects books of the packaged corpus 'kjv' only, and this source is {name!r}"
            else:
                readers = [t for t, keys in SOURCE_KEYS.items() if key in keys]
                why = f"is read by sources of type {' / '.join(readers)} only, and this source is {kind!r}"
            raise ConfigError(f"{path}.{key} {why}{where}: clear it with {clear}")


def _missing_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The key paths a layer marks '???', found without resolving its interpolations."""
    out: list[tuple[Any, ...]] = []
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for k in keys:
        if OmegaConf.is_missing(node, k):
            out.append((*prefix, k))
        elif not OmegaConf.is_interpolation(node, k) and isinstance(node[k], DictConfig | ListConfig):
            out += _missing_paths(node[k], (*prefix, k))
    return out


def _sets_value(node: Any, path: tuple[Any, ...]) -> bool:
    """Whether a layer gives the key at `path` a value (not '???')."""
    for k in path[:-1]:
        if not _holds(node, k) or OmegaConf.is_interpolation(node, k):
            return False
        node = node[k]
    return _holds(node, path[-1]) and not OmegaConf.is_missing(node, path[-1])


def _holds(node: Any, k: Any) -> bool:
    if isinstance(node, DictConfig):
        return k in node
    return isinstance(node, ListConfig) and isinstance(k, int) and k < len(node)


def _origin_of(key: str, layers: list[tuple[Any, str]], dotted_only: bool = True) -> str:
    """' (set in <file or override>)' for the last layer that sets `key`, '' if none or not a key."""
    if dotted_only and "." not in key and key not in {f.name for f in dataclasses.fields(RunConfig)}:
        return ""
    for node, origin in reversed(layers):
        parent, _, leaf = key.rpartition(".")
        try:
            holder = OmegaConf.select(node, parent, throw_on_resolution_failure=False) if parent else node
        except OmegaConfBaseException:
            continue
        if isinstance(holder, DictConfig) and leaf in holder:
            return f" (set in {origin})"
    return " (the default)"


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml_text(text: str) -> RunConfig:
    """Rebuild a typed config from a resolved YAML (as saved in run dirs and checkpoints)."""
    node = OmegaConf.create(text)
    attention = OmegaConf.select(node, "model.attention")
    if isinstance(attention, DictConfig) and attention.get("qk_norm") and "qk_norm_gains" not in attention:
        attention.qk_norm_gains = "shared"  # saved before per-head gains existed: its gains are shared
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), node)
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, RunConfig)
    return cfg
