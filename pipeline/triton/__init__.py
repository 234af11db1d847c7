"""Triton, all of it: the tensor contract (``contract``), the one class owning a local tritonserver (``server``, with
``sharing``, ``mps``, ``workdirs``), the client the triton engine runs (``client``, ``wire``, ``client_checks``,
``supervisor``), the repository profiles' configs (``configs``), building (``repository``, ``repository_cache``,
``prepare``) and checking (``checks``), the production profile's DALI model (``dali_pipeline``) and, in ``serve``, the
code the server runs. It stands on ``pipeline.gpu`` (the gpu profile serves its classifier) and never imports an
engine.
"""
