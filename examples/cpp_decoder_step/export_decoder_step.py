"""Exports one decoder step that uses opmesh's operators as an AOTInductor package, with inputs
and the outputs Python computes for them, for run_decoder_step.cpp to load and check.

The step: project the new token of every sequence to q, k and v; append k and v to a paged cache
with opmesh.kv_cache_write_; attend with opmesh.flash_attn over each sequence's cached keys
(causal, GQA); project back.

Run: ``python export_decoder_step.py OUT_DIR``; writes OUT_DIR/decoder_step.pt2, inputs.pt and
expected.pt (lists of tensors, torch.save format, which C++ reads with torch::pickle_load).
"""

from __future__ import annotations

import argparse
import os

import torch

import opmesh

HEADS, KV_HEADS, DIM, HIDDEN, BLOCK = 8, 2, 32, 256, 16


class DecoderStep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.Linear(HIDDEN, HEADS * DIM, bias=False)
        self.kv = torch.nn.Linear(HIDDEN, 2 * KV_HEADS * DIM, bias=False)
        self.o = torch.nn.Linear(HEADS * DIM, HIDDEN, bias=False)

    def forward(self, x, k_cache, v_cache, block_table, seqused_kv, slot_mapping):
        batch = x.shape[0]
        q = self.q(x).view(batch, 1, HEADS, DIM)
        k, v = self.kv(x).view(batch, 2, KV_HEADS, DIM).unbind(1)
        torch.ops.opmesh.kv_cache_write_(k, v, k_cache, v_cache, slot_mapping)
        out, _ = torch.ops.opmesh.flash_attn(
            q, k_cache, v_cache, block_table=block_table, seqused_kv=seqused_kv, mask_mode=3,
            layout_kv="PA_BBND",
        )  # fmt: skip
        return self.o(out.reshape(batch, HEADS * DIM))


def inputs(batch=3, blocks_per_seq=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 17, 0][:batch], dtype=torch.int32)  # keys before this step
    k_cache = torch.randn(batch * blocks_per_seq, BLOCK, KV_HEADS, DIM, generator=g)
    v_cache = torch.randn(batch * blocks_per_seq, BLOCK, KV_HEADS, DIM, generator=g)
    block_table = torch.randperm(batch * blocks_per_seq, generator=g).view(batch, -1).int()
    positions = lengths.long()
    slots = block_table.long().gather(1, (positions // BLOCK).view(-1, 1)).flatten() * BLOCK
    slots = slots + positions % BLOCK
    x = torch.randn(batch, HIDDEN, generator=g)
    return [x, k_cache, v_cache, block_table, lengths + 1, slots]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="where to write the package, inputs and outputs")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    model = DecoderStep().eval()
    example = inputs()
    with torch.no_grad():
        program = torch.export.export(model, tuple(t.clone() for t in example))
        package = torch._inductor.aoti_compile_and_package(
            program, package_path=os.path.join(args.out_dir, "decoder_step.pt2")
        )
        run = [t.clone() for t in example]
        out = model(*run)
    # What C++ must reproduce: the output and both caches after the in-place append.
    torch.save(example, os.path.join(args.out_dir, "inputs.pt"))
    torch.save([out, run[1], run[2]], os.path.join(args.out_dir, "expected.pt"))
    print(f"wrote {package} (opmesh {opmesh.__version__})")


if __name__ == "__main__":
    main()
