"""DistributedOps of the library's operators (declared in ../yaml/*.yaml, imported on first use)."""
