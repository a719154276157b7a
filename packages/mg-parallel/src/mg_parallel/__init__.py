"""Megatron-style tensor, sequence, pipeline and data parallelism, ZeRO optimizer and mixed precision
for your own PyTorch model."""

__version__ = "0.1.0"

from mg_parallel.gemm import Gemm, use_gemm
from mg_parallel.grid import ParallelDims, ProcessGrid, build_grid
from mg_parallel.moe import MoEConfig, MoELayer
from mg_parallel.precision import Precision

__all__ = [
    "Gemm",
    "MoEConfig",
    "MoELayer",
    "ParallelDims",
    "Precision",
    "ProcessGrid",
    "__version__",
    "build_grid",
    "use_gemm",
]
