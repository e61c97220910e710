"""Tensor parallelism's bottom layer: a rank's view of its group (sizes of its shards, the
collectives the layers call). Imports only torch, so layers/ can use it."""
