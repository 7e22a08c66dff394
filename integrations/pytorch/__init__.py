"""Plain PyTorch: ``ddp`` (DistributedDataParallel, and a plain module, through a comm hook and the optimizer's step
hooks), ``fsdp`` (FSDP2, ``attach_fsdp``), ``optim`` (the optimizer step hooks the others share), ``amp`` (what is
read of a torch.amp ``GradScaler``), ``loops`` (what the trainer callbacks share for loops arc_engine does not own).
Nothing is imported here: ``import arc_engine.integrations.pytorch.ddp`` loads only what it needs."""
