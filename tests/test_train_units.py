"""Pieces of training without a full run: checkpoint bookkeeping, launcher environments, requeue, loggers,
the DeepSpeed config; plus one end-to-end run of `python -m pipeline.train` on real prepared shards."""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import checkpoint as ck
from pipeline import distributed as du
from pipeline.config import ConfigError, RunConfig, derive, load_config

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------------
# Checkpoint bookkeeping


def _fake_ckpt(root: Path, step: int, complete: bool = True) -> Path:
    d = root / ck.tag_for(step)
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        (d / ck.COMPLETE).write_text(json.dumps({"step": step, "world_size": 1}))
    return d


def test_find_latest_skips_incomplete_and_stale_latest(tmp_path):
    assert ck.find_latest(tmp_path) is None
    _fake_ckpt(tmp_path, 4)
    _fake_ckpt(tmp_path, 8)
    _fake_ckpt(tmp_path, 12, complete=False)  # a save cut off by a kill
    assert ck.find_latest(tmp_path) == tmp_path / "global_step8"
    (tmp_path / ck.LATEST).write_text("global_step12")  # points at the incomplete one
    assert ck.find_latest(tmp_path) == tmp_path / "global_step8"
    (tmp_path / ck.LATEST).write_text("global_step4")  # stale: a newer complete one exists
    assert ck.find_latest(tmp_path) == tmp_path / "global_step8"
    assert ck.resolve_resume("auto", tmp_path) == tmp_path / "global_step8"
    assert ck.resolve_resume("none", tmp_path) is None
    assert ck.resolve_resume(str(tmp_path), tmp_path / "elsewhere") == tmp_path / "global_step8"
    with pytest.raises(ck.CheckpointError, match="incomplete"):
        ck.resolve_resume(str(tmp_path / "global_step12"), tmp_path)
    with pytest.raises(ck.CheckpointError, match="no such checkpoint"):
        ck.resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_prune_keeps_last_complete_and_drops_old_partials(tmp_path):
    for s in (2, 4, 6):
        _fake_ckpt(tmp_path, s)
    _fake_ckpt(tmp_path, 3, complete=False)
    (tmp_path / "global_step2_universal").mkdir()
    _fake_ckpt(tmp_path, 8)
    ck._prune(tmp_path, keep_last=2, current=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step6", "global_step8"]


def test_rng_state_round_trip():
    import numpy as np
    import torch

    state = ck.rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    ck.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


# ----------------------------------------------------------------------------------------------------
# Launchers, requeue


_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    # setenv first so monkeypatch records every variable setup_env may write, and restores it after.
    for k in {*_DIST_VARS, *(k for k in os.environ if k.startswith("SLURM_"))}:
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    return monkeypatch


def test_setup_env_from_slurm(clean_env):
    clean_env.setenv("PATH", "/nonexistent")  # no scontrol: the fallback nodelist parser is used
    for k, v in {
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_ID": "77",
    }.items():
        clean_env.setenv(k, v)
    clean_env.setenv("SLURM_JOB_NODELIST", "gpu[03-04],cpu9")
    assert du.setup_env() == "slurm"
    env = os.environ
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("3", "1", "4", "gpu03")
    port = int(env["MASTER_PORT"])
    assert 20000 <= port < 40000


def test_setup_env_single_process_and_torchrun(clean_env):
    assert du.setup_env() == "single"
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1") and int(os.environ["MASTER_PORT"]) > 0
    for k in _DIST_VARS:
        clean_env.delenv(k)
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("LOCAL_RANK", "1")
    assert du.setup_env() == "torchrun"
    assert os.environ["RANK"] == "1"


def test_requeue_command_is_overridable(clean_env, tmp_path):
    from pipeline.train import REQUEUE_ENV, requeue_slurm_job

    assert requeue_slurm_job() is None  # not under Slurm: nothing to do
    clean_env.setenv("SLURM_JOB_ID", "991")
    # An argv, not a shell line: the redirection is the script of an explicit `sh -c`, the id its $1.
    clean_env.setenv(REQUEUE_ENV, f"sh -c 'echo requeue $1 > {tmp_path / 'out'}' sh {{job_id}}")
    assert requeue_slurm_job() == ["sh", "-c", f"echo requeue $1 > {tmp_path / 'out'}", "sh", "991"]
    assert (tmp_path / "out").read_text().strip() == "requeue 991"


# ----------------------------------------------------------------------------------------------------
# Loggers


def test_console_logger_lines_and_tables():
    from pipeline.logging import ConsoleLogger

    buf = io.StringIO()
    lg = ConsoleLogger(progress=False, stream=buf)
    lg.log({"train/loss": 2.5, "perf/mfu": 0.0001234, "n": 3}, step=7)
    lg.log_table("passkey", ["len", "acc"], [[256, 1.0], [2048, 0.5]])
    lg.summary({"final": 1.25})
    lg.finish()
    out = buf.getvalue().splitlines()
    assert out[0] == "step 7: train/loss=2.5000 perf/mfu=1.234e-04 n=3"
    assert out[1] == "== passkey ==" and out[3].split() == ["256", "1.0000"]
    assert out[-1] == "summary: final=1.2500"


def test_make_logger_rank_nonzero_is_noop(tmp_path):
    from pipeline.logging import RunLogger, make_logger

    cfg = RunConfig(runs_dir=str(tmp_path))
    lg = make_logger(cfg, rank=1, run_id="abc")
    assert type(lg) is RunLogger
    lg.log({"x": 1}, 0)
    lg.finish()
    assert not any(tmp_path.iterdir())  # nothing written by a non-zero rank


def test_wandb_offline_run_records_and_resumes(tmp_path):
    from wandb_log import find_wandb_files, read_finished_wandb_file

    from pipeline.logging import make_logger

    cfg = load_config(
        [], [f"runs_dir={tmp_path}", "name=wb", "logging.quiet_wandb=true", "logging.progress=false"]
    )
    lg = make_logger(cfg, rank=0, run_id=None)
    rid = lg.run_id
    assert rid and len(rid) == 8
    for s in (1, 2, 3):
        lg.log({"train/loss": 1.0 / s, "train/lr": 0.1}, step=s)
    lg.log_table("grid", ["a", "b"], [[1, 2]])
    lg.summary({"final/loss": 0.25})
    lg.finish()
    # A resumed job: the same run continues. Started within the same second as the first segment, W&B
    # would reuse its folder and overwrite its .wandb file; make_logger must prevent that.
    lg2 = make_logger(cfg, rank=0, run_id=rid)
    assert lg2.run_id == rid
    lg2.log({"train/loss": 0.2}, step=4)
    lg2.finish()

    files = find_wandb_files(cfg.run_dir, rid)
    assert len(files) == 2
    first, second = read_finished_wandb_file(files[0]), read_finished_wandb_file(files[1])
    losses = {r["_step"]: r["train/loss"] for r in first["history"] if "train/loss" in r}
    assert losses == {1: 1.0, 2: 0.5, 3: pytest.approx(1 / 3)}
    assert first["summary"]["final/loss"] == 0.25
    assert first["config"]["model"]["n_layer"] == cfg.model.n_layer
    assert "git_sha" in first["config"]
    assert [r["train/loss"] for r in second["history"] if "train/loss" in r] == [0.2]
    assert second["run_id"] == rid


# ----------------------------------------------------------------------------------------------------
# DeepSpeed config


def test_deepspeed_config_and_param_groups():
    from fpa_model.model import GPT
    from pipeline.train import deepspeed_config, param_groups

    cfg = load_config(
        [], ["train.precision=bf16", "train.zero_stage=2", "train.grad_accum=3", "model.vocab_size=64"]
    )
    ds = deepspeed_config(cfg, derive(cfg, world_size=4))
    assert ds["train_batch_size"] == cfg.train.micro_batch * 3 * 4
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["bf16"] == {"enabled": True}
    assert ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["zero_optimization"]["stage"] == 2 and ds["checkpoint"]["load_universal"] is False
    # ZeRO-0 bf16 is autocast over an fp32 engine (pipeline.trainer.step.autocast): no DeepSpeed bf16 mode.
    zero0 = load_config([], ["train.precision=bf16", "train.zero_stage=0", "model.vocab_size=64"])
    assert "bf16" not in deepspeed_config(zero0, derive(zero0)) and "data_types" not in deepspeed_config(
        zero0, derive(zero0)
    )
    groups = param_groups(GPT(cfg.model), 0.1)
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and groups[1]["weight_decay"] == 0.0
    assert all(p.dim() == 1 for p in groups[1]["params"])


# ----------------------------------------------------------------------------------------------------
# End to end on real prepared shards


@pytest.mark.slow
def test_train_main_on_prepared_shards(tmp_path):
    """`python -m pipeline.train`: vocab from the data index, real ShardLoader, validation, checkpoint."""
    from test_train_support import prepare_word_corpus

    from data_prep.index import load_index

    prepare_word_corpus(tmp_path)
    vocab = load_index(tmp_path / "data").vocab_size
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(
        f"""
name: real
runs_dir: {tmp_path / "runs"}
model: {{n_layer: 1, n_head: 2, d_model: 32, max_seq_len: 64}}
data:
  out_dir: {tmp_path / "data"}
  seq_len: 32
train: {{micro_batch: 4, max_steps: 10, lr: 1.0e-2, warmup_steps: 2, log_every: 5, val_every: 5,
         val_batches: 2, checkpoint: {{every: 5}}}}
logging: {{wandb_mode: disabled, progress: false}}
"""
    )
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.train", str(cfg_file)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[train] summary "))
    summary = json.loads(line[len("[train] summary ") :])
    assert summary["steps"] == 10 and summary["val_loss"] is not None
    recs = [json.loads(x) for x in (tmp_path / "runs" / "real" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5
    state = ck.read_meta(Path(summary["checkpoint"]))
    assert state is not None and state["step"] == 10
    # The resolved config in the checkpoint carries the vocab size read from the data index.
    import torch

    client = torch.load(Path(summary["checkpoint"]) / "mp_rank_00_model_states.pt", weights_only=False)
    assert f"vocab_size: {vocab}" in client["config_yaml"]


def test_export_reads_old_checkpoint_configs():
    """A checkpoint saved under an older config schema still exports (its model section is what counts)."""
    from pipeline.config import to_yaml
    from pipeline.export import ExportError, _config_from_checkpoint

    saved = RunConfig()
    saved.model.vocab_size = 77
    text = to_yaml(saved) + "obsolete_section: 1\n"
    assert _config_from_checkpoint(text, RunConfig(), Path("ck")).model.vocab_size == 77
    with pytest.raises(ExportError, match="n_layers"):
        _config_from_checkpoint(text.replace("n_layer:", "n_layers:"), RunConfig(), Path("ck"))


@pytest.mark.parametrize("chunk_tokens", [0, 3])
def test_targeted_only_loss_equals_the_full_logits_loss(chunk_tokens):
    """Passkey rows run the LM head at their answer positions only: the loss and every gradient equal the
    loss over full logits with the other targets ignored (plain and chunked loss)."""
    import torch

    from fpa_model.config import ModelConfig
    from fpa_model.model import GPT
    from pipeline.trainer.step import micro_loss

    class Engine:  # what micro_loss uses of a DeepSpeed engine
        def __init__(self, module: torch.nn.Module) -> None:
            self.module = module

        def __call__(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=40, n_layer=2, n_head=2, d_model=16)).double()
    x = torch.randint(0, 40, (3, 12))
    y = torch.full((3, 12), -100)
    y[0, 9:11], y[1, 3], y[2, 11] = torch.tensor([5, 6]), 7, 8  # a few answer tokens, rows differ
    grads = []
    for targeted in (False, True):
        model.zero_grad()
        loss, n = micro_loss(Engine(model), (x, y), torch.device("cpu"), None, chunk_tokens, targeted)
        loss.backward()
        grads.append((loss.detach(), n, {k: p.grad.clone() for k, p in model.named_parameters()}))
    (full, n_full, g_full), (part, n_part, g_part) = grads
    assert n_full == n_part == 36
    assert torch.allclose(full, part, rtol=1e-12, atol=0), (full, part)
    assert g_full.keys() == g_part.keys()
    for k in g_full:
        assert torch.allclose(g_full[k], g_part[k], rtol=1e-10, atol=1e-12), k
    # and the loss is the mean over the four answer tokens only
    logits = model(x).double()
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    assert torch.allclose(part.double(), ref, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------
# The passkey phase on a tokenizer of another corpus


def test_a_passkey_min_len_too_short_for_the_tokenizer_says_what_fits(tmp_path):
    """A tokenizer trained on text unlike the English passkey prompt (here: word runs like "w12") takes
    many tokens for the needle and question: one line before training naming the min_len that fits."""
    from test_train_support import prepare_word_corpus

    from pipeline.trainer.batches import PasskeyBatches

    data = prepare_word_corpus(tmp_path)
    over = [f"data.out_dir={data}", "data.seq_len=32", "train.passkey.steps=1", "train.passkey.max_len=1024"]
    cfg = load_config([], [*over, "train.passkey.min_len=16"])
    with pytest.raises(ConfigError) as e:
        PasskeyBatches(cfg, derive(cfg), 0)
    msg = str(e.value)
    assert msg.startswith("train.passkey.min_len=16 is too short for this tokenizer")
    fix = int(msg.split("set train.passkey.min_len=")[1].split()[0])
    assert fix % 16 == 0 and fix > 16
    cfg = load_config([], [*over, f"train.passkey.min_len={fix}"])
    x, y = PasskeyBatches(cfg, derive(cfg), 0).batch(0, 0)  # the shortest prompt now fits
    assert x.shape[1] >= fix


def test_profile_config_errors_and_a_window_cut_short(tmp_path):
    """train.profile: bad values and a window past max_steps are one-line errors naming the key; a run that
    stops inside its window (preempted, say) still writes what it traced; other ranks and off write none."""
    import torch

    from pipeline.config import ProfileConfig
    from pipeline.stages import train_inputs
    from pipeline.trainer.profiling import StepProfiler

    with pytest.raises(ConfigError, match=r"train.profile traces steps 199-201, past train.max_steps=200"):
        load_config([], ["train.profile.start=199"])
    with pytest.raises(ConfigError, match="train.profile needs start >= 0 and steps >= 1"):
        load_config([], ["train.profile.start=2", "train.profile.steps=0"])
    with pytest.raises(ConfigError, match="train.profile.ranks must be ranks >= 0"):
        load_config([], ["train.profile.ranks=[-1]"])
    # Tracing changes no weight: the train fingerprint is the same with and without it.
    assert train_inputs(load_config([], ["train.profile.start=3"]), 1) == train_inputs(load_config([]), 1)

    cfg = ProfileConfig(start=2, steps=5, ranks=[0, 2])
    cpu = torch.device("cpu")
    profs = {r: StepProfiler(cfg, tmp_path, r, cpu) for r in (0, 1)}
    profs["off"] = StepProfiler(ProfileConfig(), tmp_path / "off", 0, cpu)
    x = torch.randn(64, 64)
    for step in (1, 2, 3):
        for p in profs.values():
            p.before(step)
        (x @ x).sum()
        for p in profs.values():
            p.after(step)
    for p in profs.values():
        p.close()
    out = tmp_path / "profile"
    assert sorted(p.name for p in out.iterdir()) == ["rank0"]
    assert sorted(p.name for p in (out / "rank0").iterdir()) == ["memory-2-3.json", "trace-2-3.json"]
    events = json.loads((out / "rank0" / "trace-2-3.json").read_text())["traceEvents"]
    assert sorted(e["name"] for e in events if e.get("name", "").startswith("train step")) == [
        "train step 2",
        "train step 3",
    ]
    assert not (tmp_path / "off").exists()


# ----------------------------------------------------------------------------------------------------
# The process group ends with the training stage, whichever way it ends

STAGE_EXIT_SCRIPT = r"""
import json, os, sys
import torch.distributed as dist
from pathlib import Path
import pipeline.stages as stages
from pipeline.config import ConfigError, load_config
from pipeline.trainer.preemption import Preempted

data = Path(sys.argv[1])
cfg = load_config([], [f"data.out_dir={data}", f"runs_dir={data.parent}"])
stages.check_data = lambda cfg: None  # no real shards: the stage body below is replaced
seen = {}
# Each body first meets the other rank, as a real stage does before it returns: without it one rank could
# end the group while the other is still connecting its gloo pairs ("Connection closed by peer").
def finished(cfg, rank, world, force):
    dist.barrier()
    seen["inside"] = dist.is_initialized() and dist.get_world_size()
    return {"steps": 1}
def preempted(cfg, rank, world, force):
    dist.barrier()
    raise Preempted(3, None)
def refused(cfg, rank, world, force):
    dist.barrier()
    raise ConfigError("refused")
ports = sys.argv[2].split(",")
rounds = (("finished", finished), ("preempted", preempted), ("refused", refused))
for port, (name, body) in zip(ports, rounds):
    os.environ["MASTER_PORT"] = port  # a fresh rendezvous per round: a process trains once, not three times
    stages._train_stage = body
    try:
        stages.run_train(cfg)
    except (Preempted, ConfigError):
        pass
    seen[name] = dist.is_initialized()
print("RESULT " + json.dumps(seen), flush=True)
"""


def test_run_train_ends_the_process_group_on_every_way_out(tmp_path):
    """A gloo group still alive when the interpreter exits can abort a finished rank (SIGABRT: "terminate
    called without an active exception") and fail the job: run_train must end it when it returns, is
    preempted or refuses. Two real ranks, so the group is a real gloo group."""
    import socket

    data = tmp_path / "data"
    data.mkdir()
    (data / "index.json").write_text("{}")
    socks = [socket.socket() for _ in range(3)]
    for sock in socks:  # three distinct free ports, all held until chosen
        sock.bind(("127.0.0.1", 0))
    ports = ",".join(str(sock.getsockname()[1]) for sock in socks)
    for sock in socks:
        sock.close()
    base = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}
    base["MASTER_ADDR"] = "127.0.0.1"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STAGE_EXIT_SCRIPT, str(data), ports],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            raise AssertionError(f"a rank hung:\n{out[-2000:]}\n{err[-3000:]}") from None
        assert p.returncode == 0, out + err
        result = json.loads(out.split("RESULT ", 1)[1])
        assert result == {"inside": 2, "finished": False, "preempted": False, "refused": False}, result


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_process_group_ends_after_an_error_only_where_that_is_local(monkeypatch, backend):
    """A clean end (none, SystemExit) always ends the group; after an error, gloo's (local) does, NCCL's
    does not: its destroy flushes collectives and would wait on a peer that is gone."""
    import torch.distributed as dist

    ended = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: ended.append(group))
    with du.process_group_ends():
        pass
    with pytest.raises(SystemExit), du.process_group_ends():
        raise SystemExit(3)
    assert len(ended) == 2
    with pytest.raises(RuntimeError), du.process_group_ends():
        raise RuntimeError("a rank failed")
    assert len(ended) == (3 if backend == "gloo" else 2)
