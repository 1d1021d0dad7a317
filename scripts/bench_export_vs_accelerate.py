"""Benchmark: ``reshard export`` beside ``accelerate merge-weights`` on the same Accelerate checkpoints.

Issue 17 asks that the export benchmark run HF Accelerate's own consolidation on the same
checkpoint in the same run and report time and peak RSS side by side, and it claims that
reshard's export is byte-identical where both run, uses less memory, and also handles full
training checkpoints "which accelerate refuses". This script measures all three claims
instead of repeating them.

Checkpoints (written by accelerate's own code, not imitated): for each size in ``--sizes``
(MiB of float32 weights, default ``64,256,1024``) a Llama with torchtitan 0.3.0's parameter
names and shapes (``tok_embeddings``, ``layers.N.attention.qkv_linear.wq/wk/wv``,
``attention.wo``, ``feed_forward.w1/w2/w3``, the RMSNorm weights, ``norm``, ``lm_head``; dim
``--dim`` 1024 = 16 heads of 64 and 4 key/value heads, SwiGLU hidden 2,816, vocabulary
``--vocab`` 4,096; the layer count makes up the size) is sharded with FSDP2 ``fully_shard``
(each layer, then the root) on ``--world-size`` gloo ranks (default 2, under
``torch.distributed.run``) and saved with ``accelerate.utils.fsdp_utils.save_fsdp_model`` and
the ``FullyShardedDataParallelPlugin`` of ``tests/writers/accelerate_run.py``
(``fsdp_version=2``, ``SHARDED_STATE_DICT``): the ``pytorch_model_fsdp_0/`` folder that
``accelerator.save_state`` writes under FSDP (that file's docstring says why
``accelerator.prepare`` cannot apply FSDP on CPU). The smallest size is also trained one
Adam step and saved as a *full training checkpoint*: the whole ``save_state`` folder
(``save_fsdp_optimizer``'s ``optimizer_0/``, ``scheduler.bin`` and the RNG files from
``save_accelerator_state``) and, beside it, one DCP checkpoint of model and optimizer
together (``dcp.save({"model": get_model_state_dict, "optimizer": get_optimizer_state_dict})``,
the layout of Lightning Fabric and of torch's own recipe).

Measured, each command in a fresh process (wall time, and peak RSS = ``ru_maxrss`` of
``os.wait4`` on that pid, which includes its waited-for children; the helper is
``scripts/bench_convert_memory.py``'s ``measure``), on the model folder of every size::

    sh -c 'cp -r SRC COPY && sync'                  # the same bytes copied durably, for scale
    accelerate merge-weights SRC OUT                # accelerate's CLI (merge_fsdp_weights)
    python -m reshard export SRC OUT                # --format safetensors (the default)
    python -m reshard export SRC OUT --format hf    # only when `reshard export --help` offers it

then both outputs are opened with ``safetensors.safe_open`` and compared tensor by tensor:
same names (accelerate drops the single top-level ``model`` key, reshard the ``model.``
prefix, so both name a tensor by its FQN), same dtype and shape, same bytes. The ``hf``
export is compared with accelerate's output mapped independently (``HF_NAMES`` here, written
from transformers' Llama, not read from ``formats/hf/``; wq/wk rows reordered from
torchtitan's interleaved rotary pairs to HF's ``rotate_half`` halves per head), so it checks
reshard's names and transforms as well as its bytes; its ``--model-config`` gives the head
counts and torchtitan's llama3 RoPE/norm defaults. Comparisons run in child processes: this
process never imports torch, because a child's ``ru_maxrss`` starts at its parent's peak
(fork or vfork, then exec), which would put a floor under every figure. Start-up is measured
once for each tool: ``accelerate merge-weights --help`` and a process that only imports
torch, safetensors and reshard's export.

Differences in what the commands do, which the times include: ``reshard export`` fsyncs its
output, publishes it atomically and reads every tensor back to compare it with the source
before committing; ``merge-weights`` loads the whole state dict (``_load_state_dict`` with an
empty planner) and writes one ``model.safetensors`` with ``safetensors.torch.save_file``,
without fsync. The checkpoints were just written, so every command reads them from the page
cache (warm cache).

Full training checkpoint (smallest size): ``accelerate merge-weights`` (and with
``--unsafe_serialization``) and ``reshard export`` (``--only model`` and
``--only model+optim``) on the ``save_state`` folder, its ``optimizer_0/`` folder and the
combined checkpoint; each attempt's exit code, the last line of its error, and whether it
left anything at the destination are reported as they are, whichever tool they favour.

Usage::

    .venv/bin/python scripts/bench_export_vs_accelerate.py                     # 64, 256, 1024 MiB
    .venv/bin/python scripts/bench_export_vs_accelerate.py --sizes 32,128 --runs 2 --no-full
    .venv/bin/python scripts/bench_export_vs_accelerate.py --json-out /tmp/r.json --keep

Outputs (``--out``, default ``bench-results/``): ``bench_export_vs_accelerate.md`` (also
printed) and ``bench_export_vs_accelerate.json``; ``--json-out PATH`` writes the JSON there
too. Exit 2 if a checkpoint could not be written or a measured export of the model folder
failed, 1 if both exports ran and their tensors differ, else 0. The attempts on full
training checkpoints are findings, not failures.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert_memory import MIB, dir_bytes, machine, measure  # noqa: E402

NAME = "bench_export_vs_accelerate"
MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate's FSDP_MODEL_NAME + "_0"
OPTIM_DIR = "optimizer_0"


# ------------------------------------------------------------------------- the writer (under torchrun)
def worker_write(argv: list[str]) -> None:
    """Runs on every rank: build the model, shard it, save it with accelerate's own functions.

    Importing ``plugin`` from tests/writers/accelerate_run.py keeps this checkpoint's plugin the
    one the interop tests load back with accelerate's ``load_fsdp_model``.
    """
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--layout", required=True, help="Layout as JSON")
    ap.add_argument("--full", default=None, help="also write a combined model+optimizer DCP here (and train 1 step)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests" / "writers"))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from accelerate import Accelerator
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
    from accelerate_run import plugin

    class Block(nn.Module):
        """One layer; its own forward, so the FSDP unit it is unshards its parameters around it."""

        def __init__(self, L: Layout) -> None:
            super().__init__()
            d, hd = L.dim, L.head_dim
            self.attention = nn.Module()
            self.attention.qkv_linear = nn.Module()
            self.attention.qkv_linear.wq = nn.Linear(d, L.n_heads * hd, bias=False)
            self.attention.qkv_linear.wk = nn.Linear(d, L.n_kv_heads * hd, bias=False)
            self.attention.qkv_linear.wv = nn.Linear(d, L.n_kv_heads * hd, bias=False)
            self.attention.wo = nn.Linear(L.n_heads * hd, d, bias=False)
            self.feed_forward = nn.Module()
            self.feed_forward.w1 = nn.Linear(d, L.ffn_hidden, bias=False)
            self.feed_forward.w2 = nn.Linear(L.ffn_hidden, d, bias=False)
            self.feed_forward.w3 = nn.Linear(d, L.ffn_hidden, bias=False)
            self.attention_norm = nn.RMSNorm(d)
            self.ffn_norm = nn.RMSNorm(d)
            self.rep = L.n_heads // L.n_kv_heads

        def forward(self, h):
            """Touches every parameter (so Adam has moments for each): differentiable, not attention."""
            a, qkv = self.attention_norm(h), self.attention.qkv_linear
            h = h + self.attention.wo(torch.tanh(qkv.wq(a)) * qkv.wk(a).repeat(1, self.rep) * qkv.wv(a).repeat(1, self.rep))
            f, ff = self.ffn_norm(h), self.feed_forward
            return h + ff.w2(nn.functional.silu(ff.w1(f)) * ff.w3(f))

    class Llama(nn.Module):
        """torchtitan 0.3.0's Llama parameter names and shapes (its own model is not needed for the bytes)."""

        def __init__(self, L: Layout) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(L.vocab, L.dim)
            self.layers = nn.ModuleList(Block(L) for _ in range(L.layers))
            self.norm = nn.RMSNorm(L.dim)
            self.lm_head = nn.Linear(L.dim, L.vocab, bias=False)

        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h)
            return self.lm_head(self.norm(h))

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    L = Layout(**json.loads(a.layout))
    model = Llama(L)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    fsdp = plugin()
    if a.full:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda s: 1.0 / (1 + s))
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
        gen = torch.Generator().manual_seed(100 + accelerator.process_index)
        accelerator.backward(model(torch.randint(0, L.vocab, (4,), generator=gen)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        raw = getattr(optimizer, "optimizer", optimizer)
        save_fsdp_model(fsdp, accelerator, model, str(out))
        save_fsdp_optimizer(fsdp, accelerator, raw, model, str(out))
        save_accelerator_state(str(out), [], [], [scheduler], [], accelerator.process_index, step=1)
        dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, raw)},
                 checkpoint_id=a.full)
    else:
        save_fsdp_model(fsdp, accelerator, model, str(out))
    accelerator.wait_for_everyone()
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class Layout:
    """A Llama's sizes (float32). The layer count is what makes up the requested size."""

    dim: int
    layers: int
    vocab: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def tensors(self) -> dict[str, tuple[int, ...]]:
        d, hd, f = self.dim, self.head_dim, self.ffn_hidden
        out: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (self.vocab, d)}
        for i in range(self.layers):
            p = f"layers.{i}."
            out.update({p + "attention.qkv_linear.wq.weight": (self.n_heads * hd, d),
                        p + "attention.qkv_linear.wk.weight": (self.n_kv_heads * hd, d),
                        p + "attention.qkv_linear.wv.weight": (self.n_kv_heads * hd, d),
                        p + "attention.wo.weight": (d, self.n_heads * hd),
                        p + "feed_forward.w1.weight": (f, d), p + "feed_forward.w2.weight": (d, f),
                        p + "feed_forward.w3.weight": (f, d),
                        p + "attention_norm.weight": (d,), p + "ffn_norm.weight": (d,)})
        out.update({"norm.weight": (d,), "lm_head.weight": (self.vocab, d)})
        return out

    def nbytes(self) -> int:
        return 4 * sum(math.prod(s) for s in self.tensors().values())

    def hf_config(self) -> list[str]:
        """--model-config values for --format hf: what a checkpoint cannot hold (torchtitan llama3 defaults)."""
        return [f"n_heads={self.n_heads}", f"n_kv_heads={self.n_kv_heads}", "rms_norm_eps=1e-5",
                "rope_theta=500000", "rope_scaling_factor=8"]


def layout(size_mib: float, dim: int, vocab: int) -> Layout:
    """Llama sizes of about size_mib MiB: head_dim 64 (dim >= 512), 4 query heads per key/value head,
    SwiGLU hidden ~8/3 dim rounded up to 256 (torchtitan's rule), as many layers as fill the size."""
    n_heads = max(1, dim // 64)
    n_kv = max(1, n_heads // 4)
    ffn = -(-int(8 * dim / 3) // 256) * 256
    one = Layout(dim, 1, vocab, n_heads, n_kv, ffn)
    fixed = 4 * 2 * (vocab * dim) + 4 * dim
    per_layer = one.nbytes() - fixed
    layers = max(1, round((size_mib * MIB - fixed) / per_layer))
    return Layout(dim, layers, vocab, n_heads, n_kv, ffn)


def write_checkpoint(args, size_mib: float, root: Path, log_dir: Path, full: bool) -> dict:
    L = layout(size_mib, args.dim, args.vocab)
    cmd = [args.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world_size}",
           str(Path(__file__).resolve()), "_write", str(root), "--layout", json.dumps(asdict(L))]
    if full:
        cmd += ["--full", str(root.parent / f"{root.name}-combined")]
    tag = root.name
    t0 = time.perf_counter()
    with open(log_dir / f"write-{tag}.log", "wb") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    info = {"layout": asdict(L), "tensors": len(L.tensors()), "write_s": round(time.perf_counter() - t0, 2),
            "exit_code": p.returncode, "full": full}
    if p.returncode != 0:
        info["log_tail"] = (log_dir / f"write-{tag}.log").read_text(errors="replace")[-2000:]
        return info
    info["model_bytes_on_disk"] = dir_bytes(root / MODEL_DIR)
    info["weight_bytes"] = L.nbytes()
    info["largest_tensor_bytes"] = 4 * max(math.prod(s) for s in L.tensors().values())
    if full:
        info["save_state_files"] = sorted(p.name for p in root.iterdir())
        info["combined_bytes_on_disk"] = dir_bytes(root.parent / f"{root.name}-combined")
    return info


# ------------------------------------------------------------------------- the commands
def accelerate_cmd(args, src: Path, dst: Path, *extra: str) -> list[str]:
    """accelerate's console script beside this interpreter, else the module it runs."""
    exe = Path(args.python).parent / "accelerate"
    head = [str(exe)] if exe.exists() else [args.python, "-m", "accelerate.commands.accelerate_cli"]
    return head + ["merge-weights", *extra, str(src), str(dst)]


def reshard_cmd(args, src: Path, dst: Path, *extra: str) -> list[str]:
    return [args.python, "-m", "reshard", "export", str(src), str(dst), *extra]


def reshard_formats(args) -> dict:
    """Which --format values `reshard export --help` offers: hf is being built alongside this script."""
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb")
    p = subprocess.run([args.python, "-m", "reshard", "export", "--help"], capture_output=True, text=True, env=env,
                       timeout=300)
    text = p.stdout + p.stderr
    m = re.search(r"--format\s+\S*\s+(.*?)(?:\n\s*[│|]?\s*--|\Z)", text, re.S)
    described = " ".join(m.group(1).split()) if m else ""
    return {"hf": bool(re.search(r"\bhf\b", described or text)), "format_help": described.replace("│", "").strip()}


def last_error(r: dict, tmp: Path | None = None) -> str:
    text = (r.get("stderr_tail") or "").replace(f"{tmp}/", "") if tmp else (r.get("stderr_tail") or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.match(r"^(error|[A-Za-z_.]*(Error|Exception))\b", ln)]
    return (errs[-1] if errs else lines[-1] if lines else "")[:400]


def listing(d: Path) -> list[list]:
    return sorted([[str(p.relative_to(d)), p.stat().st_size] for p in d.rglob("*") if p.is_file()]) if d.is_dir() else []


def run(args, name: str, cmd: list[str], dst: Path, log_dir: Path, runs: int) -> dict:
    """Run `cmd` `runs` times (dst removed before each); medians of wall and peak RSS."""
    rs = []
    for i in range(runs):
        shutil.rmtree(dst, ignore_errors=True)
        r = measure(cmd, timeout=args.timeout, sample_ms=args.sample_ms, log_dir=log_dir, name=f"{name}-{i}")
        r.pop("samples", None)
        r.pop("stdout", None)
        rs.append(r)
        print(f"  {name} run {i + 1}/{runs}: {r['wall_s']:.2f} s, peak RSS {r['peak_rss_mib']:,.0f} MiB "
              f"(exit {r['exit_code']})", file=sys.stderr, flush=True)
        if r["exit_code"] != 0:
            break
    out = dict(rs[-1])
    out["runs_wall_s"] = [r["wall_s"] for r in rs]
    out["runs_peak_rss_mib"] = [r["peak_rss_mib"] for r in rs]
    if all(r["exit_code"] == 0 for r in rs):
        out["wall_s"] = statistics.median(out["runs_wall_s"])
        out["peak_rss_mib"] = statistics.median(out["runs_peak_rss_mib"])
        out["written_bytes"] = dir_bytes(dst) if dst.is_dir() else 0
    else:
        out["error"] = last_error(out, dst.parent)
    out["files"] = listing(dst)
    return out


# ------------------------------------------------------------------------- comparing the outputs
# HF Llama's names for torchtitan's (transformers' modeling_llama.py), written down here independently of
# formats/hf/ so that the comparison checks reshard's mapping instead of reusing it.
HF_NAMES = [(r"tok_embeddings\.weight", "model.embed_tokens.weight"),
            (r"layers\.(\d+)\.attention\.qkv_linear\.wq\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
            (r"layers\.(\d+)\.attention\.qkv_linear\.wk\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
            (r"layers\.(\d+)\.attention\.qkv_linear\.wv\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
            (r"layers\.(\d+)\.attention\.wo\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
            (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
            (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
            (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
            (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
            (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
            (r"norm\.weight", "model.norm.weight"), (r"lm_head\.weight", "lm_head.weight")]


def hf_name(name: str) -> str | None:
    for pat, repl in HF_NAMES:
        if re.fullmatch(pat, name):
            return re.sub(pat, repl, name)
    return None


def rotary_heads(name: str, L: Layout) -> int:
    """Heads whose rows an HF export reorders (wq: query heads, wk: key/value heads), else 0."""
    return L.n_heads if name.endswith(".wq.weight") else L.n_kv_heads if name.endswith(".wk.weight") else 0


def to_rotate_half(t, heads: int):
    """torchtitan's interleaved rotary pairs to HF's rotate_half halves: within each head, row 2j+p -> p*hd/2 + j."""
    rows, cols = t.shape
    return t.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def compare_outputs(a: Path, b: Path, hf: Layout | None = None) -> dict:
    """Tensor-by-tensor comparison of two safetensors directories: names, dtype, shape, bytes.

    ``a`` is accelerate's merge. With ``hf`` (the checkpoint's Layout) each of its tensors is first
    renamed to HF Llama's name and wq/wk reordered as an HF export must hold them. Runs in a child
    process (``_compare``): the measuring process must not import torch, because a child's
    ``ru_maxrss`` starts at its parent's peak (fork/vfork, then exec), a floor under every figure.
    """
    import torch
    from safetensors import safe_open

    with ExitStack() as stack:
        def index(d: Path) -> dict:
            ix = {}
            for f in sorted(d.glob("*.safetensors")):
                h = stack.enter_context(safe_open(str(f), framework="pt"))
                for k in h.keys():
                    ix[k] = h
            return ix

        ia, ib = index(a), index(b)
        target = {k: (hf_name(k) if hf else k) for k in ia}
        unmapped = sorted(k for k, v in target.items() if v is None)
        only_a = sorted(k for k, v in target.items() if v is not None and v not in ib)
        only_b = sorted(set(ib) - set(target.values()))
        differ, compared, compared_bytes, reordered = [], 0, 0, 0
        for k in sorted(ia):
            new = target[k]
            if new is None or new not in ib:
                continue
            ta, tb = ia[k].get_tensor(k), ib[new].get_tensor(new)
            heads = rotary_heads(k, hf) if hf else 0
            if heads and ta.dim() == 2:
                ta = to_rotate_half(ta, heads)
                reordered += 1
            compared += 1
            if ta.dtype != tb.dtype or ta.shape != tb.shape:
                differ.append(f"{k}: {ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)}")
                continue
            ua = ta.contiguous().reshape(-1).view(torch.uint8)
            ub = tb.contiguous().reshape(-1).view(torch.uint8)
            compared_bytes += ua.numel()
            if not torch.equal(ua, ub):
                differ.append(f"{k}: bytes differ")
    return {"tensors_a": len(ia), "tensors_b": len(ib), "compared": compared, "compared_bytes": compared_bytes,
            "rows_reordered": reordered, "unmapped": unmapped[:20], "n_unmapped": len(unmapped),
            "only_in_a": only_a[:20], "only_in_b": only_b[:20], "n_only_in_a": len(only_a), "n_only_in_b": len(only_b),
            "differ": differ[:20], "n_differ": len(differ),
            "identical": compared > 0 and not unmapped and not only_a and not only_b and not differ}


def compare(args, a: Path, b: Path, hf: Layout | None = None) -> dict:
    """`compare_outputs` in a child process (see there why)."""
    cmd = [args.python, str(Path(__file__).resolve()), "_compare", str(a), str(b)]
    if hf is not None:
        cmd += ["--hf", json.dumps(asdict(hf))]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        return {"identical": False, "error": p.stderr.strip()[-600:], "compared": 0, "n_differ": 0, "n_only_in_a": 0,
                "n_only_in_b": 0, "n_unmapped": 0, "differ": [], "only_in_a": [], "only_in_b": [], "unmapped": []}
    return json.loads(p.stdout)


def pickle_keys(path: Path) -> list[str]:
    """Top-level keys of accelerate's `--unsafe_serialization` output (our own file; weights_only, no code run)."""
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return [f"unreadable with weights_only: {type(e).__name__}"]
    return [str(k) for k in obj][:10] if isinstance(obj, dict) else [type(obj).__name__]


def child_main(argv: list[str]) -> int:
    """The helper modes, each run in a child process: _write (under torchrun), _compare, _pickle_keys."""
    mode, rest = argv[0], argv[1:]
    if mode == "_write":
        worker_write(rest)
    elif mode == "_compare":
        ap = argparse.ArgumentParser()
        ap.add_argument("a")
        ap.add_argument("b")
        ap.add_argument("--hf", default=None)
        c = ap.parse_args(rest)
        print(json.dumps(compare_outputs(Path(c.a), Path(c.b), Layout(**json.loads(c.hf)) if c.hf else None)))
    elif mode == "_pickle_keys":
        print(json.dumps(pickle_keys(Path(rest[0]))))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


def code(text: str) -> str:
    """A Markdown code span that survives backticks inside the text (error messages quote names so)."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def ident_text(c: dict | None) -> str:
    if not c:
        return "-"
    if c["identical"]:
        how = (f"; names mapped to HF Llama's, wq/wk of {c['rows_reordered']} tensors reordered to rotate_half first"
               if c.get("rows_reordered") else "")
        return f"yes ({c['compared']} tensors, {c['compared_bytes'] / MIB:,.1f} MiB bitwise{how})"
    parts = []
    if c.get("error"):
        parts.append("comparison failed: " + code(c["error"].splitlines()[-1]))
    if c.get("n_unmapped"):
        parts.append(f"{c['n_unmapped']} of accelerate's names have no HF name here, e.g. `{c['unmapped'][0]}`")
    if c["n_differ"]:
        parts.append(f"{c['n_differ']} differ, e.g. `{c['differ'][0]}`")
    if c["n_only_in_a"]:
        parts.append(f"{c['n_only_in_a']} only in accelerate's, e.g. `{c['only_in_a'][0]}`")
    if c["n_only_in_b"]:
        parts.append(f"{c['n_only_in_b']} only in this one, e.g. `{c['only_in_b'][0]}`")
    return "**no**: " + "; ".join(parts or ["nothing to compare"])


# ------------------------------------------------------------------------- one size
def run_size(args, size_mib: float, tmp: Path, log_dir: Path, formats: dict, full: bool) -> dict:
    tag = f"{size_mib:g}mib"
    root = tmp / f"ckpt-{tag}"
    print(f"[{tag}] writing the Accelerate checkpoint{' (full training state)' if full else ''} ...",
          file=sys.stderr, flush=True)
    case = {"size_mib": size_mib, "checkpoint": write_checkpoint(args, size_mib, root, log_dir, full), "commands": {}}
    ck = case["checkpoint"]
    if ck["exit_code"] != 0:
        print(f"[{tag}] the writer failed (exit {ck['exit_code']}); see the JSON", file=sys.stderr, flush=True)
        return case
    src = root / MODEL_DIR
    print(f"[{tag}] {ck['tensors']} tensors, {ck['model_bytes_on_disk'] / MIB:,.0f} MiB on disk, written in "
          f"{ck['write_s']:.1f} s", file=sys.stderr, flush=True)
    outs = {k: tmp / f"out-{tag}-{k}" for k in ("cp_sync", "accelerate", "reshard", "reshard_hf")}
    cmds = {
        "cp_sync": ["sh", "-c", 'cp -r "$0" "$1" && sync', str(src), str(outs["cp_sync"])],
        "accelerate": accelerate_cmd(args, src, outs["accelerate"]),
        "reshard": reshard_cmd(args, src, outs["reshard"]),
    }
    L = Layout(**ck["layout"])
    if formats["hf"]:
        cfg = [x for v in L.hf_config() for x in ("--model-config", v)]
        cmds["reshard_hf"] = reshard_cmd(args, src, outs["reshard_hf"], "--format", "hf", *cfg)
    for k, cmd in cmds.items():
        case["commands"][k] = run(args, f"{k}-{tag}", cmd, outs[k], log_dir, 1 if k == "cp_sync" else args.runs)
    C = case["commands"]
    if C["accelerate"]["exit_code"] == 0:
        for k in ("reshard", "reshard_hf"):
            if k in C and C[k]["exit_code"] == 0:
                C[k]["vs_accelerate"] = compare(args, outs["accelerate"], outs[k], L if k == "reshard_hf" else None)
                acc = C["accelerate"]
                C[k]["time_ratio"] = round(C[k]["wall_s"] / acc["wall_s"], 3)
                C[k]["rss_ratio"] = round(C[k]["peak_rss_mib"] / acc["peak_rss_mib"], 3)
    if full:
        case["full_training"] = full_training(args, root, tmp, log_dir, outs["accelerate"])
    if not args.keep:
        for d in list(outs.values()) + [root, tmp / f"{root.name}-combined"]:
            shutil.rmtree(d, ignore_errors=True)
    return case


def full_training(args, root: Path, tmp: Path, log_dir: Path, acc_model_out: Path) -> list[dict]:
    """Each tool on the full training checkpoints; outcomes recorded, not judged by exit code alone."""
    combined = tmp / f"{root.name}-combined"
    attempts = [
        ("save_state folder", "accelerate", root, []),
        ("save_state folder", "reshard", root, []),
        (f"`{OPTIM_DIR}/`", "accelerate", root / OPTIM_DIR, []),
        (f"`{OPTIM_DIR}/`", "accelerate", root / OPTIM_DIR, ["--unsafe_serialization"]),
        (f"`{OPTIM_DIR}/`", "reshard", root / OPTIM_DIR, []),
        (f"`{OPTIM_DIR}/`", "reshard", root / OPTIM_DIR, ["--only", "model+optim"]),
        ("one DCP, model + optimizer", "accelerate", combined, []),
        ("one DCP, model + optimizer", "accelerate", combined, ["--unsafe_serialization"]),
        ("one DCP, model + optimizer", "reshard", combined, []),
        ("one DCP, model + optimizer", "reshard", combined, ["--only", "model+optim"]),
    ]
    results = []
    print("[full training checkpoint] attempts ...", file=sys.stderr, flush=True)
    for i, (what, tool, src, extra) in enumerate(attempts):
        dst = tmp / f"full-{i}"
        shutil.rmtree(dst, ignore_errors=True)
        cmd = accelerate_cmd(args, src, dst, *extra) if tool == "accelerate" else reshard_cmd(args, src, dst, *extra)
        r = measure(cmd, timeout=args.timeout, sample_ms=args.sample_ms, log_dir=log_dir, name=f"full-{i}")
        short = (["accelerate", "merge-weights", *extra] if tool == "accelerate" else ["reshard", "export", *extra])
        res = {"input": what, "tool": tool, "argv": short, "exit_code": r["exit_code"], "wall_s": r["wall_s"],
               "peak_rss_mib": r["peak_rss_mib"], "files": listing(dst), "dst_exists": dst.exists(),
               "error": last_error(r, tmp) if r["exit_code"] != 0 else ""}
        st = [f for f, _ in res["files"] if f.endswith(".safetensors")]
        if r["exit_code"] == 0 and st and acc_model_out.is_dir():
            c = compare(args, acc_model_out, dst)
            # model tensors compared with accelerate's merge of the model folder; optim.* are extra
            c["model_tensors_equal"] = c["compared"] > 0 and not c["n_differ"] and not c["n_only_in_a"]
            res["vs_accelerate_model"] = c
        pickles = [dst / f for f, _ in res["files"] if f.endswith(".bin")]
        if r["exit_code"] == 0 and pickles:
            p = subprocess.run([args.python, str(Path(__file__).resolve()), "_pickle_keys", str(pickles[0])],
                               capture_output=True, text=True, timeout=args.timeout)
            res["pickle_top_keys"] = json.loads(p.stdout) if p.returncode == 0 else [f"unreadable: {p.stderr[-200:]}"]
        results.append(res)
        print(f"  {tool} {' '.join(extra)} on {what}: exit {r['exit_code']} {res['error'][:120]}", file=sys.stderr,
              flush=True)
        if not args.keep:
            shutil.rmtree(dst, ignore_errors=True)
    return results


# ------------------------------------------------------------------------- report
def render_markdown(result: dict) -> str:
    m = result["machine"]
    fm = result["reshard_formats"]
    lay = next((c["checkpoint"]["layout"] for c in result["cases"] if "layout" in c["checkpoint"]), {})
    lines = [
        "# reshard export vs `accelerate merge-weights`: time, peak RSS, bytes", "",
        f"Checkpoints written by accelerate {result['accelerate']}'s own `save_fsdp_model` (FSDP2 `fully_shard`, "
        f"`SHARDED_STATE_DICT`, {result['world_size']} gloo ranks): the `{MODEL_DIR}/` folder of "
        f"`accelerator.save_state`, of a float32 Llama with torchtitan 0.3.0's parameter names (dim {result['dim']}, "
        f"vocabulary {result['vocab']:,}, {lay.get('n_heads', '?')} heads of {result['dim'] // lay.get('n_heads', 1)}, "
        f"{lay.get('n_kv_heads', '?')} "
        f"key/value heads, SwiGLU hidden {lay.get('ffn_hidden', '?')}; the layer count sets the size). "
        f"Each command in a fresh process, warm cache, median of {result['runs']} run(s) (`cp -r && sync`: 1); "
        "peak RSS = `ru_maxrss` of that process. \"x accelerate\" = reshard / accelerate. \"Identical\" = every "
        "tensor of both outputs has the same name, dtype, shape and bytes (`safe_open`).", "",
        "| checkpoint | tensors | command | wall (s) | CPU (s) | peak RSS (MiB) | x accelerate (time) "
        "| x accelerate (RSS) | identical to accelerate's |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    labels = {"cp_sync": "`cp -r && sync`", "accelerate": "`accelerate merge-weights`",
              "reshard": "`reshard export`", "reshard_hf": "`reshard export --format hf`"}
    for c in result["cases"]:
        ck = c["checkpoint"]
        size = (f"{ck['model_bytes_on_disk'] / MIB:,.0f} MiB" if ck.get("exit_code") == 0 else f"{c['size_mib']:g} MiB")
        if ck.get("exit_code") != 0:
            lines.append(f"| {size} | - | writer | failed (exit {ck.get('exit_code')}) | | | | | |")
            continue
        for k, r in c["commands"].items():
            ok = r["exit_code"] == 0
            wall = f"{r['wall_s']:.2f}" if ok else f"exit {r['exit_code']}"
            rss = f"{r['peak_rss_mib']:,.0f}" if ok and k != "cp_sync" else "-"
            tr = f"{r['time_ratio']:.2f}" if "time_ratio" in r else "-"
            rr = f"{r['rss_ratio']:.2f}" if "rss_ratio" in r else "-"
            ident = ident_text(r.get("vs_accelerate")) if ok else "refused: " + code(r.get("error", "")[:160])
            cpu = f"{r['user_s'] + r['sys_s']:.2f}" if ok else "-"
            lines.append(f"| {size} | {ck['tensors']} | {labels[k]} | {wall} | {cpu} | {rss} | {tr} | {rr} | {ident} |")
    b = result.get("baselines") or {}
    if b:
        what = {"accelerate": "`accelerate merge-weights --help` (its CLI start-up: imports torch and accelerate)",
                "reshard": "a process that only imports torch, safetensors and reshard's export"}
        lines += ["", "Start-up alone: " + "; ".join(f"{what[k]} {v['wall_s']:.2f} s, {v['peak_rss_mib']:,.0f} MiB"
                                                for k, v in b.items() if v.get("exit_code") == 0) + ". "
                  "`cp` has no peak-RSS figure: `ru_maxrss` of a forked child keeps the forking Python's pages."]
    lines.append("CPU = user + system time of the process and its waited-for children. What the times include: "
                 "`reshard export` writes its output into a temporary directory, fsyncs it, reads every tensor "
                 "back and compares it with the source (read a second time), then renames it into place; "
                 "`merge-weights` loads the whole state dict, writes one `model.safetensors` and does not fsync. "
                 "Warm cache: the checkpoints were just written.")
    lines.append("`reshard export --format hf`: " + ("measured above, with `--model-config` "
                 + " ".join(f"`{v}`" for v in Layout(**lay).hf_config()) + "." if fm["hf"] and lay else
                 f"not offered by this reshard (`--format`: {fm['format_help'] or 'no description found'}), "
                 "so not measured."))
    full = next((c for c in result["cases"] if c.get("full_training")), None)
    if full:
        lines += ["", f"### Full training checkpoint ({full['checkpoint']['model_bytes_on_disk'] / MIB:,.0f} MiB of "
                  "weights, 1 Adam step)", "",
                  "`save_state` folder = `pytorch_model_fsdp_0/`, `optimizer_0/`, `scheduler.bin`, `random_states_*.pkl`, "
                  "as `accelerator.save_state` writes them under FSDP. One DCP = `dcp.save({\"model\": ..., "
                  "\"optimizer\": ...})` of the same state (Lightning Fabric's layout; torchtitan keeps model keys at the "
                  "top level instead).", "",
                  "| input | command | exit | wall (s) | peak RSS (MiB) | outcome |", "|---|---|---:|---:|---:|---|"]
        for a in full["full_training"]:
            if a["exit_code"] == 0:
                files = ", ".join(f"`{f}` ({s / MIB:,.1f} MiB)" for f, s in a["files"] if not f.endswith(".json"))
                out = f"wrote {files}"
                v = a.get("vs_accelerate_model")
                if a.get("pickle_top_keys"):
                    out += " (a pickle, top-level keys " + ", ".join(f"`{k}`" for k in a["pickle_top_keys"]) + ")"
                if v and not v["compared"]:
                    out += f"; no weights in it, {v['n_only_in_b']} optimizer tensors"
                elif v:
                    extra = v["n_only_in_b"]
                    out += ("; model tensors bitwise equal to accelerate's merge of the model folder"
                            if v["model_tensors_equal"] else "; model tensors NOT equal to accelerate's merge")
                    out += f" (+{extra} optimizer tensors)" if extra else ""
            else:
                out = code(a["error"][:220])
                if a["dst_exists"]:
                    out += "; left " + ("an empty" if not a["files"] else "a partial") + " output directory"
            lines.append(f"| {a['input']} | `{' '.join(a['argv'])}` | {a['exit_code']} | {a['wall_s']:.2f} "
                         f"| {a['peak_rss_mib']:,.0f} | {out} |")
    lines += ["", f"Machine: {m['nproc']} CPUs, {m.get('mem_total_gib', '?')} GiB RAM, Python {m['python']}, "
              f"torch {m['torch']}, accelerate {result['accelerate']}, reshard {m.get('reshard')} at `{result['commit']}`; "
              f"load average {result['loadavg_start']:.2f} at the start, {m.get('loadavg', [float('nan')])[0]:.2f} "
              "at the end. Checkpoint writes: "
              + ", ".join(f"{c['size_mib']:g} MiB {c['checkpoint']['write_s']:.0f} s" for c in result["cases"]) + "."]
    return "\n".join(lines) + "\n"


def summary(cases: list[dict]) -> dict:
    rows = []
    for c in cases:
        r = (c.get("commands") or {}).get("reshard") or {}
        if "time_ratio" in r:
            rows.append({"size_mib": c["size_mib"], "time_ratio": r["time_ratio"], "rss_ratio": r["rss_ratio"],
                         "identical": r["vs_accelerate"]["identical"],
                         "accelerate_rss_mib": c["commands"]["accelerate"]["peak_rss_mib"],
                         "reshard_rss_mib": r["peak_rss_mib"]})
            h = c["commands"].get("reshard_hf") or {}
            if "time_ratio" in h:
                rows[-1].update({"hf_time_ratio": h["time_ratio"], "hf_rss_ratio": h["rss_ratio"],
                                 "hf_identical": h["vs_accelerate"]["identical"], "hf_rss_mib": h["peak_rss_mib"]})
            elif h:
                rows[-1]["hf_error"] = h.get("error") or f"exit {h.get('exit_code')}"
    return {"rows": rows, "all_identical": bool(rows) and all(x["identical"] and x.get("hf_identical", True)
                                                              for x in rows)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in ("_write", "_compare", "_pickle_keys"):
        return child_main(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--json-out", default=None, help="also write the JSON result here")
    ap.add_argument("--sizes", default="64,256,1024", help="MiB of float32 weights per checkpoint (default 64,256,1024)")
    ap.add_argument("--dim", type=int, default=1024, help="model dim (default 1024: 16 heads of 64, 4 kv heads)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary rows (default 4096: 16 MiB embedding)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1, help="runs of each export (median reported)")
    ap.add_argument("--no-full", action="store_true", help="skip the full-training-checkpoint attempts")
    ap.add_argument("--sample-ms", type=float, default=100.0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    sizes = sorted(float(s) for s in args.sizes.split(",") if s.strip())
    if not sizes:
        ap.error("--sizes needs at least one size")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # merge-weights needs no network; make sure it uses none
    t_start = time.perf_counter()
    loadavg_start = os.getloadavg()[0]
    formats = reshard_formats(args)
    tmp = Path(tempfile.mkdtemp(prefix="bench-export-vs-accelerate-", dir=args.tmp))
    log_dir = tmp / "logs"
    log_dir.mkdir()
    try:
        baselines = {}
        for k, cmd in (("accelerate", accelerate_cmd(args, Path("-"), Path("-"))[:-2] + ["--help"]),
                       ("reshard", [args.python, "-c", "import torch, safetensors, reshard.cli, reshard.commands.export"])):
            baselines[k] = measure(cmd, timeout=args.timeout, sample_ms=args.sample_ms, log_dir=log_dir,
                                   name=f"baseline-{k}")
            for f in ("samples", "stdout"):
                baselines[k].pop(f, None)
        cases = [run_size(args, s, tmp, log_dir, formats, full=(i == 0 and not args.no_full))
                 for i, s in enumerate(sizes)]
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}", file=sys.stderr)
    import accelerate

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    ok = all(c["checkpoint"].get("exit_code") == 0
             and all(c["commands"][k]["exit_code"] == 0 for k in ("cp_sync", "accelerate", "reshard")) for c in cases)
    result = {
        "benchmark": "export_vs_accelerate", "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.argv[0]).name, *argv], "commit": commit, "accelerate": accelerate.__version__,
        "sizes_mib": sizes, "dim": args.dim, "vocab": args.vocab, "world_size": args.world_size, "runs": args.runs,
        "reshard_formats": formats, "ok": ok, "summary": summary(cases), "baselines": baselines,
        "loadavg_start": loadavg_start, "total_s": round(time.perf_counter() - t_start, 1), "machine": machine(),
        "cases": cases,
    }
    md = render_markdown(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.md").write_text(md)
    text = json.dumps(result, indent=2) + "\n"
    (out / f"{NAME}.json").write_text(text)
    if args.json_out:
        Path(args.json_out).write_text(text)
    print(md)
    print(f"total {result['total_s']:.0f} s", file=sys.stderr)
    if not ok:
        return 2
    return 0 if result["summary"]["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
