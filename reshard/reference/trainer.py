"""Reference trainer: FSDP2 (+ optional TP) on CPU/gloo, saving DCP checkpoints + manifest.

It exists to produce real distributed checkpoints for ``reshard`` to inspect, convert and
verify, and to resume from them. Read top to bottom:

1. ``TrainConfig``          every knob (the CLI in ``__main__`` maps 1:1 onto it)
2. ``build``                mesh ([pp,] dp_shard[, tp]), model (or its pipeline stage), TP, FSDP2, AdamW, LambdaLR
3. ``state_for_save``       the checkpoint key layout (conventions "reshard" / "torchtitan")
4. ``load_checkpoint``      dcp.load + set_state_dict, sampler, counters, this rank's RNG
5. ``train``                the loop: elastic sampler -> grad accumulation -> clip -> step -> log -> save
6. ``run_reference``        spawn ``nprocs`` gloo processes on a free port, or run under torchrun

Key layout, convention "reshard" (an interface; see formats/conventions/):
    model.<fqn>                          get_model_state_dict (tok_emb.weight and lm_head.weight both)
    optim.state.<fqn>.{exp_avg,exp_avg_sq,step}, optim.param_groups.<i>.<hyper>
    scheduler.*                          LambdaLR.state_dict() without lr_lambdas
    trainer.{step,tokens_seen,samples_seen,micro_step}
    data.sampler.{seed,epoch,cursor,dataset_len}
    rng.rank_<r>.*                       per-rank RNG, each rank saves only its own key
Convention "torchtitan":
    <fqn> (no prefix), optimizer.state.<fqn>.<name>, optimizer.param_groups.<fqn>.<hyper>,
    lr_scheduler.*, dataloader.dp_rank_<k> (pickled bytes), dataloader.world_size,
    train_state.{step,ntokens_seen}; no RNG.

Pipeline parallelism (``pp > 1``, see ``reshard.reference.pipeline``): mesh
("pp", "dp_shard"[, "tp"]), rank = (stage * dp + dp_rank) * tp + tp_rank; each rank holds
its stage's blocks (global names) and saves only its stage's ``model.*`` / ``optim.*`` keys.
The last stage's ``lm_head.weight`` is a separate copy of ``tok_emb.weight`` (gradients
summed across the two ends, so the copies stay bitwise equal; both have optimizer state),
and the optimizer is saved with ``flatten_optimizer_state_dict=True``:
``optim.param_groups.<fqn>.<hyper>`` per parameter instead of ``optim.param_groups.<i>.*``,
whose ``params`` FQN list differs per stage and would be kept only once by DCP.

Tensor parallelism keeps the tied embedding / LM head replicated over TP (only the
attention and MLP projections are sharded); FSDP2 shards everything over dp_shard.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from reshard.semantics import manifest as mf
from reshard.reference import pipeline as pipe
from reshard.reference.model import FAMILY, GPT, TIED, GPTConfig, GPTStage, SyntheticTokens, stage_layers
from reshard.train import rng as rngmod
from reshard.train.sampler import ElasticSampler

CONVENTIONS = ("reshard", "torchtitan")


@dataclass
class TrainConfig:
    """Everything a run needs. ``steps`` is the absolute step to stop at (a resumed run
    continues until it); ``total_steps`` is the LR-schedule horizon (defaults to steps)."""

    dp: int = 2
    tp: int = 1
    pp: int = 1
    steps: int = 4
    total_steps: int | None = None
    save_at: list[int] = field(default_factory=list)
    out: str | None = None
    micro_batch: int = 2
    grad_accum: int = 2
    seq_len: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 2
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    dataset_len: int = 256
    convention: str = "reshard"
    manifest: bool | None = None  # None: yes for "reshard", no for "torchtitan"
    log: str | None = None
    resume: str | None = None
    experiment_id: str | None = None
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    dropout: float = 0.1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def horizon(self) -> int:
        return self.total_steps if self.total_steps is not None else self.steps

    @property
    def write_manifest(self) -> bool:
        return self.manifest if self.manifest is not None else self.convention == "reshard"

    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers,
                         n_heads=self.n_heads, max_seq_len=self.seq_len, dropout=self.dropout)

    def validate(self) -> None:
        if self.convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}, got {self.convention!r}")
        if self.dp < 1 or self.tp < 1 or self.pp < 1:
            raise ValueError("dp, tp and pp must be >= 1")
        if self.n_layers % self.pp:
            raise ValueError(f"pp={self.pp} must divide n_layers={self.n_layers}")
        if self.n_heads % self.tp or (4 * self.dim) % self.tp:
            raise ValueError(f"tp={self.tp} must divide n_heads={self.n_heads} and the MLP width")
        if self.save_at and not self.out:
            raise ValueError("--save-at needs --out")


# ----------------------------------------------------------------------------- setup
def lr_lambda(cfg: TrainConfig):
    """Linear warmup over ``warmup`` steps, then cosine to ``min_lr_ratio`` at the horizon."""
    warmup, horizon, floor = cfg.warmup, max(cfg.horizon, 1), cfg.min_lr_ratio

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, horizon - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


@dataclass
class Run:
    cfg: TrainConfig
    rank: int
    dp_rank: int
    tp_rank: int
    mesh: Any
    model: GPT
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    sampler: ElasticSampler
    data: SyntheticTokens
    step: int = 0
    tokens_seen: int = 0
    samples_seen: int = 0
    resumed_manifest: mf.Manifest | None = None
    stage: int = 0
    embed_group: Any = None  # pp > 1, first/last stage: the 2-rank tied-embedding group


def build(cfg: TrainConfig) -> Run:
    rank = dist.get_rank()
    if dist.get_world_size() != cfg.world_size:
        raise RuntimeError(f"world size {dist.get_world_size()} != pp {cfg.pp} x dp {cfg.dp} x tp {cfg.tp}")
    # size-1 dims are dropped except dp_shard; order (pp, dp_shard, tp), row-major
    names = [n for n, size in (("pp", cfg.pp), ("dp_shard", cfg.dp), ("tp", cfg.tp))
             if size > 1 or n == "dp_shard"]
    sizes = {"pp": cfg.pp, "dp_shard": cfg.dp, "tp": cfg.tp}
    mesh = init_device_mesh("cpu", tuple(sizes[n] for n in names), mesh_dim_names=tuple(names))
    dp_mesh = mesh["dp_shard"] if len(names) > 1 else mesh
    tp_rank = mesh["tp"].get_local_rank() if cfg.tp > 1 else 0
    stage = mesh["pp"].get_local_rank() if cfg.pp > 1 else 0
    dp_rank = dp_mesh.get_local_rank()
    if pipe.coords(rank, cfg.dp, cfg.tp) != pipe.Coords(stage, dp_rank, tp_rank):  # the rank-order interface
        raise RuntimeError(f"rank {rank}: mesh coordinates {(stage, dp_rank, tp_rank)} are not row-major")

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (and for every pp)
    model: GPT | GPTStage = GPT(cfg.model_config())
    if cfg.pp > 1:
        model = GPTStage(model, stage, cfg.pp)  # this stage's layers, global names
    blocks = list(model.blocks.values()) if isinstance(model.blocks, torch.nn.ModuleDict) else list(model.blocks)
    if cfg.tp > 1:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
        for block in blocks:
            parallelize_module(block, mesh["tp"], plan)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)  # root: embeddings (tied head), ln_f -- those this stage holds
    embed_group = pipe.embedding_group(cfg.pp, cfg.dp, cfg.tp, rank)

    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                              weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(cfg))
    sampler = ElasticSampler(cfg.dataset_len, seed=cfg.seed)
    data = SyntheticTokens(cfg.dataset_len, cfg.seq_len, cfg.vocab_size, seed=cfg.seed)
    # per-rank streams keyed by dp rank: TP peers share one (they see the same data and
    # must draw the same dropout masks in the replicated regions)
    rngmod.seed_all(cfg.seed * 7919 + 1 + dp_rank)
    return Run(cfg, rank, dp_rank, tp_rank, mesh, model, optim, sched, sampler, data,
               stage=stage, embed_group=embed_group)


# ----------------------------------------------------------------------------- state layout
def _scheduler_state(sched) -> dict:
    sd = sched.state_dict()
    sd.pop("lr_lambdas", None)  # functions; rebuilt from the config
    return sd


def _load_scheduler_state(sched, state: dict) -> None:
    state = dict(state)
    state["lr_lambdas"] = [None] * len(sched.lr_lambdas)  # keep our (config-built) lambdas
    sched.load_state_dict(state)


def optim_options(cfg: TrainConfig) -> StateDictOptions | None:
    """pp > 1: per-parameter param groups (``optim.param_groups.<fqn>.<hyper>``), because the
    nested ``optim.param_groups.<i>.params`` FQN list differs per stage and DCP keeps one copy
    of a key several ranks save. pp == 1: the nested layout (``optim.param_groups.0.*``)."""
    return StateDictOptions(flatten_optimizer_state_dict=True) if cfg.pp > 1 else None


def state_for_save(run: Run) -> dict:
    """The nested state dict handed to dcp.save (DCP flattens it with '.')."""
    cfg = run.cfg
    if cfg.convention == "reshard":
        return {
            "model": get_model_state_dict(run.model),
            "optim": get_optimizer_state_dict(run.model, run.optim, options=optim_options(cfg)),
            "scheduler": _scheduler_state(run.sched),
            "trainer": {"step": run.step, "tokens_seen": run.tokens_seen,
                        "samples_seen": run.samples_seen, "micro_step": 0},
            "data": {"sampler": run.sampler.state_dict()},
            "rng": {rngmod.rank_entry(run.rank): rngmod.capture()},
        }
    loader_state = {"sampler": run.sampler.state_dict(), "dp_rank": run.dp_rank, "world_size": cfg.dp}
    sd: dict[str, Any] = dict(get_model_state_dict(run.model))
    sd["optimizer"] = get_optimizer_state_dict(
        run.model, run.optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    sd["lr_scheduler"] = _scheduler_state(run.sched)
    sd["dataloader"] = {f"dp_rank_{run.dp_rank}": pickle.dumps(loader_state), "world_size": cfg.dp}
    sd["train_state"] = {"step": run.step, "ntokens_seen": run.tokens_seen}
    return sd


def topology(cfg: TrainConfig) -> mf.Topology:
    order = (["pp"] if cfg.pp > 1 else []) + ["dp_shard"] + (["tp"] if cfg.tp > 1 else [])
    return mf.Topology.make(pp=cfg.pp, dp_shard=cfg.dp, tp=cfg.tp, mesh_order=order)


def build_manifest(run: Run) -> mf.Manifest:
    cfg = run.cfg
    topo = topology(cfg)
    model_config = cfg.model_config().to_dict()
    if cfg.pp > 1:
        model_config["pp_stages"] = stage_layers(cfg.n_layers, cfg.pp)
    prev = run.resumed_manifest
    tool = mf.Writer.current("reshard.reference").tool
    if prev is not None:
        experiment_id = cfg.experiment_id or prev.experiment_id
        lineage = list(prev.lineage)
        if prev.topology.to_dict() != topo.to_dict():
            lineage.append(mf.LineageEvent(
                event="transition", from_=prev.topology, to=topo, at_step=prev.step,
                policies={"data": "elastic-global-cursor", "rng": "reseed(seed, dp_rank)",
                          "schedule": "steps"},
                tool=tool, kind="continuation", reason="resumed by the reference trainer on another topology"))
        continuity = prev.continuity
    else:
        experiment_id = cfg.experiment_id or str(uuid.uuid4())
        lineage = [mf.LineageEvent(event="created", from_=None, to=topo, at_step=run.step, policies={},
                                   tool=tool, kind="continuation", reason="reference trainer run")]
        continuity = "continuation"
    return mf.Manifest(
        experiment_id=experiment_id, step=run.step, tokens_seen=run.tokens_seen,
        samples_seen=run.samples_seen, key_convention=cfg.convention, topology=topo,
        batch=mf.Batch(micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum, seq_len=cfg.seq_len,
                       global_batch=cfg.global_batch),
        accumulation=mf.Accumulation(micro_step=0, in_flight_grads=False),
        precision=mf.Precision(param_dtype="float32", reduce_dtype="float32", loss_scaler=None),
        model=mf.ModelInfo(family=FAMILY, config=model_config, tied=[list(g) for g in TIED]),
        optimizer=mf.OptimizerInfo(name="AdamW", config={"lr": cfg.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                         "weight_decay": cfg.weight_decay,
                                                         "grad_clip": cfg.grad_clip}),
        scheduler=mf.SchedulerInfo(name="warmup-cosine", unit="steps",
                                   config={"warmup": cfg.warmup, "total_steps": cfg.horizon,
                                           "min_lr_ratio": cfg.min_lr_ratio, "base_lr": cfg.lr}),
        data=mf.DataPosition(sampler=ElasticSampler.name, seed=run.sampler.seed, epoch=run.sampler.epoch,
                             cursor=run.sampler.cursor, dataset_len=run.sampler.dataset_len,
                             order=ElasticSampler.order + f"; sample i = SyntheticTokens(seed={cfg.seed})[i]"),
        rng=mf.RngInfo(policy="per-rank" if cfg.convention == "reshard" else "none",
                       keyed_by_rank=cfg.convention == "reshard", seed=cfg.seed),
        continuity=continuity, lineage=lineage, writer=mf.Writer.current(tool),
    )


def save_checkpoint(run: Run, path: Path) -> None:
    dcp.save(state_for_save(run), checkpoint_id=str(path))
    if run.cfg.write_manifest and run.rank == 0:  # after dcp.save returned: .metadata exists
        mf.write_manifest(path, build_manifest(run))
    dist.barrier()


def load_checkpoint(run: Run, path: Path) -> None:
    """Load model/optimizer (resharded by DCP onto this topology), scheduler, sampler,
    counters, and this rank's RNG if the checkpoint holds it (else keep the fresh seed)."""
    cfg = run.cfg
    keys = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    try:
        run.resumed_manifest = mf.read_manifest(path)
    except Exception as exc:  # a bad sidecar must not stop a resume; the new manifest starts fresh
        if run.rank == 0:
            print(f"[reshard.reference] ignoring unreadable manifest: {exc}", file=sys.stderr)
        run.resumed_manifest = None
    prev = run.resumed_manifest
    same_topology = prev is None or prev.topology.to_dict() == topology(cfg).to_dict()
    if cfg.convention == "reshard" and not any(k.startswith("optim.") for k in keys):
        # A warm start (e.g. `reshard import` of weights only): the model is loaded, the optimizer,
        # schedule, data position and counters start fresh, and the manifest says so.
        sd = {"model": get_model_state_dict(run.model)}
        dcp.load(sd, checkpoint_id=str(path))
        set_model_state_dict(run.model, sd["model"])
        if run.rank == 0:
            print(f"[reshard.reference] {path}: weights only (no optimizer state): warm start with fresh "
                  "Adam moments, schedule and data position", file=sys.stderr)
        return
    if cfg.convention == "reshard":
        opts = optim_options(cfg)
        if cfg.pp > 1 and "optim.param_groups.0.params" in keys:
            raise RuntimeError(f"{path}: nested optimizer param groups (a pp=1 checkpoint); a pp>1 run needs "
                               f"per-parameter param groups and optimizer state for lm_head.weight")
        if cfg.pp == 1 and "optim.param_groups.0.params" not in keys:
            opts = StateDictOptions(flatten_optimizer_state_dict=True)  # written with pp > 1
        sd = {
            "model": get_model_state_dict(run.model),
            "optim": get_optimizer_state_dict(run.model, run.optim, options=opts),
            "scheduler": _scheduler_state(run.sched),
            "trainer": {"step": 0, "tokens_seen": 0, "samples_seen": 0, "micro_step": 0},
            "data": {"sampler": run.sampler.state_dict()},
        }
        entry = rngmod.rank_entry(run.rank)
        # per-rank RNG streams belong to rank *positions*: carry them only onto the same
        # topology; elsewhere keep the fresh deterministic seed (policy recorded in lineage)
        has_rng = same_topology and any(k.startswith(rngmod.rng_key(run.rank) + ".") for k in keys)
        if has_rng:
            sd["rng"] = {entry: rngmod.capture()}
        dcp.load(sd, checkpoint_id=str(path))
        set_model_state_dict(run.model, sd["model"])
        set_optimizer_state_dict(run.model, run.optim, sd["optim"], options=opts)
        _load_scheduler_state(run.sched, sd["scheduler"])
        run.sampler.load_state_dict(sd["data"]["sampler"])
        trainer = sd["trainer"]
        if int(trainer["micro_step"]) != 0:
            raise RuntimeError(f"{path}: checkpoint taken mid-accumulation (micro_step={trainer['micro_step']})")
        run.step, run.tokens_seen, run.samples_seen = (int(trainer["step"]), int(trainer["tokens_seen"]),
                                                       int(trainer["samples_seen"]))
        if has_rng:
            rngmod.restore(sd["rng"][entry])
        elif run.rank == 0:
            why = "topology changed" if not same_topology else f"no {rngmod.rng_key(run.rank)}"
            print(f"[reshard.reference] {path}: RNG not restored ({why}); ranks keep a fresh "
                  f"deterministic per-dp-rank seed", file=sys.stderr)
    else:
        own = f"dataloader.dp_rank_{run.dp_rank}"
        if own not in keys:
            raise RuntimeError(f"{path}: no dataloader state for dp rank {run.dp_rank} ({own}); "
                               f"the checkpoint was written for another data-parallel degree")
        flat_opts = StateDictOptions(flatten_optimizer_state_dict=True)
        sd = dict(get_model_state_dict(run.model))
        n_model = list(sd)
        sd["optimizer"] = get_optimizer_state_dict(run.model, run.optim, options=flat_opts)
        sd["lr_scheduler"] = _scheduler_state(run.sched)
        sd["dataloader"] = {f"dp_rank_{run.dp_rank}": b"", "world_size": 0}
        sd["train_state"] = {"step": 0, "ntokens_seen": 0}
        dcp.load(sd, checkpoint_id=str(path))
        set_model_state_dict(run.model, {k: sd[k] for k in n_model})
        set_optimizer_state_dict(run.model, run.optim, sd["optimizer"], options=flat_opts)
        _load_scheduler_state(run.sched, sd["lr_scheduler"])
        loader = pickle.loads(sd["dataloader"][f"dp_rank_{run.dp_rank}"])
        run.sampler.load_state_dict(loader["sampler"])
        run.step, run.tokens_seen = int(sd["train_state"]["step"]), int(sd["train_state"]["ntokens_seen"])
        run.samples_seen = run.tokens_seen // cfg.seq_len


# ----------------------------------------------------------------------------- training
def clip_grad_norm(params, max_norm: float, *, holders: int | None = None, exclude=()) -> float:
    """Global grad-norm clipping with one all-reduce over the world.

    Works when FSDP-only DTensors (on the dp mesh) sit next to FSDP+TP DTensors (on the
    2-D mesh), where torch's stacked per-mesh norms refuse to mix. Each rank sums the
    squares of its local shards, divided by how many ranks hold an identical copy
    (Replicate placements and ranks outside the tensor's mesh). ``holders``: how many ranks
    hold this rank's parameters (the stage's dp*tp ranks under pipeline parallelism; default
    the world); ``exclude``: parameters left out of the norm (but still scaled), e.g. the
    last stage's copy of a tied weight so the pair counts once.
    """
    world = holders or dist.get_world_size()
    params = list(params)
    skip = {id(p) for p in exclude}
    all_grads = [p.grad for p in params if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    local = torch.zeros((), dtype=torch.float64)
    for g in grads:
        if isinstance(g, DTensor):
            copies = world // g.device_mesh.size()
            for i, placement in enumerate(g.placements):
                if placement.is_replicate():
                    copies *= g.device_mesh.size(i)
            local += g.to_local().double().pow(2).sum() / copies
        else:  # plain tensor: identical on every rank
            local += g.double().pow(2).sum() / world
    dist.all_reduce(local)
    total = local.sqrt().item()
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in all_grads:
            g.mul_(coef)
    return total


def train_step(run: Run) -> dict:
    cfg = run.cfg
    t0 = time.perf_counter()
    run.model.train()
    local_ids: list[int] = []
    loss_sum = torch.zeros(())
    for micro in range(cfg.grad_accum):
        ids = run.sampler.local_ids(cfg.global_batch, cfg.dp, run.dp_rank, micro, cfg.grad_accum)
        local_ids.extend(ids)
        x, y = run.data.batch(ids)  # every stage builds its dp rank's batch; first uses x, last y
        if cfg.pp == 1:
            loss = run.model(x, y) / cfg.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        else:
            loss = pipe.micro_step(run.model, rank=run.rank, pp=cfg.pp, dp=cfg.dp, tp=cfg.tp, x=x, y=y,
                                   divisor=cfg.grad_accum, act_shape=(x.shape[0], x.shape[1], cfg.dim))
            if loss is not None:
                loss_sum += loss
    if cfg.pp == 1:
        grad_norm = clip_grad_norm(run.model.parameters(), cfg.grad_clip)
    else:
        pipe.sync_tied_grads(run.model, run.embed_group)
        exclude = [run.model.lm_head.weight] if run.model.is_last else []
        grad_norm = clip_grad_norm(run.model.parameters(), cfg.grad_clip, holders=cfg.dp * cfg.tp,
                                   exclude=exclude)
    lr = run.optim.param_groups[0]["lr"]
    run.optim.step()
    run.sched.step()
    run.optim.zero_grad(set_to_none=True)
    run.sampler.advance(cfg.global_batch)
    run.step += 1
    run.samples_seen += cfg.global_batch
    run.tokens_seen += cfg.global_batch * cfg.seq_len

    # TP peers hold identical losses, so the mean over the ranks holding a loss (the last
    # stage's dp*tp ranks; other stages add zeros) is the dp mean
    dist.all_reduce(loss_sum)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (run.stage, run.tp_rank, local_ids))
    sample_ids = sorted(i for stage, tp_rank, ids in gathered if stage == 0 and tp_rank == 0 for i in ids)
    dt = time.perf_counter() - t0
    return {"step": run.step, "loss": loss_sum.item() / (cfg.dp * cfg.tp), "grad_norm": grad_norm,
            "lr": lr, "tokens_per_s": cfg.global_batch * cfg.seq_len / dt, "sample_ids": sample_ids,
            "world_size": dist.get_world_size()}


def train(cfg: TrainConfig) -> None:
    """Run on an initialised gloo process group (one call per rank)."""
    cfg.validate()
    torch.set_num_threads(1)
    run = build(cfg)
    if cfg.out and run.rank == 0:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
    if cfg.resume:
        load_checkpoint(run, Path(cfg.resume))
    log = open(cfg.log, "a", encoding="utf-8") if (cfg.log and run.rank == 0) else None
    try:
        while run.step < cfg.steps:
            rec = train_step(run)
            if log is not None:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if run.step in cfg.save_at:
                save_checkpoint(run, Path(cfg.out) / f"step_{run.step}")
    finally:
        if log is not None:
            log.close()


# ----------------------------------------------------------------------------- launching
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_worker(rank: int, world: int, port: int, cfg_dicts: list[dict]) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    run_in_process_group(*[TrainConfig(**d) for d in cfg_dicts])
    # Everything is written and the process group destroyed. Leave without interpreter
    # teardown: on 2-core CI machines a background C++ thread occasionally aborted the
    # process at exit ("terminate called without an active exception"), turning a finished
    # run into a spawn failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_in_process_group(*cfgs: TrainConfig) -> None:
    """Entry for one rank whose env (RANK, WORLD_SIZE, MASTER_*) is set, e.g. by torchrun.

    Several configs run one after the other in the same process group (saves process
    start-up in tests); each builds its own mesh, model and RNG streams.
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for cfg in cfgs:
            train(cfg)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def checkpoint_dirs(cfg: TrainConfig) -> list[Path]:
    """Where a run with ``cfg`` writes its checkpoints (``<out>/step_<k>``)."""
    if not cfg.out:
        return []
    return [Path(cfg.out) / f"step_{k}" for k in sorted(set(cfg.save_at)) if k <= cfg.steps]


def run_reference(cfg: TrainConfig | Sequence[TrainConfig], nprocs: int | None = None, *,
                  start_method: str | None = None) -> list[Path]:
    """Spawn ``nprocs`` (default pp*dp*tp) local gloo processes, train, return after all exit.

    ``cfg`` may be a list of configs with the same world size: they run one after the
    other, each in freshly spawned processes (a later one may ``resume`` from an earlier
    one's output). Fresh processes per config cost a few seconds of start-up but keep runs
    independent: reusing one process group across configs occasionally aborted a rank on
    2-core machines. Raises if any rank failed
    (``torch.multiprocessing.ProcessRaisedException`` / ``ProcessExitedException``).
    Returns the checkpoint directories written (``<out>/step_<k>``), in order.
    The ranks are forked from a fork server that imported torch once (`reshard.train.launch`:
    no torch import per rank, seconds per run on a small machine), or spawned where the
    platform has no fork server (or ``start_method="spawn"``). ``start_method="fork"`` forks
    them from this process; only for a process that has run no torch op or thread yet, such as
    ``python -m reshard.reference --spawn`` (the rehearsal's).
    """
    cfgs = [cfg] if isinstance(cfg, TrainConfig) else list(cfg)
    if not cfgs:
        raise ValueError("no config given")
    for c in cfgs:
        c.validate()
    nprocs = nprocs or cfgs[0].world_size
    for c in cfgs:
        if c.world_size != nprocs:
            raise ValueError(f"nprocs {nprocs} != pp {c.pp} x dp {c.dp} x tp {c.tp}")
        if c.out:
            Path(c.out).mkdir(parents=True, exist_ok=True)
    from reshard.train.launch import PRELOAD, start_ranks

    for c in cfgs:
        start_ranks(_spawned_worker, (nprocs, free_port(), [asdict(c)]), nprocs, start_method=start_method,
                    preload=(*PRELOAD, __name__))
    return [p for c in cfgs for p in checkpoint_dirs(c)]
