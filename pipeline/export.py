"""Export a DeepSpeed checkpoint to plain weights: <out>/model.safetensors (fp32) + <out>/config.yaml.

ZeRO-partitioned checkpoints are consolidated with DeepSpeed's get_fp32_state_dict_from_zero_checkpoint
(the fp32 master weights, not the bf16 copies); a ZeRO-0 checkpoint's module state is taken as is.
`load_exported` rebuilds the GPT from the export alone: no DeepSpeed, no process group.

Nothing here runs code from a file: checkpoint files are verified (checksums, weights_only unpickling
with an allowlist: pipeline.checkpoint) before anything reads them, DeepSpeed's consolidation runs with
torch.load forced to weights_only, and an export carries checksums.json, checked by `load_exported`
together with the weights being finite (a corrupted export is an error, not a NaN perplexity).

`export_hf` writes the same weights as a Hugging Face transformers directory (config.json with auto_map,
model.safetensors, the code files of pipeline/hf, which import the installed fpa_model package, and a fast
tokenizer with the end-of-document token as eos): `fpa export --format hf`.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fpa_model.config import ModelConfig
from fpa_model.model import GPT
from pipeline import checkpoint as ckpt_lib
from pipeline.atomic import atomic_write, atomic_write_text
from pipeline.config import RunConfig, from_yaml_text, to_yaml

WEIGHTS = "model.safetensors"
CONFIG = "config.yaml"


class ExportError(Exception):
    """A checkpoint that cannot be exported / an export that cannot be loaded, as one line."""


def _client_state(checkpoint_dir: Path) -> dict[str, Any]:
    # ZeRO-3 names it zero_pp_rank_0_mp_rank_00_model_states.pt; the client state is in every copy.
    files = sorted(checkpoint_dir.glob("mp_rank_*_model_states.pt")) or sorted(
        checkpoint_dir.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")
    )
    if not files:
        raise ExportError(f"{checkpoint_dir} holds no DeepSpeed model states (mp_rank_*_model_states.pt)")
    return ckpt_lib.safe_load(files[0])


def consolidated_state_dict(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 weights of the whole model from a DeepSpeed checkpoint dir (any ZeRO stage)."""
    checkpoint_dir = Path(checkpoint_dir)
    if any(checkpoint_dir.glob("bf16_zero_pp_rank_*optim_states.pt")):
        # DeepSpeed's bf16 optimizer (ZeRO 0/1 with bf16) saves a format zero_to_fp32 cannot read; its
        # universal conversion can, and holds every parameter's fp32 master copy.
        sd = _fp32_from_universal(checkpoint_dir)
    elif any(checkpoint_dir.glob("*zero_pp_rank_*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with ckpt_lib.weights_only_loads():  # zero_to_fp32 calls torch.load(weights_only=False)
            sd = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir.parent), tag=checkpoint_dir.name)
    else:
        sd = _client_state(checkpoint_dir)["module"]
    return {k: v.detach().to(torch.float32).contiguous() for k, v in sd.items()}


def _fp32_from_universal(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    from pipeline.checkpoint import COMPLETE, checksum_problem, convert_to_universal, universal_dir

    udir = universal_dir(checkpoint_dir)
    tmp = None
    if not (udir / COMPLETE).is_file() or checksum_problem(udir):  # none intact: convert into a temp dir
        tmp = Path(tempfile.mkdtemp(prefix=".export-universal-", dir=checkpoint_dir.parent))
        udir = convert_to_universal(checkpoint_dir, tmp / "u")
    try:
        out = {}
        for d in sorted((udir / "zero").iterdir()):
            f = d / "fp32.pt"
            if f.is_file():
                out[d.name] = ckpt_lib.safe_load(f)["param"]
        return out
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def export(cfg: RunConfig, checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """Write out_dir/model.safetensors + out_dir/config.yaml from a checkpoint; return out_dir.

    The model section comes from the config saved in the checkpoint (it has the resolved vocab size);
    cfg supplies the rest when the checkpoint holds no config.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if not checkpoint_dir.is_dir():
        raise ExportError(f"checkpoint directory not found: {checkpoint_dir}")
    # Before anything reads it: code in a file raises UnsafeCheckpointError, damage is named here.
    problem = ckpt_lib.verify_files(checkpoint_dir)
    if problem:
        raise ExportError(f"cannot export {checkpoint_dir}: {problem}")
    client = _client_state(checkpoint_dir)
    if client.get("config_yaml"):
        cfg = _config_from_checkpoint(client["config_yaml"], cfg, checkpoint_dir)
    if cfg.model.vocab_size is None:
        raise ExportError(f"model.vocab_size is unknown for {checkpoint_dir} (no config in the checkpoint)")
    sd = consolidated_state_dict(checkpoint_dir)
    model = GPT(cfg.model)
    expected = set(model.state_dict())
    if cfg.model.tie_embeddings:
        sd.pop("lm_head.weight", None)  # one tensor, stored once (safetensors refuses shared storage)
        expected.discard("lm_head.weight")
    missing, extra = expected - set(sd), set(sd) - expected
    if missing or extra:
        raise ExportError(
            f"{checkpoint_dir} does not match the model config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(extra)[:5]}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"step": str(client.get("step", "")), "source": str(checkpoint_dir)}
    atomic_write(out_dir / WEIGHTS, lambda p: save_file(sd, str(p), metadata=meta))
    atomic_write_text(out_dir / CONFIG, to_yaml(cfg))
    ckpt_lib.write_checksums(out_dir, [WEIGHTS, CONFIG])
    return out_dir


def _config_from_checkpoint(text: str, cfg: RunConfig, checkpoint_dir: Path) -> RunConfig:
    """The checkpoint's config; if the schema moved on since it was saved, its model section on cfg."""
    try:
        return from_yaml_text(text)
    except Exception:
        from omegaconf import OmegaConf

        try:
            model = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.create(text)["model"])
            return dataclasses.replace(cfg, model=OmegaConf.to_object(model))
        except Exception as e:
            raise ExportError(
                f"the model config saved in {checkpoint_dir} does not fit this code: {str(e).splitlines()[0]}"
            ) from None


def load_exported(path: str | Path, device: str | torch.device = "cpu") -> GPT:
    """A GPT (eval mode, fp32) from an export dir or its model.safetensors."""
    path = Path(path)
    folder = path.parent if path.is_file() else path
    weights, config = folder / WEIGHTS, folder / CONFIG
    for f in (weights, config):
        if not f.is_file():
            raise ExportError(f"export is missing {f}")
    problem = ckpt_lib.checksum_problem(folder)  # exports older than checksums.json: none to check
    if problem:
        raise ExportError(f"export {folder}: {problem}")
    cfg = from_yaml_text(config.read_text())
    model = GPT(cfg.model)
    try:
        sd = load_file(str(weights), device="cpu")
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise ExportError(f"{weights} is unreadable ({str(e).splitlines()[0][:200]})") from None
    bad = [k for k, v in sd.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ExportError(f"{weights} holds non-finite weights ({', '.join(sorted(bad)[:3])})")
    if cfg.model.tie_embeddings:
        sd["lm_head.weight"] = sd["embed.weight"]
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ExportError(f"{weights} does not fit {config}: {str(e).splitlines()[0]}") from None
    return model.to(device).eval()


# -- Hugging Face transformers format (`fpa export --format hf`) --------------------------------------

HF_CODE = ("configuration_fpa.py", "modeling_fpa.py")  # shipped with the weights (trust_remote_code)


def hf_model(model: GPT, *, eos_id: int | None = None, cache: Any = None) -> Any:
    """The transformers model (pipeline.hf.modeling_fpa.FPAForCausalLM) around a copy of model's weights.

    cache: an eval.cache section (pipeline.config.CacheConfig) whose margin / delta / norm_slack become the
    eviction settings of generate(); eviction itself stays off (config.evict) so that generate() reproduces
    the full forward pass unless asked. A model.attention.document_mask model keeps its documents apart:
    from position_ids resets or the end-of-document token eos_id (pipeline.hf.modeling_fpa).
    """
    masked = model.cfg.attention.document_mask
    if masked and eos_id is None:
        raise ValueError(
            "model.attention.document_mask=true: the HF export needs eos_id (the end-of-document id) to "
            "cut documents when no position_ids are given"
        )
    from pipeline.hf.configuration_fpa import FPAConfig
    from pipeline.hf.modeling_fpa import FPAForCausalLM, model_config_dict

    extra = {}
    if cache is not None:
        extra = {
            "evict_margin": cache.margin,
            "evict_delta": cache.delta,
            "evict_norm_slack": cache.norm_slack,
        }
    config = FPAConfig(
        fpa_model=model_config_dict(model.cfg),
        eos_token_id=eos_id,
        bos_token_id=eos_id,  # documents follow an end-of-document token in training
        pad_token_id=eos_id,
        document_eod_id=eos_id if masked else None,
        **extra,
    )
    config.auto_map = {
        "AutoConfig": "configuration_fpa.FPAConfig",
        "AutoModelForCausalLM": "modeling_fpa.FPAForCausalLM",
    }
    hf = FPAForCausalLM(config)
    hf.model.load_state_dict(model.state_dict())
    return hf.to(next(model.parameters()).device).eval()


def hf_tokenizer(tokenizer: Any, eos_id: int, max_length: int | None = None) -> Any:
    """A transformers fast tokenizer around a `tokenizers.Tokenizer`, with the end-of-document token as
    eos (and pad: generate() pads finished rows with it). No BOS is added: prompts encode as in training."""
    from transformers import PreTrainedTokenizerFast

    eos = tokenizer.id_to_token(eos_id)
    if eos is None:
        raise ExportError(f"the tokenizer has no token with the end-of-document id {eos_id}")
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, pad_token=eos)
    if max_length is not None:
        tok.model_max_length = max_length
    return tok


def export_hf(cfg: RunConfig, source: str | Path, out_dir: str | Path) -> Path:
    """Write a transformers directory (config.json, model.safetensors, the two code files, tokenizer) to
    out_dir; return it. source: an export dir (model.safetensors + config.yaml) or a DeepSpeed checkpoint
    (exported first, into a temporary dir). The tokenizer is the run's (<data_dir>/tokenizer.json), its
    end-of-document token the eos.

    The code files import the installed `fpa_model` package (this project): loading the directory with
    AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True) needs it installed.
    """
    from data_prep.index import load_index
    from data_prep.tokenizer import load_tokenizer

    source, out_dir = Path(source), Path(out_dir)
    if not (source / WEIGHTS).is_file() and not source.is_file():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".export-", dir=out_dir.parent) as tmp:
            export(cfg, source, tmp)
            return export_hf(cfg, tmp, out_dir)
    model = load_exported(source)
    index = load_index(cfg.data_dir)
    tokenizer = load_tokenizer(cfg.data_dir)
    if tokenizer.get_vocab_size() > model.cfg.vocab_size:
        raise ExportError(
            f"the tokenizer in {cfg.data_dir} has {tokenizer.get_vocab_size()} tokens but the model "
            f"{model.cfg.vocab_size}: the weights were trained on other data"
        )
    hf = hf_model(model, eos_id=index.eod_id, cache=cfg.eval.cache)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out_dir)
    code = Path(__file__).parent / "hf"
    for name in HF_CODE:
        atomic_write_text(out_dir / name, (code / name).read_text())
    hf_tokenizer(tokenizer, index.eod_id, model.cfg.max_seq_len).save_pretrained(out_dir)
    return out_dir
