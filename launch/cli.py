"""`fpa`: the one command-line entry point. Subcommands map to typed functions.

    fpa prepare CONFIG... [key=value ...]     corpus -> tokenizer -> webdataset shards + index
                                              (--step plan|part|merge: one step of a prepare in parts)
    fpa train CONFIG... [key=value ...]       DeepSpeed training (run it under torchrun/srun for N ranks)
    fpa eval CONFIG... [key=value ...]        passkey, perplexity by position, cache compression, report
    fpa run CONFIG... [key=value ...]         all stages in order, skipping those already done
    fpa export CONFIG... [key=value ...]      consolidated safetensors + config from a checkpoint
                                              (--format hf: a transformers directory)
    fpa generate CONFIG "prompt" [options]    text from the exported model, streamed (KV cache)
    fpa launch slurm CONFIG... [--dry-run]    render (and submit) the Slurm jobs of a run
    fpa sweep SWEEP.yaml [--local] [--collect]  an ablation grid as a Slurm job array (or locally)
    fpa print-config CONFIG... [key=value ...]  the fully resolved config
    fpa synthetic [--quick]                   the paper's one-layer synthetic experiment

Arguments containing '=' are overrides (dotted keys); the others are YAML files, merged left to right.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from data_prep.errors import DataError
from launch.slurm import launch_slurm
from launch.sweep import collect_sweep, run_sweep
from pipeline.config import ConfigError, RunConfig, describe_derived, load_config, to_yaml
from pipeline.generate import add_parser as add_generate_parser
from pipeline.stages import STAGES, export_dir, run_eval, run_prepare, run_train
from pipeline.upstream import check_checkpoint, check_data, check_export

# The CLI sits above every layer (launch -> pipeline -> fpa_model, data_prep). Modules that import torch or
# deepspeed (checkpoint, export, train, the synthetic experiment) are imported inside the commands that
# need them, so that `fpa print-config`, `fpa launch slurm --dry-run` and `fpa --help` start in a blink.

log = logging.getLogger("fpa")


def _split(items: list[str]) -> tuple[list[str], list[str]]:
    overrides = [a for a in items if "=" in a]
    paths = [a for a in items if "=" not in a]
    return paths, overrides


def _config(args: argparse.Namespace) -> RunConfig:
    paths, overrides = _split(args.items)
    return load_config(paths, overrides)


# -- subcommands -------------------------------------------------------------------------------------


def cmd_print_config(args: argparse.Namespace) -> int:
    cfg = _config(args)
    print(to_yaml(cfg), end="")
    if args.derived:
        print(describe_derived(cfg, args.world_size, args.tokens_per_second))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    part = args.part
    if part is None and args.step == "part" and os.environ.get("SLURM_ARRAY_TASK_ID"):
        part = int(os.environ["SLURM_ARRAY_TASK_ID"])
    result = run_prepare(_config(args), force=args.force, step=args.step, part=part)
    log.info("prepare: %s", {k: v for k, v in result.items() if not isinstance(v, dict | list)})
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    run_train(_config(args), force=args.force)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    run_eval(_config(args), checkpoint=Path(args.checkpoint) if args.checkpoint else None, force=args.force)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pipeline.checkpoint import find_latest  # torch: see the note on imports above
    from pipeline.export import export

    cfg = _config(args)
    ckpt = Path(args.checkpoint) if args.checkpoint else find_latest(cfg.run_dir / "checkpoints")
    if ckpt is None:
        raise ConfigError(f"no complete checkpoint under {cfg.run_dir / 'checkpoints'}")
    if args.format == "hf":  # --checkpoint may also name an export dir (model.safetensors + config.yaml)
        from pipeline.export import WEIGHTS, export_hf

        out = Path(args.out) if args.out else cfg.run_dir / "export-hf"
        check_data(cfg)  # the tokenizer the HF directory ships
        if (ckpt / WEIGHTS).is_file():
            check_export(cfg, ckpt, explicit=bool(args.checkpoint))
        else:
            check_checkpoint(cfg, ckpt, out, explicit_out=bool(args.out))
        print(export_hf(cfg, ckpt, out))
        return 0
    out = Path(args.out) if args.out else export_dir(cfg)
    check_checkpoint(cfg, ckpt, out, explicit_out=bool(args.out))
    out = export(cfg, ckpt, out)
    print(out)
    return 0


def _torchrun_train(items: list[str], nproc: int, force: bool) -> None:
    """Training on N local processes: the same CLI under torchrun (DeepSpeed picks gloo on CPU)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "launch.cli",
        "train",
        *items,
    ] + (["--force"] if force else [])
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    log.info("train: %s", " ".join(cmd))
    rc = subprocess.run(cmd, env=env).returncode
    if rc != 0:
        raise SystemExit(f"fpa: error: training exited with status {rc} (see the run's logs/train.log)")


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    stages = args.stages.split(",")
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ConfigError(f"unknown stage(s) {bad}; stages are {', '.join(STAGES)}")
    if "prepare" in stages:
        run_prepare(cfg, force=args.force)
    if "train" in stages:
        if args.nproc > 1:
            _torchrun_train(args.items, args.nproc, args.force)
        else:
            run_train(cfg, force=args.force)
    if "eval" in stages:
        result = run_eval(cfg, force=args.force)
        report = cfg.run_dir / "eval" / "report.md"
        if report.exists():
            print(report.read_text())
        else:
            log.info("eval: %s", result)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    paths, overrides = _split(args.items)
    load_config(paths, overrides)  # fail fast, before anything is rendered
    launch_slurm(paths, overrides, dry_run=args.dry_run)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.collect:
        print(collect_sweep(Path(args.sweep), out=args.out))
    else:
        run_sweep(Path(args.sweep), mode="local" if args.local else "slurm", dry_run=args.dry_run)
    return 0


# -- parser ------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fpa",
        description="Pretrain GPT models with First Passage Attention (and FoX / softmax baselines).",
        epilog="Arguments with '=' are config overrides (e.g. train.lr=1e-3); others are YAML files. "
        "Example: fpa run configs/tiny.yaml model.attention.kind=fox",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_items(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.add_argument(
            "items",
            nargs="*",
            metavar="CONFIG|KEY=VALUE",
            help="YAML config files (merged left to right) and key=value overrides",
        )
        return sp

    sp = with_items("prepare", "tokenize a corpus into webdataset shards with an index")
    sp.add_argument("--force", action="store_true", help="redo even if the manifest says done")
    sp.add_argument(
        "--step",
        choices=("plan", "part", "merge"),
        help="one step of a prepare in data.prepare_parts parts (what `fpa launch slurm` runs as a job "
        "array): plan (tokenizer, document counts), part (one slice), merge (the data and index)",
    )
    sp.add_argument("--part", type=int, help="with --step part: which (default $SLURM_ARRAY_TASK_ID)")
    sp.set_defaults(fn=cmd_prepare)

    sp = with_items("train", "train under DeepSpeed ZeRO (one process per rank: use torchrun/srun for N)")
    sp.add_argument("--force", action="store_true", help="redo even if the manifest says done")
    sp.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sp.set_defaults(fn=cmd_train)

    sp = with_items("eval", "passkey retrieval, perplexity by position, KV-cache compression, report")
    sp.add_argument(
        "--checkpoint", help="an export dir (model.safetensors + config.yaml); default: the run's"
    )
    sp.add_argument("--force", action="store_true", help="redo even if the manifest says done")
    sp.set_defaults(fn=cmd_eval)

    sp = with_items("run", "all stages in order (prepare -> train -> eval), skipping those already done")
    sp.add_argument("--nproc", type=int, default=1, help="training processes on this machine (torchrun)")
    sp.add_argument("--stages", default="prepare,train,eval", help="comma-separated subset of stages")
    sp.add_argument("--force", action="store_true", help="redo every stage")
    sp.set_defaults(fn=cmd_run)

    sp = with_items("export", "write consolidated safetensors weights + config from a checkpoint")
    sp.add_argument("--checkpoint", help="a checkpoint dir (default: the latest complete one)")
    sp.add_argument("--out", help="output dir (default: <run_dir>/export, or <run_dir>/export-hf for hf)")
    sp.add_argument(
        "--format",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="safetensors + config.yaml (default), or hf: a transformers directory (pip install -e .[hf])",
    )
    sp.set_defaults(fn=cmd_export)

    add_generate_parser(sub)

    sp = with_items("print-config", "print the fully resolved config")
    sp.add_argument("--derived", action="store_true", help="also print derived values (global batch, ...)")
    sp.add_argument("--world-size", type=int, default=1, help="ranks assumed for --derived")
    sp.add_argument(
        "--tokens-per-second",
        type=float,
        default=None,
        help="with --derived: training throughput per rank, to print the run's wall time",
    )
    sp.set_defaults(fn=cmd_print_config)

    lp = sub.add_parser("launch", help="launch a run on a cluster", description="launch a run on a cluster")
    lsub = lp.add_subparsers(dest="target", required=True, metavar="TARGET")
    sp = lsub.add_parser("slurm", help="render sbatch scripts (prepare, train, eval) and submit them chained")
    sp.add_argument("items", nargs="*", metavar="CONFIG|KEY=VALUE")
    sp.add_argument("--dry-run", action="store_true", help="print the scripts, submit nothing")
    sp.set_defaults(fn=cmd_launch)

    sp = sub.add_parser("sweep", help="run an ablation grid (Slurm job array or locally) or collect it")
    sp.add_argument("sweep", help="a sweep YAML (see configs/sweeps/)")
    sp.add_argument("--local", action="store_true", help="run the grid here, one run after another")
    sp.add_argument("--dry-run", action="store_true", help="print what would run")
    sp.add_argument("--collect", action="store_true", help="gather the runs' eval reports into one table")
    sp.add_argument("--out", help="with --collect: write the table here (default runs/sweeps/<name>/)")
    sp.set_defaults(fn=cmd_sweep)

    # Parsed by experiments.synthetic itself (main() hands it the rest of the command line).
    sub.add_parser("synthetic", help="one-layer synthetic tasks: FPA vs FoX vs softmax heads (--help)")
    return p


def _known_errors() -> tuple[type[BaseException], ...]:
    """Bad input or a stopped run: reported as one line (anything else is a bug and keeps its traceback)."""
    from pipeline.checkpoint import CheckpointError  # torch: see the note on imports above
    from pipeline.export import ExportError
    from pipeline.train import TrainingError

    return (ConfigError, FileNotFoundError, DataError, CheckpointError, ExportError, TrainingError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["synthetic"]:
        from experiments.synthetic import main as synthetic_main

        return synthetic_main(argv[1:])
    parser = build_parser()
    # Options may come after overrides (`fpa train a.yaml --force x=1`): argparse leaves the trailing
    # positionals over; they join the config items. Unknown options are still errors.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-")]
    if unknown or (extra and not hasattr(args, "items")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.items += extra
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return args.fn(args)
    except Exception as e:
        if not isinstance(e, _known_errors()):
            raise
        # Bad input is the user's to fix: one line, no traceback wall.
        print(f"fpa: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
