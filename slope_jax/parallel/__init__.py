"""Parallel machinery: layout config and mesh, zigzag layout, named collectives, context parallelism (Ulysses x ring
attention, sliding-window halos) and the pipeline step. `config` needs no JAX."""
