"""A linked request's plan, built once at admission (sglang_patches.plan.link_plan), and the
radix-tree keys it derives (sglang_patches.plan.keys)."""
