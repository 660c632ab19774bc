"""Planning job: the Llama-3-70B shape of examples/llama.py, bf16 parameters with fp32 gradient reduction.

For reading plans at scale, not for running on this machine (70.6B parameters):

    shardlang plan examples/llama_70b.py --world 1024                                # keeps every activation
    shardlang plan examples/llama_70b.py --world 1024 --recompute 'layers.*=full'   # full recompute on the layers
    shardlang plan examples/llama_70b.py --world 1024 --memory-budget 80GiB         # let the compiler choose

The model, data, loss and optimizer are examples/llama.py's at ``LLAMA_SIZE=70b``
(set here unless the environment names another size): 80 layers, d=8192, 64
heads with 8 KV heads, vocabulary 128256, sequences of 4096 tokens, a global
batch of 1024 sequences (one per rank at 1024 ranks). The spec is llama.py's
(every parameter sharded, units ``tok_embeddings``, ``layers.*``, ``output``)
with mixed precision: parameters gathered and computed in bfloat16, gradients
reduced in float32, as FSDP2's ``MixedPrecisionPolicy(torch.bfloat16, torch.float32)``.
docs/plan.md ("Recompute and the memory budget") shows the plans.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

import shardlang as sl

os.environ.setdefault("LLAMA_SIZE", "70b")
_source = importlib.util.spec_from_file_location("_shardlang_examples_llama_70b", Path(__file__).with_name("llama.py"))
llama = sys.modules.setdefault(_source.name, importlib.util.module_from_spec(_source))
_source.loader.exec_module(llama)  # registered first: its dataclasses look their module up

build_model = llama.build_model
loss_fn = llama.loss_fn
make_batch = llama.make_batch
optimizer = llama.optimizer
spec = sl.Spec(mesh=llama.spec.mesh, rules=llama.spec.rules, units=llama.spec.units,
               options=sl.Options(mixed_precision=sl.MixedPrecision(param_dtype=torch.bfloat16,
                                                                    reduce_dtype=torch.float32)))
