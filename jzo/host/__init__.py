"""The host side of offload: the optimizer state in host RAM and its kernel
pass (HostAdam), the copies between device shards and host memory
(transfer), the update's modes, each a strategy the engine picks once
(update), and lazy host arrays for params given from files (leaf)."""
