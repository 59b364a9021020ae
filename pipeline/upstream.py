"""Each stage reads only the inputs the stage before it recorded, whichever command runs it.

`fpa run` redoes a stage whose outputs changed; a stage command run alone (`fpa train`, `fpa eval`,
`fpa export`, `fpa generate`, `fpa export --format hf`, the Slurm job scripts that call them) checks its
inputs here before it reads them, and refuses a mismatch with one line: the file, the recorded and the
found hash, and the command that redoes the producing stage.

    check_data(cfg)                      train, eval, generate, the HF export: the prepared data
    check_export(cfg, export, explicit)  eval, generate, the HF export: the exported weights
    check_checkpoint(cfg, ckpt, out)     export: the checkpoint it consolidates

What is compared: the producer's manifest (manifests/<stage>.json, the sha256 of what it wrote), and, with
or without one, what the files say of themselves (the data's content config and tokenizer hash in
index.json; the run name in an export's or checkpoint's config). Hashes are computed once per process per
file (data_prep.index.sha256_cached); bench/upstream_check.py measures the cost at 110M scale.

An export from elsewhere is evaluated on purpose by naming it (`--checkpoint <dir>` or
`eval.checkpoint=<dir>`); the report then says whose weights it evaluated (weights_of).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data_prep.index import sha256_cached
from data_prep.prepare import consumable_problem
from pipeline.config import ConfigError, RunConfig, from_yaml_text
from pipeline.rundir import RunDir

__all__ = ["UpstreamError", "check_checkpoint", "check_data", "check_export", "weights_of"]


class UpstreamError(ConfigError):
    """A stage's input is not the one the producing stage recorded (the CLI prints it as one line)."""


def _redo(cfg: RunConfig, command: str) -> str:
    # The run dir holds its resolved config (RunDir.init): a command that works whatever the user typed.
    return f"{command.replace('CONFIG', str(cfg.run_dir / 'config.yaml'))}"


def _recorded(cfg: RunConfig, stage: str) -> dict[str, str]:
    """{path: sha256} a done stage's manifest recorded for its outputs ({} without a done manifest)."""
    m = RunDir(cfg).read_manifest(stage)
    if m is None or m.status != "done" or not isinstance(m.outputs, dict):
        return {}
    run = RunDir(cfg)
    return {str(_resolve(run, rel)): digest for rel, digest in m.outputs.items()}


def _resolve(run: RunDir, rel: str) -> Path:
    p = Path(rel)
    return (p if p.is_absolute() else run.path / p).resolve()


def _mismatch(path: Path, recorded: str, found: str, stage: str, redo: str) -> UpstreamError:
    return UpstreamError(
        f"{path} is not the file `fpa {stage}` recorded for this run (sha256 {recorded[:12]} recorded, "
        f"{found[:12]} found); redo that stage: {redo}"
    )


def check_data(cfg: RunConfig) -> None:
    """The prepared data a stage is about to read is this run's: the files prepare recorded (index.json,
    tokenizer.json, when this run prepared them) unchanged, and, in any case, prepared with this config's
    content keys and holding the tokenizer its index records."""
    data = cfg.data_dir
    redo = _redo(cfg, "fpa prepare CONFIG --force")
    recorded = _recorded(cfg, "prepare")
    for name in ("index.json", "tokenizer.json"):
        p = (data / name).resolve()
        if str(p) in recorded and p.is_file():
            found = sha256_cached(p)
            if found != recorded[str(p)]:
                raise _mismatch(p, recorded[str(p)], found, "prepare", redo)
    problem = consumable_problem(cfg.data, data)
    if problem is not None:
        raise UpstreamError(f"{problem}; prepare this run's data: {redo}")


def _export_run_name(export: Path) -> str | None:
    """The run an export was trained by (the `name` in its config.yaml), None when unreadable."""
    try:
        return str(from_yaml_text((export / "config.yaml").read_text()).name)
    except Exception:  # a damaged config: load_exported names the problem when it reads it
        return None


def _exported_from(export: Path) -> str | None:
    """The checkpoint an export was consolidated from (its safetensors metadata), None when unknown."""
    try:
        from safetensors import safe_open

        with safe_open(str(export / "model.safetensors"), framework="pt") as f:
            return (f.metadata() or {}).get("source")
    except Exception:
        return None


def check_export(cfg: RunConfig, export: Path, explicit: bool) -> None:
    """The export about to be evaluated, sampled or converted is this run's: trained under its name, and
    the weights training recorded, or exported since from one of this run's own checkpoints (`fpa
    export` of another step). explicit (the user named the export): anything goes, nothing is checked
    here; the report says whose weights they were."""
    if explicit:
        return
    weights = (export / "model.safetensors").resolve()
    if not weights.is_file():
        return  # the stage's own error names the missing file
    redo = _redo(cfg, "fpa export CONFIG (or retrain: fpa train CONFIG --force)")
    owner = _export_run_name(export)
    if owner is not None and owner != cfg.name:
        raise UpstreamError(
            f"{weights} was trained by run {owner!r}, not {cfg.name!r}: redo this run's export ({redo}), "
            f"or evaluate that export on purpose with --checkpoint {export}"
        )
    recorded = _recorded(cfg, "train").get(str(weights))
    if recorded is None:
        return
    found = sha256_cached(weights)
    if found == recorded:
        return
    source = _exported_from(export)
    checkpoints = (cfg.run_dir / "checkpoints").resolve()
    if source and Path(source).resolve().is_relative_to(checkpoints) and Path(source).is_dir():
        return  # re-exported from one of this run's checkpoints (another step): still this run's weights
    raise UpstreamError(
        f"{weights} is not the file `fpa train` recorded for this run (sha256 {recorded[:12]} recorded, "
        f"{found[:12]} found) nor an export of this run's checkpoints: redo it ({redo}), or evaluate it "
        f"on purpose with --checkpoint {export}"
    )


def check_checkpoint(cfg: RunConfig, checkpoint: Path, out: Path, explicit_out: bool) -> None:
    """`fpa export` writes this run's export only from this run's checkpoints of the lineage training
    recorded: another checkpoint (another run's, an abandoned lineage's) goes to an explicit --out."""
    if explicit_out:
        return
    from pipeline.checkpoint import lineage_of

    ckpt = Path(checkpoint).resolve()
    root = (cfg.run_dir / "checkpoints").resolve()
    if not ckpt.is_relative_to(root):
        raise UpstreamError(
            f"{checkpoint} is not one of this run's checkpoints ({root}): exporting it would replace {out} "
            f"with weights this run did not train; export it elsewhere with --out <dir>"
        )
    m = RunDir(cfg).read_manifest("train")
    trained = (m.result or {}).get("checkpoint") if m is not None and m.status == "done" else None
    if isinstance(trained, str) and Path(trained).is_dir():
        want, got = lineage_of(Path(trained)), lineage_of(ckpt)
        if want and got and want != got:
            raise UpstreamError(
                f"{checkpoint} belongs to lineage {got}, not {want}, the one training finished on "
                f"({trained}): export it elsewhere with --out <dir>"
            )


def weights_of(cfg: RunConfig, export: Path, explicit: bool) -> dict[str, Any]:
    """For the report: whose weights were evaluated (run name, sha256, whether named on purpose)."""
    weights = export / "model.safetensors"
    owner = _export_run_name(export)
    return {
        "run": owner,
        "this_run": owner == cfg.name,
        "explicit": explicit,
        "sha256": sha256_cached(weights) if weights.is_file() else None,
    }
