"""Budget allocators: how many entries each (row, layer, KV head) keeps."""
