"""What checking a stage's inputs (pipeline.upstream) costs at 110M scale, against loading the export.

    python bench/stage_inputs.py [--repeats 3] [--d-model 768 --n-layer 12 --vocab 32768]

A GPT of about 110M parameters is exported (model.safetensors fp32 + config.yaml + checksums.json) into a
run dir whose train manifest records it, as `fpa train` leaves it. Timed, medians of --repeats, side by
side: check_export with the hash not yet computed in this process (the first check of an `fpa eval`; the
file is in the page cache, as it is right after training), check_export again (the hash remembered per
path, inode, size and mtime), and load_exported, what every eval does anyway (it verifies checksums.json
and builds the model). Writes docs/results/stage_inputs/.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--result-dir", type=Path, default=None)
    ap.add_argument("--no-result", action="store_true", help="print only, write no result file")
    return ap.parse_args(argv)


def _median_s(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import torch
    from safetensors.torch import save_file

    import data_prep.index as index_mod
    from bench.results import finish_provenance, markdown_table, provenance, provenance_md, write_result
    from fpa_model.config import ModelConfig
    from fpa_model.model import GPT
    from pipeline import checkpoint as ckpt_lib
    from pipeline.config import RunConfig, to_yaml
    from pipeline.export import load_exported
    from pipeline.rundir import Manifest, RunDir
    from pipeline.upstream import check_export

    args = parse_args(argv)
    torch.set_num_threads(1)  # before provenance, which records the thread count
    prov = provenance(None if argv is None else ["bench/stage_inputs.py", *argv])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig(name="bench", runs_dir=tmp)
        cfg.model = ModelConfig(vocab_size=args.vocab, n_layer=args.n_layer, n_head=12, d_model=args.d_model)
        model = GPT(cfg.model)
        n_params = model.num_parameters()
        export = cfg.run_dir / "export"
        export.mkdir(parents=True)
        sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(
            sd, str(export / "model.safetensors"), metadata={"source": str(cfg.run_dir / "checkpoints")}
        )
        (export / "config.yaml").write_text(to_yaml(cfg))
        ckpt_lib.write_checksums(export, ["model.safetensors", "config.yaml"])
        del model, sd
        run = RunDir(cfg)
        weights = export / "model.safetensors"
        size_mb = weights.stat().st_size / 2**20
        outputs = {run.rel(weights): index_mod.sha256_file(weights)}
        run.write_manifest(Manifest(stage="train", status="done", fingerprint="-", outputs=outputs))

        def forget() -> None:
            index_mod._SHA_CACHE.clear()

        first = _median_s(lambda: check_export(cfg, export, explicit=False), args.repeats, before=forget)
        again = _median_s(lambda: check_export(cfg, export, explicit=False), args.repeats)
        load = _median_s(lambda: load_exported(export), args.repeats)
    finish_provenance(prov)
    rows = [
        ["check_export, first in the process (hash)", f"{first:.3f}", f"{first / load:.2f}"],
        ["check_export, again (remembered hash)", f"{again:.3f}", f"{again / load:.3f}"],
        ["load_exported (every eval does it)", f"{load:.3f}", "1.00"],
    ]
    print(f"{n_params / 1e6:.0f}M parameters, model.safetensors {size_mb:.0f} MiB, medians of {args.repeats}")
    for r in rows:
        print(f"  {r[0]:<45} {r[1]:>10} s   x load {r[2]}")
    if not args.no_result:
        md = "\n".join(
            [
                "# Stage input checks at 110M scale (`bench/stage_inputs.py`)",
                "",
                f"{n_params / 1e6:.0f}M parameters, model.safetensors {size_mb:.0f} MiB (fp32), file in the "
                f"page cache, one thread, medians of {args.repeats}.",
                "",
                markdown_table(["step", "seconds", "x load_exported"], rows),
                "",
                provenance_md(prov),
            ]
        )
        data = {
            "n_params": n_params,
            "weights_mib": size_mb,
            "check_first_s": first,
            "check_again_s": again,
            "load_exported_s": load,
            "provenance": prov,
        }
        out = write_result("stage_inputs", data, md, args.result_dir)
        print(f"wrote {out}/result.json and result.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
