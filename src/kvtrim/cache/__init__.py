"""Storage and attention math: the layer stores behind the ``KVStore`` protocol (dense, ragged, channel-pruned,
paged) and the attention kernels over them. No policy: what to keep is decided above, in ``kvtrim.compression``."""
