"""Stand-ins for `sgl_kernel.utils` (see _unavailable)."""

from sglang_patches.kernel_fallback.sgl_kernel._unavailable import SUBMODULES, stand_ins

globals().update(stand_ins(__name__, SUBMODULES["utils"]))
