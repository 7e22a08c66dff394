"""Framework adapters, installed as ``arc_engine.integrations``: thin layers over each framework's own
extension points -- ``ddp`` (DDP comm hook), ``torch_optim`` (optimizer step hooks), ``fsdp`` (FSDP2
post-accumulate-grad hooks on sharded and unsharded parameters). DeepSpeed and Megatron are to follow."""
