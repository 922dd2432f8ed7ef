"""torchgpipe 0.0.7's public API on fxpipe: change ``torchgpipe`` to ``fxpipe.compat.torchgpipe``.

::

    from fxpipe.compat.torchgpipe import GPipe
    from fxpipe.compat.torchgpipe.balance import balance_by_time
    from fxpipe.compat.torchgpipe.skip import pop, skippable, stash

    model = GPipe(nn.Sequential(...), balance=[2, 2], devices=["cuda:0", "cuda:1"], chunks=8)

``GPipe`` lowers the partitions to a graph and compiles it with ``fxpipe.compile(...,
split_points=...)``; ``@skippable`` skips between partitions become fxpipe skip routes; the
balance helpers measure each layer and cut with fxpipe's exact partitioner.
"""

from fxpipe.compat.torchgpipe.checkpoint import is_checkpointing, is_recomputing
from fxpipe.compat.torchgpipe.gpipe import GPipe

__version__ = "0.0.7"  # the torchgpipe release whose API this mirrors

__all__ = ["GPipe", "is_checkpointing", "is_recomputing"]
