"""Framework adapters, installed as ``arc_engine.integrations``: thin layers over each framework's own
extension points (DDP comm hooks, optimizer step hooks; DeepSpeed, FSDP2 and Megatron to follow)."""
