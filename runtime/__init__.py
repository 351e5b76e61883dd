"""fairtick runtime package: MLX execution.

Every MLX import in fairtick is under this package, so the optimized BLAS is loaded here,
before any of its modules imports MLX (see runtime/blas.py).
"""

from runtime.blas import load_blas

load_blas()
