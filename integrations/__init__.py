"""Framework adapters, installed as ``arc_engine.integrations``: thin layers over each framework's own
extension points -- ``ddp`` (DDP comm hook), ``torch_optim`` (optimizer step hooks), ``fsdp`` (FSDP2
post-accumulate-grad hooks on sharded and unsharded parameters), ``deepspeed`` / ``deepspeed_zero3`` (the torch
optimizer DeepSpeed's ZeRO optimizer wraps). Megatron is to follow."""
