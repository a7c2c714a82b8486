"""The transformers adapters: ``KVTrimCache`` (a ``Cache`` over kvtrim's stores, forwarding to its
``CompressionState``), kvtrim's attention implementation, and the prompt-ids hook. Thin by design."""
