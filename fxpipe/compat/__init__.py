"""Drop-in front ends for code written for other pipeline libraries.

``fxpipe.compat.torchgpipe`` has torchgpipe 0.0.7's public API (``GPipe``, ``torchgpipe.skip``,
``torchgpipe.balance``, ``is_checkpointing``/``is_recomputing``) on fxpipe's compiler and
runtime: change the import prefix ``torchgpipe`` to ``fxpipe.compat.torchgpipe`` and the code
runs. Models written for ``torch.distributed.pipelining`` need no module here: fxpipe reads
their ``pipe_split()`` markers and takes ``split_spec=`` itself (:mod:`fxpipe.frontend.markers`).
"""
