"""The chunk store's tiers below the KV pool: host memory, files on disk, Mooncake (through
SGLang's HiCache storage interface), the codec every tier checks a chunk with, the writer that
saves off the scheduler's thread, and the bounded calls into a remote store."""
