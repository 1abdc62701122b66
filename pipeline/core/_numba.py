"""numba, imported for the kernels without its BLAS probe.

When it first loads or compiles a kernel numba checks for BLAS by importing
``scipy.linalg`` (0.2 s at rest, more on a loaded machine), which only its
linear-algebra functions use; no kernel of ours calls them. The probe is answered "absent" for the duration of
the import (``scipy.linalg`` itself stays importable afterwards).
"""

from __future__ import annotations

import sys

_PROBE = "scipy.linalg.cython_blas"

if "numba" in sys.modules or _PROBE in sys.modules:
    import numba
else:
    sys.modules[_PROBE] = None  # makes `import scipy.linalg.cython_blas` fail at once
    try:
        import numba
        import numba.np.arraymath  # noqa: F401  (where the probe runs, on first compile)
    finally:
        if sys.modules.get(_PROBE, 0) is None:
            del sys.modules[_PROBE]

__all__ = ["numba"]
