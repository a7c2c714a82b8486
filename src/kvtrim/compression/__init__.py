"""One compression: a ``Pipeline`` (scorer → budget allocator → selector), the compressor that runs it over a
cache, the schedules that say when, and the ``CompressionState`` that owns a cache's policy and reports."""
