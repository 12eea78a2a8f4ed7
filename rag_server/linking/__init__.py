"""The frontend's link pipeline: compile a prompt's chunks, link, relink on misses, stream."""
