"""The tools beside the library: the end-to-end demo, the benchmark and its host baselines, the model
scenarios they share, and the byte-level verifier.

* :mod:`.demo`: ``kvplan demo``, a two-process hand-off verified byte for byte;
* :mod:`.bench`: ``kvplan bench``, kvplan against the strongest host planners;
* :mod:`.host_baselines` and :mod:`.baseline`: those planners (``numpy-batch``, ``prepared-ids``,
  ``sglang-loop``);
* :mod:`.scenarios`: model-shaped batches (the presets of ``docs/benchmarks.md``);
* :mod:`.verify`: executes descriptors on an address space of tensors.

The library (``kvplan.planner``, ``kvplan.transport``) never imports them.
"""
