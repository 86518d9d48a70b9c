"""torchrun worker: load a converted checkpoint on TP/PP ranks, export it as HF tensors, save per rank.

Args: CKPT_DIR HF_DIR OUT_DIR TP PP. Every rank writes OUT_DIR/rank{r}.safetensors with what
iter_hf_weights yielded there; with PP = 1, rank 0 also writes the TP-gathered logits of fixed ids.
"""

import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file

from megatron_dapo.actor import destroy_parallel, init_parallel
from megatron_dapo.models import Qwen2Arch, build_gpt_model
from megatron_dapo.weights import load_mcore_checkpoint
from megatron_dapo.weights.export import iter_hf_weights


def run_job(ckpt_dir: str, hf_dir: str, out_dir: str, tp: int, pp: int) -> None:
    layout = init_parallel(tp=tp, pp=pp)
    arch = Qwen2Arch.from_hf(hf_dir)
    model = build_gpt_model(arch).eval()
    load_mcore_checkpoint(model, ckpt_dir, layout)
    rank = dist.get_rank()
    exported = {name: t.clone() for name, t in iter_hf_weights([model], arch)}
    save_file(exported, os.path.join(out_dir, f"rank{rank}.safetensors"))
    if pp == 1:
        ids = torch.randint(0, arch.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
        mask = torch.ones(1, 1, 9, 9, dtype=torch.bool).triu(diagonal=1)
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=torch.arange(9).expand(2, 9), attention_mask=mask)
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        if rank == 0:
            save_file(
                {"logits": torch.cat(parts, dim=-1)[..., : arch.vocab_size].contiguous(), "ids": ids},
                os.path.join(out_dir, "logits.safetensors"),
            )
    destroy_parallel()


def main() -> None:
    ckpt_dir, hf_dir, out_dir, tp, pp = sys.argv[1:6]
    run_job(ckpt_dir, hf_dir, out_dir, int(tp), int(pp))


if __name__ == "__main__":
    main()
