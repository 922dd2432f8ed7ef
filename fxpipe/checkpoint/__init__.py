"""Checkpoints: a pipe's training state saved and loaded by FQN with torch.distributed.checkpoint.

Reads a :class:`~fxpipe.Pipe` (or a plain module), its optimizer and what the runtime holds
in flight; produces a checkpoint directory every rank writes its own part of, published whole
(:mod:`~fxpipe.checkpoint.directory`), and loads one into any plan (:mod:`~fxpipe.checkpoint.saveload`;
optimizer, random generators and batch-norm sums: :mod:`~fxpipe.checkpoint.trainstate`).
"""
