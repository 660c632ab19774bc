#!/usr/bin/env bash
# One GPU, one process: shardlang's step against plain PyTorch and FSDP2, the memory plan against
# torch.cuda.max_memory_allocated, and the inductor backend (benchmarks/gpu.py). From any directory:
#   benchmarks/gpu.sh                      # the 100M GPT, 10 timed steps, writes gpu.json
#   SIZE=10M STEPS=20 OUT=/tmp/g.json benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'benchmarks/gpu.sh needs a CUDA device; python -m benchmarks.gpu runs the same on the CPU')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
python -m benchmarks.gpu --size "${SIZE:-100M}" --steps "${STEPS:-10}" --out "${OUT:-gpu.json}"
