"""The parts every native model family is built from (see :mod:`services.worker.models`).

- :mod:`~services.worker.layers.plan`: one step's shared plan (KV slots, the decode rows' block tables
  and masks, each prefill's blocks and mask), made once per step for all layers;
- :mod:`~services.worker.layers.attention`: rotary position embedding, the KV write and attention over
  the paged pool (decode rows at once, prefills one by one);
- :mod:`~services.worker.layers.mlp`: the gated MLP;
- :mod:`~services.worker.layers.norm`: RMS norm;
- :mod:`~services.worker.layers.parallel`: tensor parallelism as the layers see it (a rank's shard, and
  column- and row-parallel projections).

Each layer takes the kernels it runs on when it is made: torch's ops, or the kernel library's / Triton's
(:class:`services.worker.fused_ops.FusedOps`) where they apply. The projections themselves are
:class:`services.worker.quantized.Linear` objects (dense, packed or GGUF blocks).
"""
