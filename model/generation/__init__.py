"""Making images: the pipeline, the sampling loop, the scheduler, guidance, the step cache.

Empty on purpose: the torch-free scheduler config must import without torch."""
