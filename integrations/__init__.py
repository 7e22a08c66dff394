"""Framework adapters, installed as ``arc_engine.integrations``: thin layers over each framework's own extension
points, one package per framework.

- ``pytorch``: ``ddp`` (DDP comm hook; a plain module too), ``fsdp`` (FSDP2 post-accumulate-grad hooks on the
  shards), ``optim`` (optimizer step hooks), ``amp`` (what is read of a ``GradScaler``), ``loops`` (what the
  trainer callbacks share for loops arc_engine does not own). Named for the framework, not ``torch``: a
  subpackage named like a top-level library misleads readers and tools.
- ``deepspeed``: the ZeRO adapter (``attach_deepspeed``) in its ``__init__``; ``internals`` (every read of ZeRO's
  private state), ``local``, ``zero3``, ``state``, ``recompute``.
- ``megatron``: the megatron-core adapter (``attach_megatron``) in its ``__init__``; ``internals``, ``state``,
  ``checkpoint``, ``recompute``.
- ``hf``, ``lightning``: ``ArcCallback`` for the Hugging Face Trainer and for PyTorch Lightning.
"""
