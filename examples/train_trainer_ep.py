"""Train a tiny MoE model with expert parallelism through transformers' Trainer (moecompile.ExpertParallelTrainer).

    torchrun --standalone --nproc-per-node 2 examples/train_trainer_ep.py --out /tmp/trained
    torchrun --standalone --nproc-per-node 4 examples/train_trainer_ep.py --family qwen3_moe --steps 8

Every rank builds the same model from the same seed; parallelize shards its experts over the ranks and the model is
compiled in place (it stays a PreTrainedModel, whose forward's signature the Trainer reads). The Trainer deals each
rank its own batches, clips at the whole model's gradient norm, checkpoints every --save-every steps (a transformers
checkpoint and the optimizer's state) and, at the end, writes the model to --out as a transformers checkpoint that
from_pretrained reads in one process. --resume DIR goes on from one of its checkpoints.
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import Dataset
from transformers import TrainingArguments

import moecompile
from moecompile.models.hf import tiny_model


class RandomRows(Dataset):
    """Rows of random token ids, each its own labels (a stand-in for a tokenized corpus)."""

    def __init__(self, rows: int, seq: int, vocab: int):
        self.rows, self.seq, self.vocab = rows, seq, vocab

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="mixtral", help="a tiny transformers MoE family (moecompile.models.hf)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=2, help="checkpoint every N steps into --out/checkpoint-N")
    ap.add_argument("--out", default="trainer_ep_out", help="the output directory (checkpoints, the final model)")
    ap.add_argument("--resume", help="a checkpoint directory of an earlier run to go on from")
    ap.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"),
                    help="the compiler of the rest of each graph")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    try:
        device = "cuda" if cuda else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("ep",))
        model = tiny_model(args.family, seed=0).train().to(device)  # the same model on every rank
        data = RandomRows(64 * dist.get_world_size(), 16, model.config.vocab_size)
        example = torch.stack([data[i]["input_ids"] for i in range(2)]).to(device)
        moecompile.parallelize(model, mesh, example)
        model.compile(backend="moe", options={"inner": args.inner})
        training = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=2,
                                     gradient_accumulation_steps=2, learning_rate=1e-3, max_grad_norm=1.0,
                                     logging_steps=1, save_strategy="steps", save_steps=args.save_every,
                                     report_to=[], use_cpu=not cuda, disable_tqdm=True, seed=0)
        trainer = moecompile.ExpertParallelTrainer(model=model, args=training, train_dataset=data)
        trainer.train(resume_from_checkpoint=args.resume)
        trainer.save_model(args.out)  # every rank: each decoder layer is gathered to one rank in turn
        if dist.get_rank() == 0:
            print(model._moe_parallel)
            print(f"saved the trained model to {args.out} (AutoModelForCausalLM.from_pretrained reads it)")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
