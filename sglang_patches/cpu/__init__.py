"""CPU speed-ups and the CPU launch: RoPE and decode with fewer ops, workers forked, not spawned."""
