"""Ulysses context parallelism for packed batches."""
