"""Data pipeline benchmark on the embedded default corpus (configs/tiny.yaml: KJV train, wiki validation).

1. prepare throughput: prepare_data (with the tokenizer already trained, so both sides tokenize the same
   text) in tokens/s, against raw `Tokenizer.encode_batch` on the same documents in the same batches, in
   the same process, alternating runs; medians. Target: ratio >= 0.9. prepare reads and parses its
   sources itself while the raw side gets the documents in memory. Wall-clock ratios swing with other
   load on a shared machine, so the ratio of tokens per CPU-second (all threads) is printed as well.
   The tokenizer training time and a full end-to-end prepare are reported too.
2. prepare across processes (data.prepare_processes = 1, 2, 4) on the train corpus --scale (10) times as
   jsonl: tokens/s and wall time of prepare_data with the trained tokenizer, each in a fresh process,
   beside raw `encode_batch` on the same documents and cores in this one, measured alternately; the
   ratio per process count (target >= 0.9x), and each prepare's peak RSS: its own, its largest worker's,
   and all of its processes together (psutil, sampled).
3. memory: peak RSS of a whole prepare (tokenizer training included) in a fresh process, on the default
   train corpus and on a jsonl corpus --rss-scale times bigger (copies of it, each document tagged with
   its copy number); streaming keeps the peak flat instead of growing with the corpus.
4. loader throughput: ShardLoader over the train split (tokens/s of input positions, micro_batch x
   seq_len per batch) against what one training step of the tiny model consumes, measured here (forward,
   backward, AdamW step at the config's micro batch) unless --assume-train-tps is given. Target: >= 10x.

Usage: OMP_NUM_THREADS=1 python bench/data.py [--repeats 5] [--json out.json] [--only processes,rss]
Sections 1 and 4 are written to docs/results/data/result.{json,md}, sections 2 and 3 to
docs/results/data_prepare/result.{json,md} (or under --out), each with the commit, machine, command and
the load average at its start and end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

from data_prep.prepare import prepare_data  # noqa: E402
from data_prep.sources import forget_parsed_corpora, iter_documents  # noqa: E402
from pipeline.config import load_config  # noqa: E402


def bench_prepare(cfg: Any, work: Path, repeats: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    t = time.perf_counter()
    full = prepare_data(cfg, work / "full", progress=False)
    e2e_seconds = time.perf_counter() - t
    tok_path = work / "full" / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_path))
    # Like for like: the timed prepares write the train and validation splits, the documents that raw
    # encode_batch gets (the end-to-end figure above includes the extra validation splits).
    cfg = dataclasses.replace(cfg, extra_validation={})
    cfg.tokenizer = dataclasses.replace(cfg.tokenizer, path=str(tok_path))
    docs = list(iter_documents(cfg.train, max_doc_chars=cfg.max_doc_chars))
    docs += list(iter_documents(cfg.validation, max_doc_chars=cfg.max_doc_chars))
    bs = cfg.tokenize_batch_docs
    raw_tps, prep_tps, raw_cpu, prep_cpu = [], [], [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), _cpu()
        n = 0
        for i in range(0, len(docs), bs):
            n += sum(len(e.ids) for e in tok.encode_batch(docs[i : i + bs], add_special_tokens=False))
        raw_tps.append(n / (time.perf_counter() - t))
        raw_cpu.append(n / (_cpu() - c))
        forget_parsed_corpora()  # each timed prepare reads its sources as a fresh process does
        t, c = time.perf_counter(), _cpu()
        s = prepare_data(cfg, work / "again", progress=False)
        prep_tps.append(s["tokens"] / (time.perf_counter() - t))
        prep_cpu.append(s["tokens"] / (_cpu() - c))
    raw, prep = statistics.median(raw_tps), statistics.median(prep_tps)
    return {
        "documents": len(docs),
        "tokens": full["tokens"],
        "raw_tokens": n,  # the train and validation documents (prepare also writes data.extra_validation)
        "extra_validation": sorted(cfg.extra_validation),
        "end_to_end_seconds": e2e_seconds,
        "tokenizer_train_seconds": full["tokenizer_seconds"],
        "raw_encode_batch_tokens_per_s": raw,
        "prepare_tokens_per_s": prep,
        "prepare_over_raw": prep / raw,
        # per run, the two measured back to back: less exposed to load that drifts over the whole bench
        "prepare_over_raw_paired_median": statistics.median(p / r for p, r in zip(prep_tps, raw_tps)),
        # tokens per CPU-second (all threads): what each side costs, whatever else runs on the machine
        "prepare_over_raw_cpu": statistics.median(prep_cpu) / statistics.median(raw_cpu),
        "raw_runs": raw_tps,
        "prepare_runs": prep_tps,
    }


def bench_processes(
    cfg: Any, work: Path, processes: list[int], repeats: int, scale: int = 1, config: str = ""
) -> dict[str, Any]:
    """prepare_data at each process count (the tokenizer given, so both sides only tokenize) against raw
    encode_batch on the same documents and batches, alternating, medians of `repeats`.

    scale > 1: the train corpus written `scale` times as jsonl (tagged copies, as for the RSS figure) and
    each prepare run in a fresh process (`config` loaded there), which reports its wall time and memory
    (see _prepare_child)."""
    from tokenizers import Tokenizer

    tok_path = work / "full" / "tokenizer.json"
    if not tok_path.is_file():
        prepare_data(cfg, work / "full", progress=False)
    tok = Tokenizer.from_file(str(tok_path))
    corpus = None
    if scale > 1:
        from data_prep.config import SourceConfig

        corpus = _write_corpus(cfg, work / f"corpus-{scale}x.jsonl", scale)
        cfg = dataclasses.replace(cfg, train=SourceConfig(type="jsonl", paths=[str(corpus)]))
    docs = [
        d for src in (cfg.train, cfg.validation) for d in iter_documents(src, max_doc_chars=cfg.max_doc_chars)
    ]
    bs = cfg.tokenize_batch_docs
    rows = []
    for p in processes:
        c = dataclasses.replace(cfg, prepare_processes=p, extra_validation={})
        c.tokenizer = dataclasses.replace(cfg.tokenizer, path=str(tok_path))
        raw_tps, prep_tps, seconds, mem = [], [], [], []
        for _ in range(repeats):
            t = time.perf_counter()
            n = sum(
                len(e.ids)
                for i in range(0, len(docs), bs)
                for e in tok.encode_batch(docs[i : i + bs], add_special_tokens=False)
            )
            raw_tps.append(n / (time.perf_counter() - t))
            if corpus is None:
                t = time.perf_counter()
                s = prepare_data(c, work / f"proc{p}", progress=False)
                seconds.append(time.perf_counter() - t)
            else:
                s = _prepare_child(config, corpus, tok_path, p, work / f"proc{p}")
                seconds.append(s["seconds"])
                mem.append(s)
            prep_tps.append(s["tokens"] / seconds[-1])
        raw, prep = statistics.median(raw_tps), statistics.median(prep_tps)
        row = {
            "processes": p,
            "prepare_seconds": statistics.median(seconds),
            "prepare_tokens_per_s": prep,
            "raw_encode_batch_tokens_per_s": raw,
            "ratio": prep / raw,
            "paired_median_ratio": statistics.median(a / b for a, b in zip(prep_tps, raw_tps)),
            "prepare_runs": prep_tps,
            "raw_runs": raw_tps,
        }
        if mem:  # the largest of the runs: a peak is what a node must have, not a typical value
            for k in ("rss_before_mb", "peak_rss_mb", "worker_peak_rss_mb", "tree_peak_rss_mb", "maxrss_mb"):
                row[k] = max(m[k] for m in mem)
        rows.append(row)
        mem_text = (
            f"; peak RSS {row['peak_rss_mb']:.0f} MB (before prepare {row['rss_before_mb']:.0f}), largest "
            f"worker {row['worker_peak_rss_mb']:.0f} MB, all processes together "
            f"{row['tree_peak_rss_mb']:.0f} MB"
            if mem
            else ""
        )
        print(
            f"prepare_processes={p}: prepare {prep / 1e6:.3f} M tok/s ({row['prepare_seconds']:.1f} s) | "
            f"raw encode_batch {raw / 1e6:.3f} M tok/s | ratio {prep / raw:.2f} "
            f"(paired {row['paired_median_ratio']:.2f}; target >= 0.9){mem_text}",
            flush=True,
        )
    out = {"documents": len(docs), "tokens": s["tokens"], "scale": scale, "repeats": repeats, "rows": rows}
    if corpus is not None:
        out["corpus_mb"] = corpus.stat().st_size / 2**20
        corpus.unlink()
    return out


def _write_corpus(cfg: Any, path: Path, scale: int) -> Path:
    """The train corpus `scale` times as jsonl, each copy tagged (the copies are not identical documents)."""
    docs = list(iter_documents(cfg.train, max_doc_chars=cfg.max_doc_chars))
    with open(path, "w") as f:
        for copy in range(scale):
            for d in docs:
                f.write(json.dumps({"text": f"[{copy}] {d}"}) + "\n")
    return path


_PROC_CHILD = """
import dataclasses, json, resource, sys, threading, time
from pathlib import Path
from data_prep.config import SourceConfig
from pipeline.config import load_config
cfg = load_config([sys.argv[1]]).data
cfg = dataclasses.replace(cfg, train=SourceConfig(type="jsonl", paths=[sys.argv[2]]), extra_validation={},
                          prepare_processes=int(sys.argv[4]))
cfg.tokenizer = dataclasses.replace(cfg.tokenizer, path=sys.argv[3])
from data_prep.prepare import prepare_data
import psutil  # sampled: ru_maxrss of this process is already at its peak from the config's imports (torch)
me = psutil.Process()
before = me.memory_info().rss / 2**20
peak, stop = {"own": before, "tree": before}, threading.Event()
def sample():
    while not stop.wait(0.05):
        own = me.memory_info().rss
        tree = own
        for c in me.children(recursive=True):
            try:
                tree += c.memory_info().rss
            except psutil.Error:
                pass
        peak["own"] = max(peak["own"], own / 2**20)
        peak["tree"] = max(peak["tree"], tree / 2**20)
threading.Thread(target=sample, daemon=True).start()
t = time.perf_counter()
s = prepare_data(cfg, Path(sys.argv[5]), progress=False)
seconds = time.perf_counter() - t
stop.set()
print(json.dumps({"tokens": s["tokens"], "seconds": seconds, "rss_before_mb": before,
                  "peak_rss_mb": peak["own"], "tree_peak_rss_mb": peak["tree"],
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def _prepare_child(config: str, corpus: Path, tok_path: Path, processes: int, out: Path) -> dict[str, Any]:
    """One prepare in a fresh process: its tokens, seconds (prepare_data alone) and memory in MB, sampled
    every 0.05 s with psutil: its RSS before prepare_data (the interpreter and the config loader's imports)
    and at its peak, the peak of the sum over it and its workers; and its largest worker's peak RSS
    (getrusage of the reaped workers, exact)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROC_CHILD, config, str(corpus), str(tok_path), str(processes), str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    if proc.returncode != 0:
        raise SystemExit(f"prepare child failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


_RSS_CHILD = """
import json, resource, sys, time
from pathlib import Path
from data_prep.config import SourceConfig
from pipeline.config import load_config
cfg = load_config([sys.argv[1]]).data
cfg.train = SourceConfig(type="jsonl", paths=[sys.argv[2]])
cfg.extra_validation = {}
from data_prep.prepare import prepare_data
t = time.perf_counter()
s = prepare_data(cfg, Path(sys.argv[3]), progress=False)
print(json.dumps({"tokens": s["tokens"], "seconds": time.perf_counter() - t,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def bench_rss(config: str, cfg: Any, work: Path, scale: int) -> dict[str, Any]:
    """Peak RSS of a whole prepare in a fresh process, on the train corpus as jsonl at 1x and `scale`x."""
    docs = list(iter_documents(cfg.train, max_doc_chars=cfg.max_doc_chars))
    out = {}
    for k in (1, scale):
        corpus = work / f"corpus-{k}x.jsonl"
        with open(corpus, "w") as f:
            for copy in range(k):  # each copy tagged, so the copies are not identical documents
                for d in docs:
                    f.write(json.dumps({"text": f"[{copy}] {d}"}) + "\n")
        proc = subprocess.run(
            [sys.executable, "-c", _RSS_CHILD, config, str(corpus), str(work / f"rss-{k}x")],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
        )
        if proc.returncode != 0:
            raise SystemExit(f"rss child failed: {proc.stderr.strip().splitlines()[-1:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["corpus_mb"] = corpus.stat().st_size / 2**20
        out[f"{k}x"] = r
        print(
            f"peak RSS, {k}x corpus ({r['corpus_mb']:.0f} MB jsonl, {r['tokens']:,} tokens, "
            f"{r['seconds']:.0f} s): {r['peak_rss_mb']:.0f} MB"
        )
        corpus.unlink()
    return out


def result_markdown(out: dict[str, Any], prov: dict[str, Any]) -> str:
    from bench.results import provenance_md

    lines = ["# Data prepare: throughput across processes, memory at 10x", "", provenance_md(prov), ""]
    if "processes" in out:
        p = out["processes"]
        scaled = p.get("scale", 1) > 1
        corpus = (
            f"the train corpus {p['scale']}x as jsonl ({p['corpus_mb']:.0f} MB; tagged copies) + the "
            "validation split, each prepare in a fresh process"
            if scaled
            else "the default corpus"
        )
        lines += [
            f"prepare_data with the trained tokenizer on {corpus} ({p['documents']:,} documents, "
            f"{p['tokens']:,} tokens) against raw `encode_batch` on the same documents, batches and cores, "
            f"alternating runs, medians of {p.get('repeats', len(p['rows'][0]['raw_runs']))}:",
            "",
            "| data.prepare_processes | prepare s | prepare M tok/s | raw encode_batch M tok/s | ratio | "
            "paired ratio |"
            + (" peak RSS MB: prepare (before) / largest worker / all together |" if scaled else ""),
            "|---|---|---|---|---|---|" + ("---|" if scaled else ""),
        ]
        for r in p["rows"]:
            mem = ""
            if scaled:
                tree = f"{r['tree_peak_rss_mb']:.0f}"
                worker = f"{r['worker_peak_rss_mb']:.0f}" if r["processes"] > 1 else "-"
                mem = f" {r['peak_rss_mb']:.0f} ({r['rss_before_mb']:.0f}) / {worker} / {tree} |"
            lines.append(
                f"| {r['processes']} | {r['prepare_seconds']:.1f} | {r['prepare_tokens_per_s'] / 1e6:.3f} | "
                f"{r['raw_encode_batch_tokens_per_s'] / 1e6:.3f} | {r['ratio']:.2f} | "
                f"{r['paired_median_ratio']:.2f} |" + mem
            )
        lines.append("")
    if "rss" in out:
        lines += [
            "Peak RSS of a whole prepare (tokenizer training included) in a fresh process:",
            "",
            "| corpus | jsonl MB | tokens | seconds | peak RSS MB |",
            "|---|---|---|---|---|",
        ]
        for k, r in out["rss"].items():
            lines.append(
                f"| {k} | {r['corpus_mb']:.0f} | {r['tokens']:,} | {r['seconds']:.0f} | "
                f"{r['peak_rss_mb']:.0f} |"
            )
    return "\n".join(lines)


def _cpu() -> float:
    """CPU seconds of this process, every thread included (tokenizers' Rust pool too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bench_loader(data_dir: Path, micro_batch: int, repeats: int, batches: int) -> dict[str, Any]:
    from data_prep.loader import ShardLoader

    loader = ShardLoader(data_dir, "train", micro_batch=micro_batch)
    it = iter(loader)
    t = time.perf_counter()
    next(it)  # first batch reads and verifies the shards
    first = time.perf_counter() - t
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(batches):
            next(it)
        runs.append(batches * micro_batch * loader.seq_len / (time.perf_counter() - t))
    return {"first_batch_seconds": first, "tokens_per_s": statistics.median(runs), "runs": runs}


def bench_train_step(cfg: Any, vocab_size: int, steps: int) -> dict[str, Any]:
    import torch

    from fpa_model.model import GPT
    from pipeline.trainer.loss import lm_loss

    torch.manual_seed(0)
    cfg.model.vocab_size = vocab_size
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b, t = cfg.train.micro_batch, cfg.data.seq_len
    x = torch.randint(0, vocab_size, (b, t + 1))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return {"step_seconds": step, "tokens_per_s": b * t / step, "micro_batch": b, "seq_len": t}


# The result files, each written from the sections it holds once they have run (--out: their parent dir).
RESULT_GROUPS = {"data": ("prepare", "loader"), "data_prepare": ("processes", "rss")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loader-batches", type=int, default=2000)
    ap.add_argument("--train-steps", type=int, default=5)
    ap.add_argument("--assume-train-tps", type=float, default=None, help="skip the model step measurement")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument(
        "--processes", type=int, nargs="*", default=[1, 2, 4], help="prepare_processes to measure"
    )
    ap.add_argument(
        "--scale",
        type=int,
        default=10,
        help="processes section on the train corpus this many times as jsonl, each prepare in a fresh "
        "process with its wall time and peak RSS (1: the default corpus, in this process)",
    )
    ap.add_argument("--rss-scale", type=int, default=10, help="corpus multiple for the peak-RSS measurement")
    ap.add_argument("--only", default=None, help="comma-separated sections: prepare,processes,rss,loader")
    ap.add_argument(
        "--out", type=Path, default=None, help="parent of the result dirs data/, data_prepare/ (docs/results)"
    )
    args = ap.parse_args(argv)

    cfg = load_config([args.config])
    out: dict[str, Any] = {}
    only = set(args.only.split(",")) if args.only else {"prepare", "processes", "rss", "loader"}
    # here, not at the top: it imports torch, and every tokenizer worker process imports this module
    from bench.results import finish_provenance, provenance, write_result

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        dirty = None
        for name, sections in RESULT_GROUPS.items():
            if not only & set(sections):
                continue
            prov = provenance(None if argv is None else ["bench/data.py", *argv])
            # the tree as this run found it: a result file an earlier group of the run wrote is not code
            dirty = prov["dirty"] if dirty is None else dirty
            prov["dirty"] = dirty
            if "prepare" in only and "prepare" in sections:
                out["prepare"] = bench_prepare(cfg.data, work, args.repeats)
                print_prepare(out["prepare"], args.repeats)
            if "loader" in only and "loader" in sections:
                out.update(bench_loader_vs_train(cfg, work, args))
            if "processes" in only and "processes" in sections:
                out["processes"] = bench_processes(
                    cfg.data, work, args.processes, args.repeats, args.scale, args.config
                )
            if "rss" in only and "rss" in sections:
                out["rss"] = bench_rss(args.config, cfg.data, work, args.rss_scale)
            finish_provenance(prov)
            keys = [k for k in (*sections, "train_step", "loader_over_train") if k in out]
            part = {k: out[k] for k in keys}
            md = data_markdown(part, prov) if name == "data" else result_markdown(part, prov)
            res = write_result(name, {**part, "provenance": prov}, md, args.out / name if args.out else None)
            print(f"wrote {res}/result.json and result.md")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def print_prepare(p: dict[str, Any], repeats: int) -> None:
    print(
        f"prepare: {p['tokens']:,} tokens; end to end {p['end_to_end_seconds']:.2f} s "
        f"(tokenizer training {p['tokenizer_train_seconds']:.2f} s)"
    )
    print(
        f"prepare {p['prepare_tokens_per_s'] / 1e6:.3f} M tok/s vs raw encode_batch "
        f"{p['raw_encode_batch_tokens_per_s'] / 1e6:.3f} M tok/s (medians of {repeats}): "
        f"ratio {p['prepare_over_raw']:.2f} (target >= 0.9); paired median "
        f"{p['prepare_over_raw_paired_median']:.2f}; per CPU-second {p['prepare_over_raw_cpu']:.2f}"
    )


def bench_loader_vs_train(cfg: Any, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Section 4: the loader's tokens/s against a tiny-model training step's (measured or assumed)."""
    if not (work / "full" / "index.json").is_file():
        prepare_data(cfg.data, work / "full", progress=False)
    loader = bench_loader(work / "full", cfg.train.micro_batch, args.repeats, args.loader_batches)
    vocab = json.loads((work / "full" / "index.json").read_text())["vocab_size"]
    if args.assume_train_tps:
        train = {"tokens_per_s": args.assume_train_tps, "assumed": True}
    else:
        train = bench_train_step(cfg, vocab, args.train_steps)
    lt, tt = loader["tokens_per_s"], train["tokens_per_s"]
    how = "assumed" if args.assume_train_tps else f"measured, {train['step_seconds']:.3f} s/step"
    print(
        f"loader {lt / 1e6:.2f} M tok/s (first batch {loader['first_batch_seconds'] * 1e3:.0f} ms) vs "
        f"tiny-model training {tt:,.0f} tok/s ({how}): ratio {lt / tt:,.0f}x (target >= 10x)"
    )
    return {"loader": loader, "train_step": train, "loader_over_train": lt / tt}


def data_markdown(out: dict[str, Any], prov: dict[str, Any]) -> str:
    """The markdown of the `data` result: end-to-end prepare vs raw encode_batch, loader vs training."""
    from bench.results import provenance_md

    lines = [
        "# Data: prepare against raw encode_batch, loader against a training step",
        "",
        provenance_md(prov),
    ]
    if "prepare" in out:
        p = out["prepare"]
        n = len(p["raw_runs"])
        lines += [
            "",
            f"End-to-end prepare of the default corpus: {p['tokens']:,} tokens in "
            f"{p['end_to_end_seconds']:.1f} s, tokenizer training ({p['tokenizer_train_seconds']:.2f} s) "
            "included. Then prepare_data with that tokenizer "
            + (
                f"(train, validation and the extra validation splits {', '.join(p['extra_validation'])}: "
                f"{p['tokens']:,} tokens) against raw `tokenizers.encode_batch` on the {p['documents']:,} "
                f"train and validation documents only ({p['raw_tokens']:,} tokens)"
                if p.get("extra_validation")
                else f"against raw `tokenizers.encode_batch` on the same {p['documents']:,} documents"
            )
            + f" in the same batches, in tokens/s, alternating runs, medians of {n}:",
            "",
            "| prepare M tok/s | raw encode_batch M tok/s | ratio | paired ratio | ratio per CPU-second |",
            "|---|---|---|---|---|",
            f"| {p['prepare_tokens_per_s'] / 1e6:.2f} | {p['raw_encode_batch_tokens_per_s'] / 1e6:.2f} | "
            f"{p['prepare_over_raw']:.2f} | {p['prepare_over_raw_paired_median']:.2f} | "
            f"{p['prepare_over_raw_cpu']:.2f} |",
        ]
    if "loader" in out:
        ld, tr = out["loader"], out["train_step"]
        how = (
            "assumed (--assume-train-tps)"
            if tr.get("assumed")
            else f"measured: micro batch {tr['micro_batch']} x {tr['seq_len']}, median "
            f"{tr['step_seconds']:.3f} s per step"
        )
        lines += [
            "",
            "ShardLoader over the train split (input positions per second, median of "
            f"{len(ld['runs'])} runs; first batch {ld['first_batch_seconds'] * 1e3:.0f} ms) against what one "
            f"tiny-model training step consumes ({how}):",
            "",
            "| loader tokens/s | training step tokens/s | loader / training |",
            "|---|---|---|",
            f"| {ld['tokens_per_s']:,.0f} | {tr['tokens_per_s']:,.0f} | {out['loader_over_train']:,.0f}x |",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
