"""Workarounds of library limits, one module per library (`accelerate.py`, `deepspeed.py`, `torch.py`,
`transformers.py`), each naming the version it was read in. The ones that belong to one concern's code (a checkpoint's
RNG check, the ZeRO-3 universal load, LoRA's merge under ZeRO-3) stay beside that code."""
