"""torchtitan 0.3.0's own text data loader across a change of data-parallel degree, on CPU gloo.

Run under ``python -m torch.distributed.run --standalone --nproc-per-node N``:

    torchtitan_data_run.py write SPEC     SPEC {"dump", "data", "steps"}: train ``steps`` steps at dp = N
        and save with torchtitan's CheckpointManager (DUMP/checkpoint/step-<steps>)
    torchtitan_data_run.py resume SPEC    SPEC {"dump", "data", "step", "tag"}: build the same job at dp = N,
        CheckpointManager.load(step) WITH the dataloader (no exclude_from_loading), then train to the
        end of the epoch

Each rank writes DUMP/reads/<tag>-rank<r>.json: the example ids its loader read (in order), the
tokens it emitted as model input and the tokens left in its buffer at the end, and (resume) the
token buffer torchtitan loaded and the steps trained.

What is torchtitan's own code here: ``HuggingFaceTextDataLoader`` (its ``ParallelAwareDataloader``
around ``HuggingFaceTextDataset``, which splits the dataset with ``datasets.split_dataset_by_node``
and keeps ``sample``/``data`` state and the token buffers) over a dataset registered in
torchtitan's ``DATASETS`` table the way its docs say a dataset is added, and the job of
``torchtitan_run.py`` (llama3 model, ``parallelize_llama`` FSDP2, optimizer and LR-scheduler
containers, ``CheckpointManager``; its CPU substitutions are listed there). Here:

- the dataset is DATA, a JSON-lines file of examples ``{"text": "example <id>"}`` (one file:
  one shard, so ``split_dataset_by_node`` splits the stream by example for every dp degree
  above 1), loaded with ``datasets.load_dataset("json", streaming=True)``: an IterableDataset,
  as torchtitan's C4 loader streams; read once (``infinite=False``: one epoch);
- the tokenizer is a ``BaseTokenizer`` that needs no files: example i is ``[BOS, 2+2i, 3+2i,
  EOS]``, so every token names its example (the vocabulary is 2 + 2 * EXAMPLES, the model's is
  set to match); 3 tokens per example enter the buffer, which a sequence of 8 does not
  divide, so buffers are not empty when the checkpoint is saved;
- the data position the loader keeps is torchtitan's and nothing else: the ids read are
  recorded by the dataset's ``sample_processor`` (called once per example the loader reads).

A rank whose loader ends while another still has a batch stops training (the collectives of
FSDP need every rank); it then reads its loader to the end, so the epoch is read whole.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import torchtitan_run as titan  # noqa: E402  the llama3 job of the torchtitan interop tests

EXAMPLES = 240
SEQ = 8
BATCH = 2
DATASET = "reshard_ids"
READ: list[int] = []


def examples_file(path: Path, n: int = EXAMPLES) -> None:
    path.write_text("".join(json.dumps({"text": f"example {i:04d}"}) + "\n" for i in range(n)))


def _record(sample: dict[str, Any]) -> str:
    READ.append(int(sample["text"].split()[1]))
    return sample["text"]


def tokenizer():
    from torchtitan.components.tokenizer import BaseTokenizer

    class IdTokens(BaseTokenizer):
        """Example i -> [BOS=0, 2+2i, 3+2i, EOS=1]: every token names its example."""

        def __init__(self) -> None:
            super().__init__()
            self.eos_id = 1

        def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
            i = int(text.split()[1])
            return ([0] if add_bos else []) + [2 + 2 * i, 3 + 2 * i] + ([1] if add_eos else [])

        def decode(self, ids: list[int]) -> str:
            return " ".join(map(str, ids))

        def get_vocab_size(self) -> int:
            return 2 + 2 * EXAMPLES

    return IdTokens()


def build(dump: Path, data: Path):
    """torchtitan_run's job with torchtitan's HuggingFaceTextDataLoader over DATA, the dataloader loaded too."""
    from datasets import load_dataset
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets
    from torchtitan.models.llama3.parallelize import parallelize_llama
    from torch.distributed.fsdp import FSDPModule

    text_datasets.DATASETS[DATASET] = DatasetConfig(
        path=str(data), loader=lambda p: load_dataset("json", data_files=p, split="train", streaming=True),
        sample_processor=_record)
    titan.VOCAB = 2 + 2 * EXAMPLES  # the model's vocabulary is the tokenizer's
    world = dist.get_world_size()
    parallelism = ParallelismConfig(data_parallel_shard_degree=world, spmd_backend=titan.SPMD_BACKEND)
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, steps=100, mixed_precision_param="float32")

    class _JobConfig:
        def __init__(self, p): self.parallelism = p

    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    cfg = titan.model_config(fuse_qkv=True)
    cfg.update_from_config(config=_JobConfig(parallelism))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.build()
    model = parallelize_llama(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder=str(dump))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    opt_cfg = default_adamw(lr=8e-4)
    opt_cfg.implementation = "for-loop"
    optimizers = opt_cfg.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                 min_lr_factor=0.0).build(optimizers=optimizers, training_steps=100)
    batch_mesh = parallel_dims.get_mesh("batch") if parallel_dims.dp_enabled else None
    dp_world, dp_rank = (batch_mesh.size(), batch_mesh.get_local_rank()) if batch_mesh is not None else (1, 0)
    loader_cfg = text_datasets.HuggingFaceTextDataLoader.Config(dataset=DATASET, dataset_path=str(data), infinite=False)
    dataloader = text_datasets.HuggingFaceTextDataLoader(loader_cfg, dp_world_size=dp_world, dp_rank=dp_rank,
                                                         tokenizer=tokenizer(), seq_len=SEQ, local_batch_size=BATCH)
    train_state = titan.TrainState()
    ck_cfg = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, last_save_model_only=False,
                                      keep_latest_k=0, exclude_from_loading=[])
    checkpointer = ck_cfg.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                sd_adapter=None, base_folder=str(dump))
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims, spmd_typechecking=False)
    return titan.Job(model, optimizers, lr_schedulers, dataloader, checkpointer, train_state, dp_rank, dp_world,
                     parallel_dims, context)


def train(job, steps: int | None) -> tuple[int, list[int]]:
    """Train ``steps`` steps (None: until any rank's loader ends, then read the rest); (steps trained, input tokens)."""
    it = iter(job.dataloader)
    emitted: list[int] = []
    done = 0
    while steps is None or done < steps:
        try:
            input_dict, labels = next(it)
            have = 1
        except StopIteration:
            input_dict, labels, have = None, None, 0
        if input_dict is not None:
            emitted += input_dict["input"].flatten().tolist()
        flag = torch.tensor([have])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item():
            break
        job.train_state.step += 1
        job.optimizers.zero_grad()
        with job.train_context():
            logits = job.model(input_dict["input"])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
            loss.backward()
        job.train_state.ntokens_seen += labels.numel()
        job.optimizers.step()
        job.lr_schedulers.step()
        done += 1
    if steps is None:  # the end of the epoch: what this rank's loader still holds is read too
        for input_dict, _ in it:
            emitted += input_dict["input"].flatten().tolist()
    return done, emitted


def _buffer(job) -> list[int]:
    import pickle

    state = pickle.loads(job.dataloader.state_dict()[f"dp_rank_{job.dp_rank}"])
    return list(state["dataset_state"]["inputs_buffer"])


def run(mode: str, spec: dict[str, Any]) -> None:
    dump, data = Path(spec["dump"]), Path(spec["data"])
    job = build(dump, data)
    out: dict[str, Any] = {"rank": job.dp_rank, "world": job.dp_world}
    if mode == "write":
        trained, emitted = train(job, spec["steps"])
        job.checkpointer.save(curr_step=spec["steps"])
    else:
        loaded = job.checkpointer.load(step=spec["step"])
        out.update(loaded=bool(loaded), step_loaded=job.train_state.step, loaded_buffer=_buffer(job))
        trained, emitted = train(job, None)
    out.update(read=list(READ), emitted=emitted, buffer=_buffer(job), trained=trained)
    reads = dump / "reads"
    reads.mkdir(parents=True, exist_ok=True)
    (reads / f"{spec.get('tag', mode)}-rank{job.dp_rank}.json").write_text(json.dumps(out))
    job.checkpointer.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["write", "resume"])
    ap.add_argument("spec", type=Path)
    a = ap.parse_args(argv)
    dist.init_process_group("gloo")
    titan.cpu_mesh()
    run(a.mode, json.loads(a.spec.read_text()))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
