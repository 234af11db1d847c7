"""Triton: the tensor contract (``contract``), the one class owning a local tritonserver (``server``), the
repository profiles' configs (``configs``), building (``repository``) and checking (``checks``), the DALI graph
(``dali_pipeline``) and, in ``serve``, the code the server runs. Nothing here but ``serve`` imports an engine.
"""
