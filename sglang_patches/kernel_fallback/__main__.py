import sys

from sglang_patches.kernel_fallback import main

raise SystemExit(main(sys.argv))
