"""The model: where it comes from (`source.py`, `hub.py`), how it computes (`kernels.py`, `compilation.py`,
`precision_support.py`, `activation_checkpointing.py`, `padding_free.py`), which of its modules FSDP shards
(`fsdp_wrap.py`), its LoRA adapters (`adapters.py`) and the memory its state holds on one rank (`memstats.py`)."""
