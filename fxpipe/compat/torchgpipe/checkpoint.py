"""Which pass a layer's forward is in: fxpipe's checkpointing flags under torchgpipe's names."""

from fxpipe.runtime.stage.recompute import is_checkpointing, is_recomputing

__all__ = ["is_checkpointing", "is_recomputing"]
