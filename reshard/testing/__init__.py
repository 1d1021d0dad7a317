"""Makers of real checkpoints for the tests, the benchmarks and the demo: not the product.

`synthetic` writes FSDP2-like DCP checkpoints with `dcp.save` in local ranks, `synthetic_llama`
a Llama in torchtitan's layout (TP, fused QKV), and `synthetic_metadata` the `.metadata` of a
frontier-scale run over sparse data files. They use reshard like any trainer would.
"""
