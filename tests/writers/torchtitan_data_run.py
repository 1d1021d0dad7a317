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
import os
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
    """torchtitan_run's job (`torchtitan_run.build`) with torchtitan's HuggingFaceTextDataLoader over
    DATA, the dataloader loaded too."""
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets

    text_datasets.DATASETS[DATASET] = DatasetConfig(
        path=str(data), loader=lambda p: load_dataset("json", data_files=p, split="train", streaming=True),
        sample_processor=_record)
    titan.VOCAB = 2 + 2 * EXAMPLES  # the model's vocabulary is the tokenizer's

    def loader(dp_rank: int, dp_world: int):
        cfg = text_datasets.HuggingFaceTextDataLoader.Config(dataset=DATASET, dataset_path=str(data), infinite=False)
        return text_datasets.HuggingFaceTextDataLoader(cfg, dp_world_size=dp_world, dp_rank=dp_rank,
                                                       tokenizer=tokenizer(), seq_len=SEQ, local_batch_size=BATCH)

    return titan.build(dump, True, [], loader=loader, seq=SEQ, batch=BATCH, steps=100)


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
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a gloo thread can abort interpreter teardown ("terminate called without an active exception")
