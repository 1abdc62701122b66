"""numba, imported for the kernels without its BLAS and cffi probes.

When it first loads or compiles a kernel numba checks for BLAS by importing
``scipy.linalg`` (0.2 s at rest, more on a loaded machine), and on import for
cffi (0.1 s), which only kernels calling linear algebra or C functions use;
ours call neither. Both probes are answered "absent" for the duration of the
import (the modules themselves stay importable afterwards).
"""

from __future__ import annotations

import sys

# BLAS (scipy.linalg, 0.2 s) and cffi (its C parser, 0.1 s): numba supports
# calling them from kernels, which ours never do
_PROBES = ("scipy.linalg.cython_blas", "cffi")

if "numba" in sys.modules:
    import numba
else:
    hidden = [name for name in _PROBES if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # makes `import name` fail at once
    try:
        import numba
        import numba.core.typing.cffi_utils  # noqa: F401  (the cffi probe)
        import numba.np.arraymath  # noqa: F401  (the BLAS probe, else run on first compile)
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]

__all__ = ["numba"]
