from __future__ import annotations

import os

# Without a GPU, Triton kernels run in Triton's interpreter (small shapes only), so every
# kernel's shape-sweep test also runs on CPU machines. Must be set before triton is imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass
