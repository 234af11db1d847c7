"""Engines: one module per engine (``onnx``, ``triton``, ``gpu``), registered in ``base.REGISTRY``.

``base`` holds the contract every engine keeps (``Engine``, ``Result``, ``results_from_topk``) and the registry the
config, the CLI, the actor and the job read. Engines import from ``pipeline.triton``, never the other way round.
"""
