"""The MindSpore suite (make test-mindspore): runs in .venv-mindspore, beside torch.

Both bindings carry their own copy of the core, so the process fixes what each would otherwise
choose on its own: the worker count (flash_attn's plan) and the bf16 kernels (a measured choice).
With those equal, both frameworks run the same kernels on the same plan and must agree bitwise.
"""

import os

import torch

os.environ.setdefault("OPMESH_NUM_THREADS", str(torch.get_num_threads()))
os.environ.setdefault("OPMESH_BF16_KERNELS", "pairs")
