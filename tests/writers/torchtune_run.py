"""Write or load a torchtune 0.6.1 checkpoint with torchtune's own code, on CPU gloo ranks.

Run as a plain script: ``python tests/writers/torchtune_run.py write|load JOBS.json``; ``JOBS.json``
lists jobs ``{"world", "port", "result", "base", "output", "optimizer_in_bwd"}`` (`tests/writers/jobs.py`
forks max(world) ranks once; ranks past a job's world sit it out). ``optimizer_in_bwd`` (default false)
is the recipe's option of that name: one optimizer per parameter stepped in backward
(``training.register_optim_in_bwd_hooks``), saved and loaded through ``create_optim_in_bwd_wrapper``'s
``OptimizerInBackwardWrapper``, whose state is keyed by parameter name.

* ``write``: what ``recipes/full_finetune_distributed.py`` (torchtune 0.6.1) does for one epoch
  of ``epochs: 2``, ``max_steps_per_epoch: 2`` with ``enable_async_checkpointing: True``, then its
  intermediate save. Rank 0 returns the full state it held when saving.
* ``load``: the same recipe resumed (``resume_from_checkpoint: True`` with async checkpointing) at
  THIS world size: ``CheckpointClient.load_distributed_checkpoint`` from ``output`` (its
  ``DistributedCheckpointer`` finds the latest ``dist_epoch_<n>``), then the recipe state the
  checkpoint dict hands back. The data-loader state, which 0.6.1's resume does not read, is
  read through the same ``DistributedCheckpointer.load_checkpoint``. Rank 0 returns the full state
  the live objects hold, for the test to compare bitwise with the writer's.

torchtune's own code here, in the recipe's order (``FullFinetuneRecipeDistributed.setup`` /
``_setup_model`` / ``_setup_optimizer`` / ``_setup_data`` / ``train``):

- ``CheckpointClient(cfg)`` (torchtune/training/checkpointing/_checkpoint_client.py) with the
  recipe's config keys, its ``load_base_checkpoint`` through ``FullModelTorchTuneCheckpointer``;
- the model from torchtune's ``llama3`` component builder (``torchtune.models.llama3.llama3``,
  tiny sizes), built on the meta device under ``training.set_default_dtype``, sharded with
  ``training.shard_model`` on a ``("dp", "tp")`` mesh with ``training.get_shard_conditions``
  (FSDP2 per layer, then the root), ``rope_init``, ``training.load_from_full_model_state_dict``;
- the optimizer by ``config.instantiate(cfg.optimizer, model.parameters())`` (``torch.optim.AdamW``);
- the data: torchdata's ``StatefulDataLoader`` over ``StatefulDistributedSampler`` with torchtune's
  ``padded_collate_sft``, as ``_setup_data`` builds them; the train step's label shift, token
  counting, ``training.scale_grads`` by ``world_size / num_tokens``;
- the save: ``CheckpointClient.save_checkpoint(model, optimizer, TrainingProgress(...), epoch=0)``,
  an intermediate checkpoint (epoch 1 of 2) with async checkpointing on, so torchtune writes it
  with ``DistributedCheckpointer.save_checkpoint(save_async=True)`` (``dcp.async_save``) to
  ``output/dist_epoch_0``: ``model.state_dict()`` under ``model``, the raw
  ``optimizer.state_dict()`` under ``optimizer`` (keyed by parameter INDEX:
  ``optimizer.state.<i>.{step,exp_avg,exp_avg_sq}``, ``optimizer.param_groups.0.params`` the list of
  indices), and ``TrainingProgress.state_dict()``: ``seed``, ``epochs_run``, ``total_epochs``,
  ``max_steps_per_epoch`` and ``dataloader`` (the StatefulDataLoader's state);
- the reference full state by torchtune's ``training.gather_cpu_state_dict`` and
  ``training.get_full_optimizer_state_dict`` (the recipe's own consolidation for its final save).

CPU substitutions, none of which changes what is written: gloo on CPU (``device: cpu``; the
recipe's ``get_distributed_backend("cpu", offload_ops_to_cpu=True)`` is gloo too) with the
process group opened by ``jobs.py`` (the recipe's ``init_process_group`` would open the same);
``dtype: fp32`` (bf16 is a GPU choice; the state is fp32 either way for the optimizer); a tiny
in-memory tokenised dataset instead of a Hugging Face dataset and tokenizer (the loader, sampler
and collate around it are torchtune's); the loss ``torch.nn.CrossEntropyLoss`` over the full
logits (torchtune's ``CEWithChunkedOutputLoss`` is the same loss over chunks). The base
"pretrained" weights are the builder's seeded initialisation saved with ``torch.save`` as the
``model.pt`` that ``FullModelTorchTuneCheckpointer`` reads (no hub download).

The async save is awaited through torchtune's own handle (``DistributedCheckpointer._checkpoint_future``,
which the recipe awaits at its next save): the job must not end while the files are written.
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

# torchtune imported here, before jobs.py forks the ranks: importing it (torchao, datasets) is most of a
# rank's start-up, and forked children share the parent's imports
from torchtune import config, training, utils
from torchtune.data import padded_collate_sft
# (the recipe imports CheckpointClient and TrainingProgress from this module too: torchtune exports them nowhere else)
from torchtune.training.checkpointing._checkpoint_client import CheckpointClient, TrainingProgress

VOCAB = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
DIM = 64
HIDDEN = 96
MAX_SEQ = 64
SEED = 1234
BATCH = 2
TOTAL_EPOCHS = 2
MAX_STEPS = 2
LR = 2e-3
IGNORE = -100
RECIPE_KEYS = ("seed", "epochs_run", "total_epochs", "max_steps_per_epoch")


def recipe_config(base: str, output: str, resume: bool, optimizer_in_bwd: bool = False):
    """The keys of a full_finetune_distributed config that CheckpointClient and the setup read."""
    return OmegaConf.create({
        "device": "cpu", "dtype": "fp32", "seed": SEED, "epochs": TOTAL_EPOCHS, "max_steps_per_epoch": MAX_STEPS,
        "batch_size": BATCH, "gradient_accumulation_steps": 1, "shuffle": True,
        "enable_async_checkpointing": True, "resume_from_checkpoint": resume, "optimizer_in_bwd": optimizer_in_bwd,
        "output_dir": output,
        "model": {"_component_": "torchtune.models.llama3.llama3", "vocab_size": VOCAB, "num_layers": LAYERS,
                  "num_heads": HEADS, "num_kv_heads": KV_HEADS, "embed_dim": DIM, "max_seq_len": MAX_SEQ,
                  "intermediate_dim": HIDDEN},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": LR, "weight_decay": 0.01},
        "checkpointer": {"_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
                         "checkpoint_dir": base, "checkpoint_files": ["model.pt"], "model_type": "LLAMA3",
                         "output_dir": output},
    })


def write_base(cfg) -> None:
    """The "pretrained" weights: the builder's seeded initialisation, saved where the checkpointer reads it."""
    Path(cfg.checkpointer.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        model = config.instantiate(cfg.model)
        torch.save(model.state_dict(), Path(cfg.checkpointer.checkpoint_dir) / "model.pt")
    dist.barrier()


class Tokens(torch.utils.data.Dataset):
    """Tokenised samples of varied length as torchtune's SFT datasets yield them: ``tokens`` and ``labels``."""

    def __init__(self, n: int = 16) -> None:
        self.samples = []
        for i in range(n):
            g = torch.Generator().manual_seed(500 + i)
            t = torch.randint(1, VOCAB, (8 + i % 5,), generator=g).tolist()
            self.samples.append({"tokens": t, "labels": t})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.samples[i]


class Recipe:
    """The parts of FullFinetuneRecipeDistributed's state this job holds, built in its setup order."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.device = utils.get_device(device=cfg.device)
        self.dtype = training.get_dtype(cfg.dtype, device=self.device)
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self.seed = training.set_seed(seed=cfg.seed)
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.client = CheckpointClient(cfg)
        base = self.client.load_base_checkpoint()
        # _setup_model
        with training.set_default_dtype(self.dtype), torch.device("meta"):
            model = config.instantiate(cfg.model)
        mesh = init_device_mesh(self.device.type, mesh_shape=(self.world_size, 1), mesh_dim_names=("dp", "tp"))
        self.dp_size, self.dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        training.shard_model(model=model, shard_conditions=[partial(training.get_shard_conditions, names_to_match=None)],
                             cpu_offload=False, reshard_after_forward=True, dp_mesh=mesh["dp"])
        with training.set_default_dtype(self.dtype), self.device:
            for m in model.modules():
                if hasattr(m, "rope_init"):
                    m.rope_init()
        training.load_from_full_model_state_dict(model, base[training.MODEL_KEY], self.device, strict=True)
        training.validate_no_params_on_meta_device(model)
        self.model = model
        # _setup_optimizer: one optimizer over model.parameters(), or with optimizer_in_bwd one per parameter,
        # stepped by a post-accumulate-grad hook, and the wrapper the checkpoint client saves and loads
        self.optimizer_in_bwd = bool(cfg.optimizer_in_bwd)
        if self.optimizer_in_bwd:
            optim_dict = {p: config.instantiate(cfg.optimizer, [p]) for p in model.parameters()}
            training.register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
            self.optimizer = training.create_optim_in_bwd_wrapper(model=model, optim_dict=optim_dict)
        else:
            self.optimizer = config.instantiate(cfg.optimizer, model.parameters())
        # _setup_data
        self.dataloader = self.make_dataloader()

    def make_dataloader(self):
        ds = Tokens()
        sampler = StatefulDistributedSampler(ds, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=self.cfg.shuffle)
        return StatefulDataLoader(dataset=ds, batch_size=self.cfg.batch_size, sampler=sampler,
                                  collate_fn=partial(padded_collate_sft, padding_idx=0, ignore_idx=IGNORE),
                                  drop_last=True)

    def train_one_epoch(self) -> None:
        """Epoch ``epochs_run`` of ``train()``, then its end-of-epoch checkpoint (intermediate: epoch 1 of 2)."""
        loss_fn = torch.nn.CrossEntropyLoss(ignore_index=IGNORE)
        curr_epoch = self.epochs_run
        self.dataloader.sampler.set_epoch(curr_epoch)
        if not self.optimizer_in_bwd:
            self.optimizer.zero_grad()
        for idx, batch in enumerate(self.dataloader):
            num_tokens = (batch["labels"] != IGNORE).sum()
            labels = batch.pop("labels")
            logits = self.model(**batch)
            labels = torch.hstack((labels[..., 1:], torch.full((labels.shape[0], 1), IGNORE)))
            loss = loss_fn(logits.reshape(-1, logits.size(-1)), labels.reshape(-1)) * num_tokens
            if self.optimizer_in_bwd:  # normalised before backward, whose hooks step the optimizers
                dist.all_reduce(num_tokens)
                loss = loss * (self.world_size / num_tokens)
                loss.backward()
            else:
                loss.backward()
                dist.all_reduce(num_tokens)
                training.scale_grads(self.model, self.world_size / num_tokens)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            if idx + 1 == self.max_steps_per_epoch:
                break
        self.epochs_run += 1
        self.client.save_checkpoint(
            model=self.model, optimizer=self.optimizer,
            training_progress=TrainingProgress(seed=self.seed, epochs_run=self.epochs_run, total_epochs=self.total_epochs,
                                               max_steps_per_epoch=self.max_steps_per_epoch,
                                               dataloader_state_dict=self.dataloader.state_dict()),
            epoch=curr_epoch)
        future = self.client._get_dcp_checkpointer()._checkpoint_future  # the recipe awaits it at its next save
        if future is not None:
            future.result()
        dist.barrier()

    def full_state(self) -> dict[str, Any]:
        """The full model and optimizer state (torchtune's consolidation; collective, complete on rank 0)."""
        is_zero = self.rank == 0
        model = training.gather_cpu_state_dict(self.model, is_zero, device=self.device)
        if self.optimizer_in_bwd:  # the recipe's consolidation of the per-parameter optimizers
            optim = {p: training.get_full_optimizer_state_dict(self.model, opt, is_zero, device=self.device)
                     for p, opt in self.optimizer.optim_map.items()}
        else:
            optim = training.get_full_optimizer_state_dict(self.model, self.optimizer, is_zero, device=self.device)
        names = [n for n, _ in self.model.named_parameters()]
        return {"model": model, "optimizer": optim, "param_names": names}


def write_job(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    cfg = recipe_config(job["base"], job["output"], resume=False, optimizer_in_bwd=job.get("optimizer_in_bwd", False))
    write_base(cfg)
    recipe = Recipe(cfg)
    recipe.train_one_epoch()
    state = recipe.full_state()
    state["recipe"] = {"seed": recipe.seed, "epochs_run": recipe.epochs_run, "total_epochs": recipe.total_epochs,
                       "max_steps_per_epoch": recipe.max_steps_per_epoch}
    state["dataloader"] = recipe.dataloader.state_dict()
    return state


def load_job(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    """The recipe's resume: base weights first, then the distributed checkpoint over them, strictly."""
    cfg = recipe_config(job["base"], job["output"], resume=True, optimizer_in_bwd=job.get("optimizer_in_bwd", False))
    recipe = Recipe(cfg)
    ckpt = recipe.client.load_distributed_checkpoint(recipe.model, recipe.optimizer)
    # how many parameters hold optimizer state right after the load (the consolidation below initialises
    # any missing state with zeros, so it is counted first)
    optims = recipe.optimizer.optim_map if recipe.optimizer_in_bwd else {"": recipe.optimizer}
    restored = sum(len(opt.state) for opt in optims.values())
    state = recipe.full_state()
    state["restored_states"] = restored
    state["recipe"] = {k: ckpt[k] for k in RECIPE_KEYS}
    # 0.6.1's resume restarts the next epoch and does not read the loader state it saved; read it with the
    # same checkpointer, into a fresh loader's state (the structure), as a loader that restores it would
    fresh = recipe.make_dataloader().state_dict()
    loaded = recipe.client._get_dcp_checkpointer().load_checkpoint({training.DATALOADER_KEY: fresh})
    state["dataloader"] = loaded[training.DATALOADER_KEY]
    return state


if __name__ == "__main__":
    import jobs  # tests/writers is sys.path[0] when run as a script

    sys.exit(jobs.main(write_job, load_job))
