"""Stage 3, engines: what a case trains with: the adapters over each engine and the references (DDP, local),
the parity optimizers, checkpoints and DTensor helpers they share, and the engine registry.
"""
