"""Triton: the tensor contract (``contract``), the one class owning a local tritonserver (``server``), the
repository profiles' configs (``configs``), building (``repository``) and checking (``checks``), and the code the
profiles serve (``portable_model``, ``dali_pipeline``). Nothing here imports an engine.
"""
